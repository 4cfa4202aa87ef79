package projection

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// The rebuild share: pages of non-live versions take one of
// ceil(share x P) slots; live pages never wait. Side effects run for the
// live version only.
func TestRebuildGateAndSideEffects(t *testing.T) {
	var calls []int
	s, err := New(Config{TargetURL: "postgres://x", NATSURL: "nats://x", WorkerID: "w", RebuildShare: 0.25,
		SideEffects: func(_ context.Context, p SideEffectPage) error {
			calls = append(calls, p.Version)
			return nil
		}})
	require.NoError(t, err)
	s.partitions = 8
	live, building := version.Version{Projection: "archive", Version: 1, State: version.StateLive}, version.Version{Projection: "archive", Version: 2, State: version.StateBuilding}
	s.setLive([]version.Version{live, building})
	require.Equal(t, 2, cap(s.rebuildGate))

	ctx := context.Background()
	clock := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	s.now = func() time.Time { return clock }
	idle, err := s.admit(ctx, building)
	require.NoError(t, err)
	require.Len(t, s.rebuildGate, 0, "live idle: a rebuild page takes no slot")
	idle()
	rl0, err := s.admit(ctx, live) // the live version is busy from now
	require.NoError(t, err)
	rl0()
	r1, err := s.admit(ctx, building)
	require.NoError(t, err)
	r2, err := s.admit(ctx, building)
	require.NoError(t, err)
	short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	_, err = s.admit(short, building)
	require.ErrorIs(t, err, context.DeadlineExceeded, "a third rebuild page waits")
	rl, err := s.admit(short, live)
	require.NoError(t, err, "live pages never wait")
	rl()
	r1()
	r3, err := s.admit(ctx, building)
	require.NoError(t, err)
	r2()
	r3()
	clock = clock.Add(2 * liveIdle)
	var rs []func()
	for i := 0; i < 5; i++ {
		r, err := s.admit(ctx, building)
		require.NoError(t, err, "live idle again: rebuild pages are not limited")
		rs = append(rs, r)
	}
	for _, r := range rs {
		r()
	}

	items := []*item{{ev: &event.Event{Op: event.OpDelete}}, {ev: &event.Event{Op: event.OpCommit}}, {category: "malformed"}}
	s.afterPage(ctx, building, 0, items)
	require.Empty(t, calls, "never for a version being built")
	s.afterPage(ctx, live, 0, items)
	require.Equal(t, []int{1}, calls)
	// Promoted: the next balance sees v2 live, and only v2 acts.
	s.setLive([]version.Version{{Projection: "archive", Version: 1, State: version.StateReady}, {Projection: "archive", Version: 2, State: version.StateLive}})
	s.afterPage(ctx, live, 0, items)
	s.afterPage(ctx, building, 0, items)
	require.Equal(t, []int{1, 2}, calls)

	// The previous live version, now ready, is kept current: not throttled.
	rl0, err = s.admit(ctx, building) // v2 is live: the live version is busy
	require.NoError(t, err)
	rl0()
	s.setLive([]version.Version{{Projection: "archive", Version: 1, State: version.StateReady}, {Projection: "archive", Version: 2, State: version.StateLive},
		{Projection: "archive", Version: 3, State: version.StateCatchingUp}})
	catching := version.Version{Projection: "archive", Version: 3, State: version.StateCatchingUp}
	var held []func()
	for i := 0; i < cap(s.rebuildGate); i++ {
		r, err := s.admit(ctx, catching)
		require.NoError(t, err)
		held = append(held, r)
	}
	short2, cancel2 := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel2()
	_, err = s.admit(short2, catching)
	require.ErrorIs(t, err, context.DeadlineExceeded, "catching_up is throttled")
	for i := 0; i < 5; i++ {
		r, err := s.admit(short2, live) // v1, ready
		require.NoError(t, err, "a ready version is never throttled")
		r()
	}
	for _, r := range held {
		r()
	}
}
