package projection

import (
	"context"
	"fmt"

	"github.com/epitaph-dev/epitaph/projection/retention"
)

// liveBusy: a page of a live version was admitted within liveIdle (the
// projector is applying); the cleaner paces itself then.
func (s *Service) liveBusy() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return !s.lastLivePage.IsZero() && s.now().Sub(s.lastLivePage) <= liveIdle
}

// startCleaner starts the service's retention worker unless disabled.
func (s *Service) startCleaner(ctx context.Context) error {
	if s.cfg.CleanupInterval < 0 {
		return nil
	}
	s.cleaner = retention.NewCleaner(s.pool, retention.CleanerConfig{Interval: s.cfg.CleanupInterval, Batch: s.cfg.CleanupBatch,
		StatementTimeout: s.cfg.CleanupTimeout, Rate: max(0, s.cfg.CleanupRate), Busy: s.liveBusy, Logger: s.log}, s.retention)
	if err := s.cleaner.Start(ctx); err != nil {
		return fmt.Errorf("retention cleanup: %w", err)
	}
	return nil
}
