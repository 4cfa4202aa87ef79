package projection

import (
	"context"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/progress"
	"github.com/epitaph-dev/epitaph/projection/snapshot"
	"github.com/epitaph-dev/epitaph/projection/status"
	"github.com/epitaph-dev/epitaph/projection/version"
	"github.com/epitaph-dev/epitaph/quarantine"
)

// SideEffectPage is one committed page of the live version, for
// Config.SideEffects.
type SideEffectPage struct {
	Projection string
	Version    int
	Partition  int
	// Events are the page's applied events in stream order (deletes,
	// commits, marks; quarantined events are not in it).
	Events []*event.Event
}

// isLive reports whether v is the live version as of the last balance.
func (s *Service) isLive(v version.Version) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.live[v.Projection] == v.Version
}

// setLive records the live versions seen by a balance, and sizes the
// rebuild gate once the partition count is known.
func (s *Service) setLive(vs []version.Version) {
	live := map[string]int{}
	throttled := map[version.VersionKey]bool{}
	for _, v := range vs {
		switch v.State {
		case version.StateLive:
			live[v.Projection] = v.Version
		case version.StateBuilding, version.StateCatchingUp:
			throttled[v.Key()] = true
		}
	}
	s.mu.Lock()
	s.live, s.throttled = live, throttled
	if s.rebuildGate == nil && s.partitions > 0 {
		s.rebuildGate = make(chan struct{}, max(1, int(math.Ceil(s.cfg.RebuildShare*float64(s.partitions)))))
	}
	s.mu.Unlock()
}

// liveIdle is how long after the last page of a live version the live
// work counts as idle: then pages of other versions are not limited by
// the rebuild share (a rebuild runs at full speed while nothing else does).
const liveIdle = time.Second

// admit waits, for a page of a version being built or caught up, for a
// slot of the rebuild share while the live version is busy; pages of the
// live version, and of a ready one (the previous live version kept
// current for a rollback), pass at once. The returned release must be
// called after the page.
func (s *Service) admit(ctx context.Context, v version.Version) (release func(), err error) {
	now := s.now()
	s.mu.Lock()
	gate := s.rebuildGate
	live := s.live[v.Projection] == v.Version
	if live {
		s.lastLivePage = now
	}
	idle := now.Sub(s.lastLivePage) > liveIdle
	throttled := s.throttled[v.Key()]
	s.mu.Unlock()
	if !throttled || gate == nil || idle {
		return func() {}, nil
	}
	select {
	case gate <- struct{}{}:
		return func() { <-gate }, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// afterPage runs the side-effect hook for a committed page of the live
// version (and never for any other version).
func (s *Service) afterPage(ctx context.Context, v version.Version, partition int, items []*item) {
	if s.cfg.SideEffects == nil || !s.isLive(v) {
		return
	}
	page := SideEffectPage{Projection: v.Projection, Version: v.Version, Partition: partition}
	for _, it := range items {
		if it.ev != nil && it.category == "" && !it.replay {
			page.Events = append(page.Events, it.ev)
		}
	}
	if len(page.Events) == 0 {
		return
	}
	if err := s.cfg.SideEffects(ctx, page); err != nil {
		s.metrics.transient.WithLabelValues("side_effect").Inc()
		s.log.Warn("side effect failed (not retried)", "projection", v.Projection, "version", v.Version,
			"partition", partition, "err", quarantine.Sanitize(err))
	}
}

// lifecycleLoop advances the version states every BalanceInterval until
// ctx is done.
func (s *Service) lifecycleLoop(ctx context.Context) {
	t := time.NewTicker(s.cfg.BalanceInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		c, cancel := context.WithTimeout(ctx, max(s.cfg.BalanceInterval, 5*time.Second))
		vs, err := version.ListVersions(c, s.pool, "")
		if err == nil {
			err = s.advanceStates(c, vs)
		}
		cancel()
		if err != nil && ctx.Err() == nil {
			s.log.Warn("advance version states; retrying", "err", quarantine.Sanitize(err))
		}
	}
}

// advanceStates moves the versions being built along the state machine,
// one step per version per round (so every state is observable):
//
//   - building -> catching_up when every partition has applied its
//     messages up to the boundary (no message of the partition between its
//     cursor and the boundary);
//   - catching_up -> ready when the version's unapplied events are at most
//     ReadyMaxLag, its oldest unapplied event at most ReadyMaxPendingAge
//     old, its pending snapshot jobs likewise (at most ReadyMaxLag, the
//     oldest at most ReadyMaxPendingAge), and it has no unresolved
//     quarantine;
//   - ready -> catching_up when it falls twice as far behind (events or
//     snapshots) or gets quarantine (the live version is never touched).
//
// Every worker may run it; each step is a compare-and-swap on the state.
func (s *Service) advanceStates(ctx context.Context, vs []version.Version) error {
	var stream jetstream.Stream
	for _, v := range vs {
		if v.State != version.StateBuilding && v.State != version.StateCatchingUp && v.State != version.StateReady {
			continue
		}
		if stream == nil {
			var err error
			if stream, err = s.js.Stream(ctx, event.StreamName(s.cfg.SourceName)); err != nil {
				return fmt.Errorf("stream: %w", err)
			}
		}
		next, err := s.nextState(ctx, stream, v)
		if err != nil {
			return fmt.Errorf("state of %s v%d: %w", v.Projection, v.Version, err)
		}
		if next == v.State {
			continue
		}
		moved, err := SetState(ctx, s.pool, v.Projection, v.Version, v.State, next)
		if err != nil {
			return err
		}
		if moved {
			s.log.Info("version state changed", "projection", v.Projection, "version", v.Version, "from", v.State, "to", next)
		}
	}
	return nil
}

func (s *Service) nextState(ctx context.Context, stream jetstream.Stream, v version.Version) (string, error) {
	prs, err := progress.List(ctx, s.pool, v.Projection, v.Version)
	if err != nil || len(prs) == 0 {
		return v.State, err
	}
	if v.State == version.StateBuilding {
		boundary := uint64(0)
		if v.BoundarySeq != nil {
			boundary = uint64(*v.BoundarySeq)
		}
		for _, r := range prs {
			reached, err := reachedBoundary(ctx, stream, s.cfg.SourceName, r, boundary)
			if err != nil || !reached {
				return v.State, err
			}
		}
		return version.StateCatchingUp, nil
	}
	var lag uint64
	var age float64
	for _, r := range prs {
		var ps status.PartitionStatus
		if err := status.PartitionLag(ctx, stream, s.cfg.SourceName, r, &ps, s.now()); err != nil {
			return v.State, err
		}
		lag += ps.LagEvents
		age = max(age, ps.OldestPendingAgeSeconds)
	}
	var open int
	if err := s.pool.QueryRow(ctx, `SELECT count(*) FROM epitaph.quarantine WHERE projection = $1 AND version = $2 AND status = 'open'`,
		v.Projection, v.Version).Scan(&open); err != nil {
		return v.State, fmt.Errorf("count quarantine: %w", err)
	}
	// The snapshot backlog counts like the events: a version whose
	// documents lag is not ready, so promoting it never turns documents
	// readers had into "pending".
	snapLag, snapAge, err := snapshot.Backlog(ctx, s.pool, v.Schema)
	if err != nil {
		return v.State, err
	}
	maxAge := s.cfg.ReadyMaxPendingAge.Seconds()
	switch v.State {
	case version.StateCatchingUp:
		if open == 0 && lag <= s.cfg.ReadyMaxLag && age <= maxAge &&
			uint64(snapLag) <= s.cfg.ReadyMaxLag && snapAge.Seconds() <= maxAge {
			return version.StateReady, nil
		}
	case version.StateReady:
		if open > 0 || lag > 2*s.cfg.ReadyMaxLag || age > 2*maxAge ||
			uint64(snapLag) > 2*s.cfg.ReadyMaxLag || snapAge.Seconds() > 2*maxAge {
			return version.StateCatchingUp, nil
		}
	}
	return v.State, nil
}

// reachedBoundary reports whether a partition has applied every message
// of it at or before boundary.
func reachedBoundary(ctx context.Context, stream jetstream.Stream, source string, r progress.Row, boundary uint64) (bool, error) {
	if r.Cursor >= boundary {
		return true, nil
	}
	raw, err := stream.GetMsg(ctx, r.Cursor+1, jetstream.WithGetMsgSubject(event.PartitionFilter(source, r.Partition)))
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return true, nil
	}
	if err != nil {
		return false, fmt.Errorf("next message of partition %d after %d: %w", r.Partition, r.Cursor, err)
	}
	return raw.Sequence > boundary, nil
}

// SetState moves a version from state from to state to (compare-and-swap;
// false when it was not in from), stamping the transition's time. Only the
// building, catching_up and ready states move this way; live, retired and
// failed are set by Promote, Rollback, Retire and EnsureArchive.
func SetState(ctx context.Context, db progress.DB, projection string, n int, from, to string) (bool, error) {
	col := map[string]string{version.StateBuilding: "building_at", version.StateCatchingUp: "catching_up_at", version.StateReady: "ready_at"}[to]
	if col == "" || (from != version.StateBuilding && from != version.StateCatchingUp && from != version.StateReady) {
		return false, fmt.Errorf("set state of %s v%d: %s -> %s is not a worker transition", projection, n, from, to)
	}
	tag, err := db.Exec(ctx, `UPDATE epitaph.projection_versions SET state = $4, `+col+` = now()
		WHERE projection = $1 AND version = $2 AND state = $3`, projection, n, from, to)
	if err != nil {
		return false, fmt.Errorf("set state of %s v%d to %s: %w", projection, n, to, err)
	}
	return tag.RowsAffected() == 1, nil
}
