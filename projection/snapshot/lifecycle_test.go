package snapshot_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/projection/snapshot"
)

func TestTwoRootsInOneTransactionGetOnlyTheirOwnDescendants(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.seedOrder(t, 1, 1)
	e.seedOrder(t, 2, 3)

	s := e.begin(t)
	s.deleteOrder(t, 1)
	s.deleteOrder(t, 2)
	require.Equal(t, 2, s.apply(t, orderRoots))
	require.Equal(t, snapshot.Result{Claimed: 2, Completed: 2}, e.batch(t, snapshot.Config{}))

	snaps := e.show(t, s.correlationID())
	require.Len(t, snaps, 2)
	d1, d2 := decodeDoc(t, snaps[`{"id":1}`]), decodeDoc(t, snaps[`{"id":2}`])
	require.Equal(t, []string{`{"line_no":1,"order_id":1}`}, keys(t, d1.Children["public.lines"]))
	require.Equal(t, []string{`{"line_no":1,"order_id":2}`, `{"line_no":2,"order_id":2}`, `{"line_no":3,"order_id":2}`},
		keys(t, d2.Children["public.lines"]))
	require.Equal(t, []string{`{"id":10}`}, keys(t, d1.Children["public.shipments"]))
	require.Equal(t, []string{`{"id":20}`}, keys(t, d2.Children["public.shipments"]))
	require.Equal(t, 1+1+2+1, d1.Meta.EntityCount)
	require.Equal(t, 1+3+4+1, d2.Meta.EntityCount)
	require.Zero(t, d1.Meta.UnrelatedCount, "rows of the other order are not unrelated")
	require.Zero(t, d2.Meta.UnrelatedCount)
	require.Equal(t, snaps[`{"id":1}`].Fingerprint, snaps[`{"id":2}`].Fingerprint, "one group, one set of rows")
}

func TestSelfReferencingTreeAndCycle(t *testing.T) {
	t.Parallel()
	e := setup(t)
	// Tree 1 <- 2 <- 3, 1 <- 4; a cycle 10 <-> 11; a self-loop 20.
	e.exec(t, `INSERT INTO categories VALUES (1, NULL, 'root'), (2, 1, 'a'), (3, 2, 'a1'), (4, 1, 'b'),
		(10, NULL, 'x'), (11, 10, 'y'), (20, NULL, 'self')`)
	e.exec(t, `UPDATE categories SET parent_id = 11 WHERE id = 10`)
	e.exec(t, `UPDATE categories SET parent_id = 20 WHERE id = 20`)

	s := e.begin(t)
	_, err := s.tx.Exec(e.ctx, "SET CONSTRAINTS ALL DEFERRED")
	require.NoError(t, err)
	s.del(t, "public.categories", "id IN (3, 4)")
	s.del(t, "public.categories", "id IN (1, 2)")
	s.del(t, "public.categories", "id IN (10, 11, 20)")
	require.Equal(t, 7, s.apply(t, []string{"public.categories"}))
	require.Equal(t, snapshot.Result{Claimed: 7, Completed: 7}, e.batch(t, snapshot.Config{}))

	snaps := e.show(t, s.correlationID())
	d1 := decodeDoc(t, snaps[`{"id":1}`])
	cats := d1.Children["public.categories"]
	require.Equal(t, []string{`{"id":4}`, `{"id":2}`}, keys(t, cats), "children in deletion order")
	require.Empty(t, cats[0].Children)
	require.Equal(t, []string{`{"id":3}`}, keys(t, cats[1].Children["public.categories"]))
	require.Equal(t, 4, d1.Meta.EntityCount)

	d2 := decodeDoc(t, snaps[`{"id":2}`])
	require.Equal(t, []string{`{"id":3}`}, keys(t, d2.Children["public.categories"]))
	require.Equal(t, 2, d2.Meta.EntityCount)

	d10 := decodeDoc(t, snaps[`{"id":10}`])
	require.Equal(t, []string{`{"id":11}`}, keys(t, d10.Children["public.categories"]))
	require.Empty(t, d10.Children["public.categories"][0].Children, "the cycle back to 10 is not entered")
	require.Equal(t, 2, d10.Meta.EntityCount)
	d11 := decodeDoc(t, snaps[`{"id":11}`])
	require.Equal(t, []string{`{"id":10}`}, keys(t, d11.Children["public.categories"]))

	d20 := decodeDoc(t, snaps[`{"id":20}`])
	require.Empty(t, d20.Children, "a row is not its own child")
	require.Equal(t, 1, d20.Meta.EntityCount)
	require.Zero(t, d20.Meta.UnrelatedCount)
}

func TestChildDeletedLaterIsNotInEarlierSnapshot(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.seedOrder(t, 1, 2)

	// Line 2 (and its note) deleted alone: a transaction without a root.
	first := e.begin(t)
	first.del(t, "public.line_notes", "order_id = 1 AND line_no = 2")
	first.del(t, "public.lines", "order_id = 1 AND line_no = 2")
	require.Zero(t, first.apply(t, orderRoots), "no job for a transaction without a root row")

	second := e.begin(t)
	second.deleteOrder(t, 1)
	require.Equal(t, 1, second.apply(t, orderRoots))
	require.Equal(t, snapshot.Result{Claimed: 1, Completed: 1}, e.batch(t, snapshot.Config{}))

	require.Empty(t, e.show(t, first.correlationID()))
	d := decodeDoc(t, e.show(t, second.correlationID())[`{"id":1}`])
	require.Equal(t, []string{`{"line_no":1,"order_id":1}`}, keys(t, d.Children["public.lines"]))
	require.Equal(t, 1+1+2+1, d.Meta.EntityCount)
}

func TestCreateJobsIsIdempotentAndOnlyForRoots(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.seedOrder(t, 1, 2)
	s := e.begin(t)
	s.deleteOrder(t, 1)
	require.Equal(t, 1, s.apply(t, []string{"public.orders", "public.nothing_here"}))

	tx, err := e.pool.Begin(e.ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.Background()) }()
	n, err := snapshot.CreateJobs(e.ctx, tx, e.schema, &s.commit, orderRoots)
	require.NoError(t, err)
	require.Zero(t, n, "re-applying the commit creates nothing")
	n, err = snapshot.CreateJobs(e.ctx, tx, e.schema, &s.commit, nil)
	require.NoError(t, err)
	require.Zero(t, n)
	require.NoError(t, tx.Commit(e.ctx))

	var jobs int
	var table, status string
	var expected map[string]int
	require.NoError(t, e.pool.QueryRow(e.ctx, `SELECT count(*) OVER (), root_table, status, expected_tables
		FROM archive_v1.snapshots`).Scan(&jobs, &table, &status, &expected))
	require.Equal(t, 1, jobs)
	require.Equal(t, "public.orders", table)
	require.Equal(t, snapshot.StatusPending, status)
	require.Equal(t, map[string]int{"public.orders": 1, "public.lines": 2, "public.line_notes": 3, "public.shipments": 1}, expected)
}

// fakeClock is a settable clock for retry schedules.
type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *fakeClock) Now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.now }
func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

func TestShortGroupRetriesThenFailsAndReplayRebuilds(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.seedOrder(t, 1, 2)
	s := e.begin(t)
	s.deleteOrder(t, 1)
	var note *archived
	for _, a := range s.rows {
		if a.Table == "public.line_notes" && note == nil {
			note = a
		}
	}
	require.Equal(t, 1, s.apply(t, orderRoots, note), "one note quarantined: the group is short")

	clock := &fakeClock{now: time.Now()}
	cfg := snapshot.Config{MaxAttempts: 3, RetryDelay: time.Minute, MaxRetryDelay: time.Hour, Clock: clock.Now}
	cid := s.correlationID()

	require.Equal(t, snapshot.Result{Claimed: 1, Retried: 1}, e.batch(t, cfg))
	got := e.show(t, cid)[`{"id":1}`]
	require.Equal(t, snapshot.StatusPending, got.Status)
	require.Equal(t, 1, got.RetryCount)
	require.Contains(t, got.FailureReason, "public.line_notes has 2 of 3 rows")
	require.Nil(t, got.Payload, "no silently partial document")

	// Delays are 1m, then 2m, each within ±20% (jitter).
	require.Equal(t, snapshot.Result{}, e.batch(t, cfg), "not due before the retry delay")
	clock.Advance(75 * time.Second)
	require.Equal(t, snapshot.Result{Claimed: 1, Retried: 1}, e.batch(t, cfg))
	clock.Advance(75 * time.Second)
	require.Equal(t, snapshot.Result{}, e.batch(t, cfg), "the delay doubles")
	clock.Advance(75 * time.Second)
	require.Equal(t, snapshot.Result{Claimed: 1, Failed: 1}, e.batch(t, cfg))

	failed := e.show(t, cid)[`{"id":1}`]
	require.Equal(t, snapshot.StatusFailed, failed.Status)
	require.Equal(t, 3, failed.RetryCount)
	require.Equal(t, "incomplete transaction after 3 attempts: public.line_notes has 2 of 3 rows (missing events may be in quarantine)",
		failed.FailureReason)
	require.NotContains(t, failed.FailureReason, "note for", "no row values in the reason")
	clock.Advance(time.Hour)
	require.Equal(t, snapshot.Result{}, e.batch(t, cfg), "failed is parked")

	// The quarantined note is replayed: the job is rebuilt complete.
	require.Equal(t, 1, s.replay(t, note))
	reset := e.show(t, cid)[`{"id":1}`]
	require.Equal(t, snapshot.StatusPending, reset.Status)
	require.Zero(t, reset.RetryCount)
	require.Equal(t, snapshot.Result{Claimed: 1, Completed: 1}, e.batch(t, cfg))
	done := e.show(t, cid)[`{"id":1}`]
	require.NotEqual(t, failed.Fingerprint, done.Fingerprint)
	d := decodeDoc(t, done)
	require.Equal(t, 1+2+3+1, d.Meta.EntityCount)
	require.Equal(t, 0, done.RetryCount)
}

func TestInvalidateRebuildsCompleteSnapshotWithNewFingerprint(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.seedOrder(t, 1, 1)
	s := e.begin(t)
	s.deleteOrder(t, 1)
	var ship *archived
	for _, a := range s.rows {
		if a.Table == "public.shipments" {
			ship = a
		}
	}
	// A commit that did not count the shipment (its event arrives late).
	s.commit.Tables["public.shipments"] = 0
	require.Equal(t, 1, s.apply(t, orderRoots, ship))
	require.Equal(t, snapshot.Result{Claimed: 1, Completed: 1}, e.batch(t, snapshot.Config{}))
	before := e.show(t, s.correlationID())[`{"id":1}`]
	require.Empty(t, decodeDoc(t, before).Children["public.shipments"])

	require.Equal(t, 1, s.replay(t, ship))
	require.Equal(t, snapshot.StatusPending, e.show(t, s.correlationID())[`{"id":1}`].Status)
	require.Equal(t, snapshot.Result{Claimed: 1, Completed: 1}, e.batch(t, snapshot.Config{}))
	after := e.show(t, s.correlationID())[`{"id":1}`]
	require.NotEqual(t, before.Fingerprint, after.Fingerprint)
	d := decodeDoc(t, after)
	require.Equal(t, []string{`{"id":10}`}, keys(t, d.Children["public.shipments"]))
	require.JSONEq(t, string(ship.Row), string(d.Children["public.shipments"][0].Row))

	// Invalidating a transaction without jobs is a no-op.
	tx, err := e.pool.Begin(e.ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.Background()) }()
	n, err := snapshot.Invalidate(e.ctx, tx, e.schema, []string{"main:1:0/1"})
	require.NoError(t, err)
	require.Zero(t, n)
}

func TestEmptyGroupFailsAtOnce(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.seedOrder(t, 1, 1)
	s := e.begin(t)
	s.deleteOrder(t, 1)
	require.Equal(t, 1, s.apply(t, orderRoots))
	// The transaction's rows are gone before the batch (erased or expired).
	e.exec(t, `DELETE FROM archive_v1.rows WHERE correlation_id = $1`, s.correlationID())

	require.Equal(t, snapshot.Result{Claimed: 1, Failed: 1}, e.batch(t, snapshot.Config{MaxAttempts: 5}))
	got := e.show(t, s.correlationID())[`{"id":1}`]
	require.Equal(t, snapshot.StatusFailed, got.Status)
	require.Equal(t, 1, got.RetryCount)
	require.Contains(t, got.FailureReason, "no archive rows")
}

func TestConcurrentBatchesNeverAssembleAJobTwice(t *testing.T) {
	t.Parallel()
	e := setup(t)
	const txs, perTx = 20, 10
	for i := range txs * perTx {
		e.exec(t, `INSERT INTO orders (id, customer) VALUES ($1, 'c')`, i)
		e.exec(t, `INSERT INTO lines VALUES ($1, 1, 'x', 1, 1)`, i)
	}
	for i := range txs {
		s := e.begin(t)
		s.del(t, "public.lines", "order_id >= $1 AND order_id < $2", i*perTx, (i+1)*perTx)
		s.del(t, "public.orders", "id >= $1 AND id < $2", i*perTx, (i+1)*perTx)
		require.Equal(t, perTx, s.apply(t, orderRoots))
	}

	var (
		mu    sync.Mutex
		total snapshot.Result
		wg    sync.WaitGroup
	)
	for range 4 {
		wg.Go(func() {
			for {
				res, err := snapshot.RunBatch(e.ctx, e.pool, snapshot.Config{Schema: e.schema, BatchSize: 7})
				if err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				total.Claimed += res.Claimed
				total.Completed += res.Completed
				mu.Unlock()
				if res.Claimed == 0 {
					return
				}
			}
		})
	}
	wg.Wait()
	require.Equal(t, snapshot.Result{Claimed: txs * perTx, Completed: txs * perTx}, total)
	stats, err := snapshot.GetStats(e.ctx, e.pool, e.schema)
	require.NoError(t, err)
	require.Equal(t, snapshot.Stats{Complete: txs * perTx}, stats)
}

// An uncommitted Invalidate (a replayed row being applied) holds the job, so
// a concurrent batch cannot assemble it from a set that misses that row;
// once it commits, the batch builds from the full set.
func TestInvalidateInFlightHoldsTheJobFromBatches(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.seedOrder(t, 1, 1)
	s := e.begin(t)
	s.deleteOrder(t, 1)
	late := s.rows[0] // a note, quarantined at first
	s.commit.Tables["public.line_notes"]--
	require.Equal(t, 1, s.apply(t, orderRoots, late))

	tx, err := e.pool.Begin(e.ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.Background()) }()
	s.archive(t, tx, []*archived{late})
	n, err := snapshot.Invalidate(e.ctx, tx, e.schema, []string{s.correlationID()})
	require.NoError(t, err)
	require.Equal(t, 1, n, "a pending job is held too")

	require.Equal(t, snapshot.Result{}, e.batch(t, snapshot.Config{}), "the held job is skipped, not built without the new row")
	require.NoError(t, tx.Commit(e.ctx))
	require.Equal(t, snapshot.Result{Claimed: 1, Completed: 1}, e.batch(t, snapshot.Config{}))
	d := decodeDoc(t, e.show(t, s.correlationID())[`{"id":1}`])
	require.Len(t, d.Children["public.lines"][0].Children["public.line_notes"], 2)
}

func TestBatchTakesMoreJobsOfALoadedTransaction(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `INSERT INTO orders (id, customer) SELECT i, 'c' FROM generate_series(0, 149) i`)
	s := e.begin(t)
	s.del(t, "public.orders", "true")
	require.Equal(t, 150, s.apply(t, orderRoots))
	// Batch size 1: the first job, then the other due jobs of its
	// transaction up to 100 x the batch size.
	require.Equal(t, snapshot.Result{Claimed: 100, Completed: 100}, e.batch(t, snapshot.Config{BatchSize: 1}))
	require.Equal(t, snapshot.Result{Claimed: 50, Completed: 50}, e.batch(t, snapshot.Config{BatchSize: 1}))
	snaps := e.show(t, s.correlationID())
	require.Len(t, snaps, 150)
	for _, snap := range snaps {
		d := decodeDoc(t, snap)
		require.Equal(t, 1, d.Meta.EntityCount)
		require.Equal(t, 150, d.Meta.TransactionRows)
	}
}

// One batch claims jobs of many transactions and reads all their rows
// with one query: every transaction's documents hold its own rows only.
func TestBatchAssemblesManyTransactionsAtOnce(t *testing.T) {
	t.Parallel()
	e := setup(t)
	var txs []*sourceTx
	for i := 1; i <= 5; i++ {
		e.seedOrder(t, i, i)
		s := e.begin(t)
		s.deleteOrder(t, i)
		require.Equal(t, 1, s.apply(t, orderRoots))
		txs = append(txs, s)
	}
	require.Equal(t, snapshot.Result{Claimed: 5, Completed: 5}, e.batch(t, snapshot.Config{BatchSize: 5}))
	fps := map[string]bool{}
	for i, s := range txs {
		snaps := e.show(t, s.correlationID())
		require.Len(t, snaps, 1)
		snap := snaps[fmt.Sprintf(`{"id":%d}`, i+1)]
		d := decodeDoc(t, snap)
		require.Equal(t, s.correlationID(), d.Meta.CorrelationID)
		require.Len(t, d.Children["public.lines"], i+1)
		require.Equal(t, len(s.rows), d.Meta.TransactionRows)
		require.Equal(t, len(s.rows), d.Meta.EntityCount)
		fps[snap.Fingerprint] = true
	}
	require.Len(t, fps, 5, "a fingerprint per transaction")
}

func TestRootRowArrivingLateGetsItsJob(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.seedOrder(t, 1, 1)
	s := e.begin(t)
	s.deleteOrder(t, 1)
	root := s.rows[len(s.rows)-1]
	require.Equal(t, "public.orders", root.Table)
	require.Zero(t, s.apply(t, orderRoots, root), "the root's event is quarantined: no job yet")
	require.Equal(t, snapshot.Result{}, e.batch(t, snapshot.Config{}))

	require.Equal(t, 1, s.replay(t, root))
	require.Equal(t, snapshot.Result{Claimed: 1, Completed: 1}, e.batch(t, snapshot.Config{}))
	d := decodeDoc(t, e.show(t, s.correlationID())[`{"id":1}`])
	require.Equal(t, 1+1+2+1, d.Meta.EntityCount)
	require.Equal(t, 1, s.replay(t), "invalidating again resets the one job, creates none")
}

func TestShowThroughTheReaderView(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.seedOrder(t, 7, 1)
	s := e.begin(t)
	s.deleteOrder(t, 7)
	require.Equal(t, 1, s.apply(t, orderRoots))
	e.exec(t, `CREATE SCHEMA archive; CREATE VIEW archive.snapshots AS SELECT * FROM archive_v1.snapshots`)

	list, err := snapshot.Show(e.ctx, e.pool, "archive", s.correlationID())
	require.NoError(t, err)
	require.Len(t, list, 1)
	require.Equal(t, snapshot.StatusPending, list[0].Status)
	require.Nil(t, list[0].Payload)

	require.Equal(t, snapshot.Result{Claimed: 1, Completed: 1}, e.batch(t, snapshot.Config{}))
	list, err = snapshot.Show(e.ctx, e.pool, "archive", s.correlationID())
	require.NoError(t, err)
	require.Len(t, list, 1)
	require.Equal(t, "public.orders", list[0].RootTable)
	require.JSONEq(t, `{"id":7}`, string(list[0].RootKey))
	require.Equal(t, s.correlationID(), decodeDoc(t, list[0]).Meta.CorrelationID)

	none, err := snapshot.Show(e.ctx, e.pool, "archive", "main:1:0/0")
	require.NoError(t, err)
	require.Empty(t, none)
}
