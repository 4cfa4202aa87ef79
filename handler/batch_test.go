package handler

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
)

// A batch of results is written in one transaction, each row guarded by
// its own claim token: the delivery reclaimed in the meantime keeps the
// newer state, the others settle (and their rows' payloads are scrubbed).
func TestBatchSettleGuardsEachClaimToken(t *testing.T) {
	e := newTenv(t)
	reg := NewRegistry()
	e.goHandler(reg, func(context.Context, Delivery) error { return nil })
	e.enqueue(1, e.row(1), e.row(2), e.row(3))
	d := e.dispatcher(Config{Registry: reg})
	cs, err := d.claim(context.Background(), 3)
	require.NoError(t, err)
	require.Len(t, cs, 3)
	// Key 2's claim is reclaimed and claimed again under a new token.
	var stale *claimed
	for _, c := range cs {
		if string(c.d.Key) == `{"id": 2}` || string(c.d.Key) == `{"id":2}` {
			stale = c
		}
	}
	require.NotNil(t, stale)
	_, err = e.pool.Exec(context.Background(), `UPDATE epitaph.deliveries SET claim_token = gen_random_uuid(), attempt = 2
		WHERE id = $1`, stale.d.ID)
	require.NoError(t, err)
	batch := make([]result, 0, len(cs))
	for _, c := range cs {
		batch = append(batch, result{c: c, s: d.decide(context.Background(), c)})
	}
	d.settle(context.Background(), batch)
	ds := e.deliveries()
	require.Len(t, ds, 3)
	require.Equal(t, StateDone, ds[0].State)
	require.Nil(t, ds[0].Payload, "scrubbed with the batch")
	require.Equal(t, StateInFlight, ds[1].State, "the stale result did not settle the newer claim")
	require.Equal(t, 2, ds[1].Attempt)
	require.NotNil(t, ds[1].Payload)
	require.Equal(t, StateDone, ds[2].State)
	require.Nil(t, ds[2].Payload)
	require.Contains(t, e.logs.String(), "its claim was reclaimed")
}

// A batch whose recording fails leaves every one of its deliveries in
// flight with the attempt spent; they are reclaimed and done later.
func TestBatchSettleFailureLeavesTheBatchInFlight(t *testing.T) {
	e := newTenv(t)
	reg := NewRegistry()
	var calls atomic.Int32
	e.goHandler(reg, func(context.Context, Delivery) error { calls.Add(1); return nil },
		func(d *Def) { d.ClaimTimeout = time.Second })
	e.enqueue(1, e.row(1), e.row(2))
	d := e.dispatcher(Config{Registry: reg})
	var failed atomic.Bool
	d.beforeSettle = func(context.Context, string) error {
		if failed.CompareAndSwap(false, true) {
			return errors.New("target briefly down")
		}
		return nil
	}
	cs, err := d.claim(context.Background(), 2)
	require.NoError(t, err)
	require.Len(t, cs, 2)
	batch := make([]result, 0, len(cs))
	for _, c := range cs {
		batch = append(batch, result{c: c, s: d.decide(context.Background(), c)})
	}
	d.settle(context.Background(), batch)
	for _, r := range e.deliveries() {
		require.Equal(t, StateInFlight, r.State)
		require.Equal(t, 1, r.Attempt)
	}
	e.flush(d)
	for _, r := range e.deliveries() {
		require.Equal(t, StateDone, r.State)
		require.Equal(t, 2, r.Attempt, "the reclaim counted as an attempt")
	}
	require.EqualValues(t, 4, calls.Load())
}

// A delivery claimed ahead that waited for a worker too long (or was
// still queued at the soft stop) is handed back unstarted: pending, its
// attempt refunded, its outcome and backoff untouched.
func TestClaimedAheadHandedBackUnstarted(t *testing.T) {
	e := newTenv(t)
	reg := NewRegistry()
	var calls atomic.Int32
	e.goHandler(reg, func(context.Context, Delivery) error { calls.Add(1); return nil },
		func(d *Def) { d.ClaimTimeout = time.Second })
	e.enqueue(1, e.row(1))
	d := e.dispatcher(Config{Registry: reg})
	cs, err := d.claim(context.Background(), 1)
	require.NoError(t, err)
	require.Len(t, cs, 1)
	require.False(t, cs[0].waitedTooLong())
	eventually(t, cs[0].waitedTooLong, "a tenth of the claim passes")
	d.settle(context.Background(), []result{{c: cs[0], s: settlement{state: StatePending, handBack: true}}})
	ds := e.deliveries()
	require.Equal(t, StatePending, ds[0].State)
	require.Equal(t, 0, ds[0].Attempt, "no attempt spent")
	require.Equal(t, "", ds[0].Outcome)
	require.NotNil(t, ds[0].Payload)
	require.Zero(t, calls.Load())
	e.flush(d)
	ds = e.deliveries()
	require.Equal(t, StateDone, ds[0].State)
	require.Equal(t, 1, ds[0].Attempt)
}

// The service runs many deliveries through few webhook connections
// (keep-alive reuse), every one done exactly once.
func TestServiceWebhookReusesConnections(t *testing.T) {
	e := newTenv(t)
	var conns, hits atomic.Int32
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		w.WriteHeader(http.StatusOK)
	}))
	srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			conns.Add(1)
		}
	}
	srv.Start()
	defer srv.Close()
	e.addHandler(KindWebhook, srv.URL+"/hook", func(d *Def) { d.Revalidate = false })
	const n = 200
	rows := make([]Row, n)
	for i := range rows {
		rows[i] = e.row(i + 1)
	}
	e.enqueue(1, rows...)
	d := e.dispatcher(Config{Parallelism: 4})
	require.NoError(t, d.Start(context.Background()))
	eventually(t, func() bool {
		var done int
		require.NoError(t, e.pool.QueryRow(context.Background(),
			`SELECT count(*) FROM epitaph.deliveries WHERE state = 'done'`).Scan(&done))
		return done == n
	}, fmt.Sprintf("%d deliveries done", n))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, d.Stop(ctx))
	require.NoError(t, d.Wait())
	for _, r := range e.deliveries() {
		require.Equal(t, StateDone, r.State)
		require.Equal(t, 1, r.Attempt)
		require.Nil(t, r.Payload)
	}
	require.EqualValues(t, n, hits.Load(), "each delivery called once")
	// At most one extra dial per worker when a connection is being
	// returned while another request starts (the default transport, which
	// keeps 2 idle per host, dials dozens here).
	require.LessOrEqual(t, conns.Load(), int32(8), "connections are kept alive and reused")
}

// Two deliveries of one row that end in the same batch each see the other
// in flight when their row is written: neither can scrub itself there, and
// the batch's second statement scrubs both (every handler of the row is
// terminal). A row's delivery that ends while another of the row is still
// pending keeps its payload.
func TestBatchSettleScrubsARowWhoseDeliveriesEndTogether(t *testing.T) {
	e := newTenv(t)
	reg := NewRegistry()
	e.goHandler(reg, func(context.Context, Delivery) error { return nil })
	e.goHandler(reg, func(context.Context, Delivery) error { return nil }, func(d *Def) { d.Priority = 1 })
	e.enqueue(1, e.row(1), e.row(2))
	ctx := context.Background()
	// Both handlers of each row claimed at once (the claim would keep them
	// in priority order; the settle must not depend on it).
	rows, err := e.pool.Query(ctx, `UPDATE epitaph.deliveries SET state = 'in_flight', attempt = 1, claim_token = gen_random_uuid(),
		claim_expires_at = now() + interval '1 minute'
		RETURNING id::text, handler_id::text, source, commit_lsn::text, seq, key::text, claim_token::text`)
	require.NoError(t, err)
	d := e.dispatcher(Config{Registry: reg})
	var row1, row2 []result
	for rows.Next() {
		c := &claimed{}
		var key string
		require.NoError(t, rows.Scan(&c.d.ID, &c.d.HandlerID, &c.d.Source, &c.d.CommitLSN, &c.d.Seq, &key, &c.token))
		r := result{c: c, s: settlement{state: StateDone, outcome: OutcomeDone}}
		if key == `{"id": 1}` {
			row1 = append(row1, r)
		} else {
			row2 = append(row2, r)
		}
	}
	require.NoError(t, rows.Err())
	require.Len(t, row1, 2)
	require.Len(t, row2, 2)
	// Row 1: both in one batch. Row 2: one of them only; the other stays in
	// flight.
	d.settle(ctx, append(row1, row2[0]))
	ds := e.deliveries()
	require.Len(t, ds, 4)
	for _, x := range ds[:2] {
		require.Equal(t, StateDone, x.State)
		require.Nil(t, x.Payload, "row 1: scrubbed once both of its deliveries ended")
	}
	states := map[string]string{ds[2].State: "", ds[3].State: ""}
	require.Contains(t, states, StateDone)
	require.Contains(t, states, StateInFlight)
	require.NotNil(t, ds[2].Payload, "row 2: a delivery is still in flight")
	require.NotNil(t, ds[3].Payload, "row 2: a delivery is still in flight")
	// The last one of row 2 ends alone: both of row 2 are scrubbed.
	d.settle(ctx, row2[1:])
	ds = e.deliveries()
	for _, x := range ds {
		require.Equal(t, StateDone, x.State)
		require.Nil(t, x.Payload, "every delivery of every row is terminal")
	}
}

// Flush claims the next batch while the current one runs; when its context
// ends, a batch claimed ahead is handed back unstarted: nothing is left in
// flight and no attempt is spent on a delivery that never ran.
func TestFlushHandsBackTheBatchClaimedAhead(t *testing.T) {
	e := newTenv(t)
	reg := NewRegistry()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var calls atomic.Int32
	e.goHandler(reg, func(context.Context, Delivery) error {
		if calls.Add(1) == 1 {
			cancel() // the first attempt ends the flush
		}
		return nil
	})
	n := 2*claimAhead(1) + 10
	rows := make([]Row, 0, n)
	for i := range n {
		rows = append(rows, e.row(i))
	}
	e.enqueue(1, rows...)
	d := e.dispatcher(Config{Registry: reg, Parallelism: 1})
	_, err := d.Flush(ctx)
	require.ErrorIs(t, err, context.Canceled)
	var inFlight, spent, done int
	require.NoError(t, e.pool.QueryRow(context.Background(), `SELECT count(*) FILTER (WHERE state = 'in_flight'),
		count(*) FILTER (WHERE state = 'pending' AND attempt > 0), count(*) FILTER (WHERE state = 'done')
		FROM epitaph.deliveries`).Scan(&inFlight, &spent, &done))
	require.Zero(t, inFlight, "nothing left in flight")
	require.Zero(t, spent, "no attempt spent on a delivery that did not run")
	require.EqualValues(t, calls.Load(), done, "every delivery that ran is done")
	require.Less(t, done, n)
	// The rest runs on the next flush.
	e.flush(d)
	require.NoError(t, e.pool.QueryRow(context.Background(), `SELECT count(*) FILTER (WHERE state = 'done') FROM epitaph.deliveries`).Scan(&done))
	require.Equal(t, n, done)
}

// The payload backstop reads the whole table: it runs with the first
// maintenance and then at most hourly, and a due backstop is not lost to a
// maintenance that had no minute's work to do.
func TestBackstopRunsHourlyWithTheMinutesWork(t *testing.T) {
	e := newTenv(t)
	ctx := context.Background()
	e.addHandler(KindGo, "absent")
	e.enqueue(1, e.row(1))
	_, err := e.pool.Exec(ctx, `UPDATE epitaph.deliveries SET created_at = now() - interval '31 days'`)
	require.NoError(t, err)
	d := e.dispatcher(Config{})
	state := func() string {
		ds := e.deliveries()
		require.Len(t, ds, 1)
		return ds[0].State
	}
	set := func(scrub, backstop time.Time) {
		d.mu.Lock()
		d.lastScrub, d.lastBackstop = scrub, backstop
		d.mu.Unlock()
	}
	// Ran within the hour: not again, though the minute's work is due.
	set(time.Time{}, time.Now())
	require.NoError(t, d.maintain(ctx))
	require.Equal(t, StatePending, state())
	// Due, but the minute's work is not: it waits for it, and is not lost.
	set(time.Now(), time.Now().Add(-2*backstopEvery))
	require.NoError(t, d.maintain(ctx))
	require.Equal(t, StatePending, state())
	d.mu.Lock()
	d.lastScrub = time.Time{} // the minute's work due; the backstop as the last call left it
	d.mu.Unlock()
	require.NoError(t, d.maintain(ctx))
	require.Equal(t, StateDead, state(), "the backstop ran: queued work whose payload it scrubbed is dead")
}

// The claim loop keeps twice claimAhead ahead only while its batches are
// revalidated and the workers take that many in a quarter of a verdict's
// age: a verdict then waits at most that long for a worker.
func TestRoomDeepensOnlyForFastRevalidatedBatches(t *testing.T) {
	ahead := claimAhead(4)
	fast := float64(2*ahead) / (verdictMaxAge / 4).Seconds()
	require.Equal(t, ahead, roomFor(ahead, false, 10*fast), "plain batches: claimAhead")
	require.Equal(t, ahead, roomFor(ahead, true, fast*0.9), "slower workers: claimAhead")
	require.Equal(t, 2*ahead, roomFor(ahead, true, fast), "fast workers, revalidated batches: twice")
	require.Equal(t, ahead, roomFor(ahead, true, 0), "no rate yet: claimAhead")
}

// Archived wakes the claim loop too: a delivery the apply queued leaves
// at once rather than at the next poll.
func TestArchivedWakesTheClaimLoopBeforeThePoll(t *testing.T) {
	e := newTenv(t)
	var hits atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		w.WriteHeader(http.StatusOK)
	}))
	defer srv.Close()
	e.addHandler(KindWebhook, srv.URL+"/hook", func(d *Def) { d.Revalidate = false })
	const poll = 10 * time.Second
	d := e.dispatcher(Config{Poll: poll})
	startUntilCleanup(t, d)
	time.Sleep(300 * time.Millisecond) // the first claim finds nothing
	e.enqueue(1, e.row(1))
	start := time.Now()
	d.Archived()
	eventually(t, func() bool { return hits.Load() == 1 }, "the delivery sent")
	require.Less(t, time.Since(start), poll/2, "the delivery waited for the poll")
}

// A batch's settle that Postgres aborts in a deadlock with an erasure
// (which stopped the batch's third delivery, then waits for the first,
// which the settle holds) records the batch again: the second delivery
// is done once, the erased ones stay stopped, and nothing is left in
// flight to be sent again when its claim expires.
func TestBatchSettleOutlivesADeadlockWithAnErasure(t *testing.T) {
	e := newTenv(t)
	ctx := context.Background()
	reg := NewRegistry()
	e.goHandler(reg, func(context.Context, Delivery) error { return nil }, func(d *Def) { d.ClaimTimeout = time.Minute })
	e.enqueue(1, e.row(1), e.row(2), e.row(3))
	d := e.dispatcher(Config{Registry: reg})
	cs, err := d.claim(ctx, 3)
	require.NoError(t, err)
	require.Len(t, cs, 3)
	batch := make([]result, 0, len(cs))
	for _, c := range cs {
		batch = append(batch, result{c: c, s: d.decide(ctx, c)})
	}
	byKey := map[string]string{}
	for _, c := range cs {
		byKey[string(c.d.Key)] = c.d.ID
	}
	first, third := byKey[`{"id": 1}`], byKey[`{"id": 3}`]
	require.NotEmpty(t, first)
	require.NotEmpty(t, third)

	// The erasure's transaction (eraseDeliveries' statement, one row at a
	// time to fix the order).
	stop := func(tx pgx.Tx, id string) error {
		_, err := tx.Exec(ctx, `UPDATE epitaph.deliveries SET state = 'stopped', outcome = 'stop_revoked', settled_at = now(),
			claim_token = NULL, claim_expires_at = NULL, key = NULL, payload = NULL, payload_scrubbed_at = now(), updated_at = now()
			WHERE id = $1::uuid`, id)
		return err
	}
	etx, err := e.pool.Begin(ctx)
	require.NoError(t, err)
	defer etx.Rollback(ctx) //nolint:errcheck
	require.NoError(t, stop(etx, third))

	done := make(chan struct{})
	go func() { defer close(done); d.settle(context.Background(), batch) }()
	waitsForALock(t, e.pool, "epitaph.deliveries", "the settle waits for the erasure's third delivery")
	if err := stop(etx, first); err != nil {
		t.Skipf("the erasure was the deadlock's victim (erase retries it): this run does not test the settle: %v", err)
	}
	require.NoError(t, etx.Commit(ctx))
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("the settle did not end")
	}
	var states []string
	for _, r := range e.deliveries() {
		states = append(states, r.State+":"+r.Outcome)
	}
	// (The erased ones lost their keys: they sort last.)
	require.Equal(t, []string{"done:done", "stopped:stop_revoked", "stopped:stop_revoked"}, states)
	require.NotContains(t, e.logs.String(), "stays in flight")
}
