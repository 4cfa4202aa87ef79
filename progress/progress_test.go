package progress_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/progress"
)

func TestMain(m *testing.M) { testenv.MainNoLeaks(m) }

func setup(t *testing.T, partitions int) *pgxpool.Pool {
	t.Helper()
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, testenv.NoSearchPath(testenv.NewDatabase(t))) // a missing schema qualifier fails
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	require.NoError(t, migrations.Apply(ctx, pool))
	require.NoError(t, progress.Ensure(ctx, pool, "archive", 1, partitions))
	require.NoError(t, progress.Ensure(ctx, pool, "archive", 1, partitions)) // idempotent
	return pool
}

func leaser(t *testing.T, pool *pgxpool.Pool, id string, ttl time.Duration) *progress.Leaser {
	t.Helper()
	l, err := progress.NewLeaser(pool, id, ttl)
	require.NoError(t, err)
	require.NoError(t, l.Heartbeat(context.Background()))
	return l
}

func advance(ctx context.Context, pool *pgxpool.Pool, l progress.Lease, old uint64, next progress.Position) error {
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return progress.Advance(ctx, tx, l, old, next, time.Minute)
	})
}

func TestAdvanceRecordsIdentityAndWatermark(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := setup(t, 2)
	a := leaser(t, pool, "a", time.Minute)
	ls, err := a.Claim(ctx, "archive", 1, 1)
	require.NoError(t, err)
	require.Len(t, ls, 1)
	require.Equal(t, int64(1), ls[0].Epoch)
	require.Equal(t, "archive-v1-p0", ls[0].ConsumerName())

	require.NoError(t, advance(ctx, pool, ls[0], 0, progress.Position{Cursor: 7, CommitLSN: 0x1A2B, Seq: 3, MsgID: "main/0/1A2B/3", SourceLSN: 0x1A2B}))
	// The watermark never goes back, even when the cursor rewinds.
	require.NoError(t, advance(ctx, pool, ls[0], 7, progress.Position{Cursor: 2, CommitLSN: 0x10, Seq: -1, MsgID: "x", SourceLSN: 0x10}))
	row, err := progress.Get(ctx, pool, ls[0].Key)
	require.NoError(t, err)
	require.Equal(t, uint64(2), row.Cursor)
	require.Equal(t, event.LSN(0x10), row.CommitLSN)
	require.Equal(t, -1, row.Seq)
	require.Equal(t, "x", row.MsgID)
	require.Equal(t, event.LSN(0x1A2B), row.SourceLSN)
	require.Equal(t, "a", row.Owner)
	require.NotNil(t, row.LastAdvanceAt)

	require.NoError(t, progress.RecordFailure(ctx, pool, ls[0], "incompatible"))
	row, err = progress.Get(ctx, pool, ls[0].Key)
	require.NoError(t, err)
	require.Equal(t, 1, row.Attempts)
	require.Equal(t, "incompatible", row.LastFailureCategory)
}

// Two workers race on one partition: the stale one (its lease was taken
// over) and concurrent advances from the same cursor. Exactly one wins;
// every loser gets ErrLostOwnership and nothing of its write survives.
func TestCompareAndSwapRace(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := setup(t, 1)
	a := leaser(t, pool, "a", time.Minute)
	b := leaser(t, pool, "b", time.Minute)

	la, err := a.Claim(ctx, "archive", 1, 1)
	require.NoError(t, err)
	require.Len(t, la, 1)
	require.NoError(t, advance(ctx, pool, la[0], 0, progress.Position{Cursor: 10, Seq: -1}))

	// a's lease expires (a paused); b takes over with a higher epoch.
	_, err = pool.Exec(ctx, `UPDATE epitaph.progress SET lease_expires_at = now() - interval '1 second'`)
	require.NoError(t, err)
	lb, err := b.Claim(ctx, "archive", 1, 1)
	require.NoError(t, err)
	require.Len(t, lb, 1)
	require.Equal(t, la[0].Epoch+1, lb[0].Epoch)

	// Both now try to advance from cursor 10 at the same time.
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, progress.Advance(ctx, tx, lb[0], 10, progress.Position{Cursor: 20, Seq: -1}, time.Minute))
	stale := make(chan error, 1)
	go func() { stale <- advance(ctx, pool, la[0], 10, progress.Position{Cursor: 15, Seq: -1}) }()
	require.NoError(t, tx.Commit(ctx))
	err = <-stale
	require.ErrorIs(t, err, progress.ErrLostOwnership)

	// A stale renewal also reports the loss.
	kept, err := a.Renew(ctx, la)
	require.NoError(t, err)
	require.Empty(t, kept)

	// Same lease, many concurrent advances from the same cursor: one wins.
	var wg sync.WaitGroup
	var mu sync.Mutex
	wins, losses := 0, 0
	for i := 0; i < 8; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			err := advance(ctx, pool, lb[0], 20, progress.Position{Cursor: uint64(21 + i), Seq: -1})
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil:
				wins++
			case errors.Is(err, progress.ErrLostOwnership):
				losses++
			default:
				t.Errorf("unexpected error: %v", err)
			}
		}(i)
	}
	wg.Wait()
	require.Equal(t, 1, wins)
	require.Equal(t, 7, losses)
	row, err := progress.Get(ctx, pool, lb[0].Key)
	require.NoError(t, err)
	require.Greater(t, row.Cursor, uint64(20))
	require.Equal(t, "b", row.Owner)
}

func owned(ls []progress.Lease) []int {
	out := []int{}
	for _, l := range ls {
		out = append(out, l.Partition)
	}
	return out
}

func TestFairSharing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := setup(t, 8)
	a := leaser(t, pool, "a", time.Minute)

	held, excess, lost, err := a.Balance(ctx, "archive", 1, 8, nil)
	require.NoError(t, err)
	require.Empty(t, excess)
	require.Empty(t, lost)
	require.Len(t, held, 8, "alone, a owns everything")

	b := leaser(t, pool, "b", time.Minute)
	var heldB []progress.Lease
	deadline := time.Now().Add(10 * time.Second)
	for {
		var ex []progress.Lease
		held, ex, _, err = a.Balance(ctx, "archive", 1, 8, held)
		require.NoError(t, err)
		if len(ex) > 0 {
			require.NoError(t, a.Release(ctx, ex))
			held = held[:len(held)-len(ex)]
		}
		heldB, ex, _, err = b.Balance(ctx, "archive", 1, 8, heldB)
		require.NoError(t, err)
		require.Empty(t, ex)
		if len(held) == 4 && len(heldB) == 4 {
			break
		}
		require.True(t, time.Now().Before(deadline), "a=%v b=%v", owned(held), owned(heldB))
	}
	require.Equal(t, []int{0, 1, 2, 3}, owned(held))
	require.Equal(t, []int{4, 5, 6, 7}, owned(heldB))
	rows, err := progress.List(ctx, pool, "archive", 1)
	require.NoError(t, err)
	count := map[string]int{}
	for _, r := range rows {
		count[r.Owner]++
	}
	require.Equal(t, map[string]int{"a": 4, "b": 4}, count)
}

func TestTakeoverAfterExpiry(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := setup(t, 4)
	ttl := 700 * time.Millisecond
	a := leaser(t, pool, "a", ttl)
	heldA, _, _, err := a.Balance(ctx, "archive", 1, 4, nil)
	require.NoError(t, err)
	require.Len(t, heldA, 4)

	// a dies: no more heartbeats or renewals. b takes everything once a's
	// heartbeat and leases have expired, with higher epochs.
	b := leaser(t, pool, "b", ttl)
	var heldB []progress.Lease
	deadline := time.Now().Add(15 * time.Second)
	for len(heldB) < 4 {
		require.True(t, time.Now().Before(deadline), "b owns %v", owned(heldB))
		require.NoError(t, b.Heartbeat(ctx))
		heldB, _, _, err = b.Balance(ctx, "archive", 1, 4, heldB)
		require.NoError(t, err)
		time.Sleep(50 * time.Millisecond) // polling interval, not synchronization
	}
	for i, l := range heldB {
		require.Equal(t, heldA[i].Epoch+1, l.Epoch)
	}
	kept, err := a.Renew(ctx, heldA)
	require.NoError(t, err)
	require.Empty(t, kept, "a's leases are gone")
	err = advance(ctx, pool, heldA[0], 0, progress.Position{Cursor: 1, Seq: -1})
	require.ErrorIs(t, err, progress.ErrLostOwnership)
}

func TestHandoverOnStop(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := setup(t, 8)
	a := leaser(t, pool, "a", time.Hour)
	b := leaser(t, pool, "b", time.Hour)
	heldA, _, _, err := a.Balance(ctx, "archive", 1, 8, nil)
	require.NoError(t, err)
	require.Len(t, heldA, 4)
	heldB, _, _, err := b.Balance(ctx, "archive", 1, 8, nil)
	require.NoError(t, err)
	require.Len(t, heldB, 4)

	// a stops gracefully: b gets everything at once, long before the hour.
	require.NoError(t, a.Release(ctx, heldA))
	require.NoError(t, a.Deregister(ctx))
	heldB, _, _, err = b.Balance(ctx, "archive", 1, 8, heldB)
	require.NoError(t, err)
	require.Equal(t, []int{0, 1, 2, 3, 4, 5, 6, 7}, owned(heldB))

	// A worker that died long ago without deregistering is forgotten.
	_, err = pool.Exec(ctx, `INSERT INTO epitaph.workers (worker_id, heartbeat_at) VALUES ('ghost', now() - interval '2 hours')`)
	require.NoError(t, err)
	n, err := b.PruneWorkers(ctx, time.Hour)
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	live, err := b.LiveWorkers(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, live)
}

// A worker restarted with the same id (its earlier run died holding
// leases that have not expired) takes its own partitions back in its first
// Balance, each with a new epoch that fences the dead run off; another
// worker's unexpired lease is left alone, and a running worker never
// fences off the leases it holds.
func TestBalanceTakesOwnLeasesBack(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := setup(t, 4)
	first := leaser(t, pool, "w1", time.Hour)
	other := leaser(t, pool, "w2", time.Hour)
	held, _, _, err := first.Balance(ctx, "archive", 1, 4, nil)
	require.NoError(t, err)
	require.Len(t, held, 2) // fair share of two live workers
	theirs, _, _, err := other.Balance(ctx, "archive", 1, 4, nil)
	require.NoError(t, err)
	require.Len(t, theirs, 2)
	require.NoError(t, advance(ctx, pool, held[0], 0, progress.Position{Cursor: 5, Seq: -1}))

	// Balancing again while running keeps the same epochs.
	again, excess, lost, err := first.Balance(ctx, "archive", 1, 4, held)
	require.NoError(t, err)
	require.Empty(t, excess)
	require.Empty(t, lost)
	require.Equal(t, epochs(held), epochs(again))

	// The process dies (nothing released); a new one with the same id.
	restarted := leaser(t, pool, "w1", time.Hour)
	back, _, _, err := restarted.Balance(ctx, "archive", 1, 4, nil)
	require.NoError(t, err)
	require.Len(t, back, 2)
	for i, l := range back {
		require.Equal(t, held[i].Partition, l.Partition)
		require.Equal(t, held[i].Epoch+1, l.Epoch)
	}
	rows, err := progress.List(ctx, pool, "archive", 1)
	require.NoError(t, err)
	owners := map[int]string{}
	for _, r := range rows {
		owners[r.Partition] = r.Owner
	}
	for _, l := range theirs {
		require.Equal(t, "w2", owners[l.Partition], "another worker's lease is not taken")
	}
	// The dead run is fenced off.
	require.ErrorIs(t, advance(ctx, pool, held[0], 5, progress.Position{Cursor: 6, Seq: -1}), progress.ErrLostOwnership)
	require.NoError(t, advance(ctx, pool, back[0], 5, progress.Position{Cursor: 6, Seq: -1}))
}

func epochs(ls []progress.Lease) map[int]int64 {
	out := map[int]int64{}
	for _, l := range ls {
		out[l.Partition] = l.Epoch
	}
	return out
}

// The consumer a worker reads a unit through is recorded on the progress
// row, fenced by the epoch; group names never collide across groups.
func TestRecordConsumer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := setup(t, 1)
	a := leaser(t, pool, "a", time.Minute)
	ls, err := a.Claim(ctx, "archive", 1, 1)
	require.NoError(t, err)
	require.Len(t, ls, 1)
	require.Equal(t, "3f2a9c01_archive-v1-p0", ls[0].GroupConsumerName("3f2a9c01"))
	require.Equal(t, "archive-v1-p0", ls[0].GroupConsumerName(""))
	row, err := progress.Get(ctx, pool, ls[0].Key)
	require.NoError(t, err)
	require.Empty(t, row.Consumer)
	require.NoError(t, progress.RecordConsumer(ctx, pool, ls[0], "3f2a9c01_archive-v1-p0"))
	row, err = progress.Get(ctx, pool, ls[0].Key)
	require.NoError(t, err)
	require.Equal(t, "3f2a9c01_archive-v1-p0", row.Consumer)
	stale := ls[0]
	stale.Epoch--
	require.ErrorIs(t, progress.RecordConsumer(ctx, pool, stale, "x"), progress.ErrLostOwnership)
}
