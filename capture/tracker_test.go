package capture

import (
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
)

// TestTrackerConfirmsUnderSteadyTraffic: transactions acknowledged every
// interval, without a pause, never postpone the confirmation of an earlier
// one. Each written position is safe no earlier than its acknowledgement
// plus the sync delay, and no later than a second after that; the buckets
// stay few.
func TestTrackerConfirmsUnderSteadyTraffic(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		sync, every time.Duration
	}{
		{5 * time.Second, 100 * time.Millisecond},
		{5 * time.Second, 10 * time.Millisecond},
		{10 * time.Second, 999 * time.Millisecond},
		{2 * time.Second, 1500 * time.Millisecond},
		{0, 100 * time.Millisecond},
	} {
		t.Run(fmt.Sprintf("sync=%s/every=%s", tc.sync, tc.every), func(t *testing.T) {
			t.Parallel()
			t0 := time.Unix(1000, 0)
			tr := newTracker(tc.sync, t0)
			var lag atomic.Int64
			tr.reportLagTo(&lag)
			type write struct {
				lsn event.LSN
				at  time.Time
			}
			var writes []write
			next := 0 // first write not yet seen safe
			step := 5 * time.Millisecond
			end := t0.Add(tc.sync + 20*time.Second)
			nextWrite := t0
			var lsn event.LSN = 100
			maxPending := 0
			for now := t0; now.Before(end.Add(tc.sync + 2*time.Second)); now = now.Add(step) {
				if !now.Before(nextWrite) && now.Before(end) {
					// A transaction: its publish, its end, its ack.
					f := newFake()
					tr.add(f, 10, "tx")
					lsn += 10
					tr.mark(lsn, now)
					f.ack()
					require.NoError(t, tr.poll(now))
					require.Equal(t, lsn, tr.written)
					writes = append(writes, write{lsn, now})
					nextWrite = nextWrite.Add(tc.every)
				}
				safe := tr.safeLSN(now)
				maxPending = max(maxPending, len(tr.pending))
				for next < len(writes) && safe >= writes[next].lsn {
					next++
				}
				if next > 0 {
					// The newest write the safe position covers.
					w := writes[next-1]
					require.False(t, now.Before(w.at.Add(tc.sync)), "%s written at +%s is safe at +%s, before it is synced",
						w.lsn, w.at.Sub(t0), now.Sub(t0))
				}
				if next < len(writes) {
					w := writes[next]
					require.False(t, now.After(w.at.Add(tc.sync+time.Second)),
						"%s written at +%s is not safe at +%s (safe: %s; sync delay %s)",
						w.lsn, w.at.Sub(t0), now.Sub(t0), safe, tc.sync)
				}
				tr.sent(safe)
				if next < len(writes) {
					require.Equal(t, writes[next].at.UnixNano(), lag.Load(), "the lag counts from the oldest unconfirmed write")
				} else {
					require.Zero(t, lag.Load())
				}
			}
			require.Equal(t, len(writes), next, "every write confirmed")
			require.Equal(t, lsn, tr.safeLSN(end.Add(time.Hour)))
			require.LessOrEqual(t, maxPending, int(tc.sync/time.Second)+2, "buckets are at least a second apart")
		})
	}
}

// TestTrackerConfirmLagWaitsForSent: a safe position counts in the lag
// until it is confirmed to the slot.
func TestTrackerConfirmLagWaitsForSent(t *testing.T) {
	t.Parallel()
	t0 := time.Unix(1000, 0)
	tr := newTracker(time.Second, t0)
	var lag atomic.Int64
	tr.reportLagTo(&lag)
	require.Zero(t, lag.Load())
	tr.mark(10, t0.Add(time.Second))
	require.Equal(t, t0.Add(time.Second).UnixNano(), lag.Load())
	require.Equal(t, event.LSN(10), tr.safeLSN(t0.Add(2*time.Second)))
	require.Equal(t, t0.Add(time.Second).UnixNano(), lag.Load(), "safe, not yet sent")
	tr.mark(20, t0.Add(3*time.Second))
	tr.sent(5)
	require.Equal(t, t0.Add(time.Second).UnixNano(), lag.Load(), "an older position sent")
	tr.sent(10)
	require.Equal(t, t0.Add(3*time.Second).UnixNano(), lag.Load(), "the next written one")
	require.Equal(t, event.LSN(20), tr.safeLSN(t0.Add(3*time.Second)))
	tr.sent(20)
	require.Zero(t, lag.Load())

	// A position at or below the confirmed one (a keepalive at the resume
	// point) is nothing to wait for.
	tr2 := newTracker(time.Minute, t0)
	tr2.safe = 100
	tr2.reportLagTo(&lag)
	tr2.mark(100, t0)
	require.Zero(t, lag.Load())
	require.Empty(t, tr2.pending)
}
