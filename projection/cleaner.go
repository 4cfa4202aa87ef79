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

// startCleaner starts the service's retention worker; when disabled, one
// that only measures the rows due (epitaph_projector_expired_oldest_seconds
// is then measured, never a 0 nobody read).
func (s *Service) startCleaner(ctx context.Context) error {
	cfg := retention.CleanerConfig{Interval: s.cfg.CleanupInterval, Batch: s.cfg.CleanupBatch,
		StatementTimeout: s.cfg.CleanupTimeout, Rate: max(0, s.cfg.CleanupRate), Busy: s.liveBusy, Logger: s.log}
	if s.cfg.CleanupInterval < 0 {
		cfg = retention.CleanerConfig{StatementTimeout: s.cfg.CleanupTimeout, Logger: s.log, MeasureOnly: true}
	}
	s.cleaner = retention.NewCleaner(s.pool, cfg, s.retention)
	if err := s.cleaner.Start(ctx); err != nil {
		return fmt.Errorf("retention cleanup: %w", err)
	}
	return nil
}
