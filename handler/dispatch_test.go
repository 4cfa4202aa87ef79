package handler

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
)

// goHandler registers f under a fresh name and adds a go handler for it.
func (e *tenv) goHandler(reg *Registry, f Func, mod ...func(*Def)) Def {
	e.t.Helper()
	name := "h-" + newDiagID()
	require.NoError(e.t, reg.Register(name, f))
	return e.addHandler(KindGo, name, mod...)
}

func TestQueueLiveVersionOnlyAndOnce(t *testing.T) {
	e := newTenv(t)
	h := e.addHandler(KindGo, "x", func(d *Def) { d.Columns = []string{"blob"} })
	r := e.row(1)
	e.enqueue(2, r) // building version: nothing
	require.Empty(t, e.deliveries())
	e.enqueue(1, r)
	e.enqueue(1, r) // the same row again (a replay, or a second live apply around a promotion): once
	ds := e.deliveries()
	require.Len(t, ds, 1)
	require.Equal(t, h.ID, ds[0].Handler)
	require.Equal(t, StatePending, ds[0].State)
	require.JSONEq(t, `{"key":{"id":1},"columns":{"blob":"b-1"}}`, *ds[0].Payload, "key and the handler's columns only")
	var id string
	require.NoError(t, e.pool.QueryRow(context.Background(), `SELECT id::text FROM archive.deliveries`).Scan(&id))
	require.Equal(t, DeliveryID(h.ID, "main", r.CommitLSN, 1, 0), id)
}

// A page that repeats deliveries already queued (a replay) goes in with
// its new ones, in a transaction that stays usable; a delivery stopped as
// unverified is queued again, any other repeat left as it was.
func TestQueueRepeatedPageKeepsNewRowsAndTheTransaction(t *testing.T) {
	e := newTenv(t)
	ctx := context.Background()
	h := e.addHandler(KindGo, "x")
	r1, r2, r3 := e.row(1), e.row(2), e.row(3)
	e.enqueue(1, r1, r2)
	_, err := e.pool.Exec(ctx, `UPDATE epitaph.deliveries SET state = 'stopped', outcome = 'unverified', settled_at = now()
		WHERE id = $1`, DeliveryID(h.ID, "main", r1.CommitLSN, 1, 0))
	require.NoError(t, err)
	_, err = e.pool.Exec(ctx, `UPDATE epitaph.deliveries SET state = 'dead', outcome = 'gave_up', settled_at = now()
		WHERE id = $1`, DeliveryID(h.ID, "main", r2.CommitLSN, 1, 0))
	require.NoError(t, err)

	c := NewCache(e.pool, time.Millisecond)
	require.NoError(t, c.Refresh(ctx))
	tx, err := e.pool.Begin(ctx)
	require.NoError(t, err)
	n, err := Enqueue(ctx, tx, c, "archive", 1, []Row{r1, r2, r3})
	require.NoError(t, err)
	require.Equal(t, 3, n)
	var one int
	require.NoError(t, tx.QueryRow(ctx, `SELECT 1`).Scan(&one), "the transaction is still usable")
	require.NoError(t, tx.Commit(ctx))

	var states []string
	for _, d := range e.deliveries() { // in key order: rows 1, 2, 3
		states = append(states, string(d.State)+"/"+d.Outcome)
	}
	require.Equal(t, []string{string(StatePending) + "/", string(StateDead) + "/gave_up", string(StatePending) + "/"}, states)
}

func TestPriorityOrderWithinARow(t *testing.T) {
	e := newTenv(t)
	reg := NewRegistry()
	var mu sync.Mutex
	var order []string
	rec := func(name string) Func {
		return func(_ context.Context, d Delivery) error {
			mu.Lock()
			order = append(order, fmt.Sprintf("%s:%s", d.Key, name))
			mu.Unlock()
			return nil
		}
	}
	e.goHandler(reg, rec("c"), func(d *Def) { d.Priority = 5 })
	e.goHandler(reg, rec("a"), func(d *Def) { d.Priority = -1 })
	e.goHandler(reg, rec("b"), func(d *Def) { d.Priority = 2 })
	e.enqueue(1, e.row(1), e.row(2))
	e.flush(e.dispatcher(Config{Registry: reg, Parallelism: 8}))
	mu.Lock()
	defer mu.Unlock()
	var r1, r2 []string
	for _, o := range order {
		if strings.HasPrefix(o, `{"id": 1}`) {
			r1 = append(r1, o)
		} else {
			r2 = append(r2, o)
		}
	}
	require.Equal(t, []string{`{"id": 1}:a`, `{"id": 1}:b`, `{"id": 1}:c`}, r1)
	require.Equal(t, []string{`{"id": 2}:a`, `{"id": 2}:b`, `{"id": 2}:c`}, r2)
	for _, d := range e.deliveries() {
		require.Equal(t, StateDone, d.State)
		require.Nil(t, d.Payload, "scrubbed once every handler of the row is terminal")
	}
}

// Each attempt's delay is its doubling from base with at most ±25% jitter
// (cenkalti/backoff's randomization factor), so consecutive attempts'
// ranges never overlap (0.75·2 > 1.25): every delay of an attempt exceeds
// every delay of the one before, and their mean is the doubling. (The test
// asked a single draw to grow by a quarter over the previous draw, which
// ±25% jitter breaks now and then: 2·0.75/1.25 = 1.2.)
func TestBackoffGrows(t *testing.T) {
	base := 100 * time.Millisecond
	prevMax := time.Duration(0)
	for a := 1; a <= 6; a++ {
		want := base << (a - 1)
		lo, hi := want*3/4, want*5/4
		var sum, least, most time.Duration
		const n = 400
		for i := 0; i < n; i++ {
			b := Backoff(base, a)
			require.GreaterOrEqual(t, b, lo-time.Microsecond, "attempt %d: at most 25%% below the doubling", a)
			require.LessOrEqual(t, b, hi+time.Microsecond, "attempt %d: at most 25%% above the doubling", a)
			if i == 0 || b < least {
				least = b
			}
			most = max(most, b)
			sum += b
		}
		require.Greater(t, least, prevMax, "attempt %d: every delay exceeds every delay of attempt %d", a, a-1)
		require.InDelta(t, float64(want), float64(sum/n), float64(want)*0.05, "attempt %d: the mean is the doubling", a)
		prevMax = most
	}
	require.LessOrEqual(t, Backoff(time.Minute, 40), time.Hour+15*time.Minute)
}

func TestMaxAttemptsDeadSanitized(t *testing.T) {
	e := newTenv(t)
	reg := NewRegistry()
	const planted = "PLANTED-secret-text-7f3a"
	var calls atomic.Int32
	var attempts []int
	var mu sync.Mutex
	h := e.goHandler(reg, func(_ context.Context, d Delivery) error {
		calls.Add(1)
		mu.Lock()
		attempts = append(attempts, d.Attempt)
		mu.Unlock()
		return Retryable("blob_store_down", errors.New(planted))
	}, func(d *Def) { d.MaxAttempts = 3 })
	e.enqueue(1, e.row(1))
	e.flush(e.dispatcher(Config{Registry: reg}))
	require.EqualValues(t, 3, calls.Load())
	require.Equal(t, []int{1, 2, 3}, attempts)
	ds := e.deliveries()
	require.Len(t, ds, 1)
	require.Equal(t, StateDead, ds[0].State)
	require.Equal(t, 3, ds[0].Attempt)
	require.NotNil(t, ds[0].LastError)
	require.Regexp(t, `^type=\*errors\.errorString code=blob_store_down diag=[0-9a-f]{12}$`, *ds[0].LastError)
	diag := strings.TrimPrefix((*ds[0].LastError)[strings.Index(*ds[0].LastError, "diag="):], "diag=")
	require.Contains(t, e.logs.String(), "diag="+diag, "the diagnostic id is in the log line")
	// The planted text is nowhere: not in any column of the database, not in the logs.
	var found int
	require.NoError(t, e.pool.QueryRow(context.Background(), `SELECT count(*) FROM epitaph.deliveries d WHERE d::text LIKE '%'||$1||'%'`, planted).Scan(&found))
	require.Zero(t, found)
	require.NoError(t, e.pool.QueryRow(context.Background(), `SELECT count(*) FROM epitaph.handlers d WHERE d::text LIKE '%'||$1||'%'`, planted).Scan(&found))
	require.Zero(t, found)
	require.NotContains(t, e.logs.String(), planted)
	_ = h
}

func TestPermanentFailureDeadAtOnce(t *testing.T) {
	e := newTenv(t)
	reg := NewRegistry()
	var calls atomic.Int32
	e.goHandler(reg, func(context.Context, Delivery) error {
		calls.Add(1)
		return Permanent("gone", errors.New("nope"))
	})
	e.enqueue(1, e.row(1))
	e.flush(e.dispatcher(Config{Registry: reg}))
	require.EqualValues(t, 1, calls.Load())
	ds := e.deliveries()
	require.Equal(t, StateDead, ds[0].State)
	require.Equal(t, 1, ds[0].Attempt)
	require.Contains(t, *ds[0].LastError, "code=gone")
}

func TestDeadlineIsNineTenthsOfClaim(t *testing.T) {
	e := newTenv(t)
	reg := NewRegistry()
	got := make(chan time.Duration, 4)
	e.goHandler(reg, func(ctx context.Context, _ Delivery) error {
		dl, ok := ctx.Deadline()
		if !ok {
			got <- -1
			return nil
		}
		got <- time.Until(dl)
		<-ctx.Done() // ignores nothing: waits for its cancellation
		return ctx.Err()
	}, func(d *Def) { d.ClaimTimeout = 2 * time.Second; d.MaxAttempts = 1 })
	e.enqueue(1, e.row(1))
	start := time.Now()
	e.flush(e.dispatcher(Config{Registry: reg}))
	left := <-got
	require.InDelta(t, float64(1800*time.Millisecond), float64(left), float64(300*time.Millisecond))
	require.GreaterOrEqual(t, time.Since(start), 1700*time.Millisecond)
	ds := e.deliveries()
	require.Equal(t, StateDead, ds[0].State, "a cancelled attempt counts as failed")
	require.Contains(t, *ds[0].LastError, "code=deadline_exceeded")
}

func TestReclaimCountsAnAttemptAndStaleRunCannotSettle(t *testing.T) {
	e := newTenv(t)
	reg := NewRegistry()
	release := make(chan struct{})
	var calls atomic.Int32
	e.goHandler(reg, func(ctx context.Context, d Delivery) error {
		if calls.Add(1) == 1 {
			<-release // the first run hangs past its claim, ignoring ctx
			return nil
		}
		return errors.New("second attempt fails")
	}, func(d *Def) { d.ClaimTimeout = time.Second; d.MaxAttempts = 5; d.Backoff = time.Hour })
	e.enqueue(1, e.row(1))
	d1 := e.dispatcher(Config{Registry: reg})
	c1, err := d1.claim(context.Background(), 1)
	require.NoError(t, err)
	require.Len(t, c1, 1)
	done := make(chan struct{})
	go func() { defer close(done); d1.attempt(context.Background(), c1[0]) }()
	// The claim expires; maintenance reclaims it (attempt 1 stays spent).
	eventually(t, func() bool {
		require.NoError(t, d1.maintain(context.Background()))
		ds := e.deliveries()
		return ds[0].State == StatePending && ds[0].Outcome == OutcomeClaimExpired
	}, "reclaim")
	require.Equal(t, 1, e.deliveries()[0].Attempt)
	// A second dispatcher runs attempt 2 (fails, backs off an hour).
	d2 := e.dispatcher(Config{Registry: reg})
	c2, err := d2.claim(context.Background(), 1)
	require.NoError(t, err)
	require.Len(t, c2, 1)
	require.Equal(t, 2, c2[0].d.Attempt, "the reclaim counted as an attempt")
	d2.attempt(context.Background(), c2[0])
	// The stale first run returns "done": it must not settle.
	close(release)
	<-done
	ds := e.deliveries()
	require.Equal(t, StatePending, ds[0].State)
	require.Equal(t, OutcomeFailed, ds[0].Outcome)
	require.Equal(t, 2, ds[0].Attempt)
	require.Contains(t, e.logs.String(), "its claim was reclaimed")
}

func TestReclaimOfLastAttemptIsDead(t *testing.T) {
	e := newTenv(t)
	reg := NewRegistry()
	e.goHandler(reg, func(context.Context, Delivery) error { return nil }, func(d *Def) { d.ClaimTimeout = 200 * time.Millisecond; d.MaxAttempts = 1 })
	e.enqueue(1, e.row(1))
	d := e.dispatcher(Config{Registry: reg})
	cs, err := d.claim(context.Background(), 1)
	require.NoError(t, err)
	require.Len(t, cs, 1) // a crash: never run, never settled
	eventually(t, func() bool {
		require.NoError(t, d.maintain(context.Background()))
		return e.deliveries()[0].State == StateDead
	}, "dead after the reclaim of its last attempt")
	require.Equal(t, OutcomeClaimExpired, e.deliveries()[0].Outcome)
	require.Nil(t, e.deliveries()[0].Payload, "scrubbed: the row's only handler is terminal")
}

func TestOutcomeRecordingFailureStaysInFlight(t *testing.T) {
	e := newTenv(t)
	reg := NewRegistry()
	var calls atomic.Int32
	e.goHandler(reg, func(context.Context, Delivery) error { calls.Add(1); return nil },
		func(d *Def) { d.ClaimTimeout = time.Second })
	e.enqueue(1, e.row(1), e.row(2))
	d := e.dispatcher(Config{Registry: reg})
	var failed atomic.Bool
	d.beforeSettle = func(_ context.Context, id string) error {
		if failed.CompareAndSwap(false, true) {
			return errors.New("target briefly down")
		}
		return nil
	}
	cs, err := d.claim(context.Background(), 2)
	require.NoError(t, err)
	require.Len(t, cs, 2)
	for _, c := range cs {
		d.attempt(context.Background(), c)
	}
	var inFlight, doneN int
	for _, r := range e.deliveries() {
		switch r.State {
		case StateInFlight:
			inFlight++
			require.Equal(t, 1, r.Attempt)
		case StateDone:
			doneN++
		}
	}
	require.Equal(t, 1, inFlight, "the one whose outcome could not be recorded stays in flight")
	require.Equal(t, 1, doneN, "the rest of the batch carries on")
	require.Contains(t, e.logs.String(), "stays in flight until its claim expires")
	// Once the claim expires it is reclaimed and done on its second attempt.
	e.flush(d)
	for _, r := range e.deliveries() {
		require.Equal(t, StateDone, r.State)
	}
	require.EqualValues(t, 3, calls.Load())
}

func TestBackstopScrubDeadLettersAtOnce(t *testing.T) {
	e := newTenv(t)
	reg := NewRegistry()
	var calls atomic.Int32
	e.goHandler(reg, func(context.Context, Delivery) error { calls.Add(1); return nil })
	e.enqueue(1, e.row(1))
	_, err := e.pool.Exec(context.Background(), `UPDATE epitaph.deliveries SET created_at = now() - interval '31 days'`)
	require.NoError(t, err)
	e.enqueue(1, e.row(2)) // recent: kept and run
	d := e.dispatcher(Config{Registry: reg})
	require.NoError(t, d.Backstop(context.Background()))
	e.flush(d)
	ds := e.deliveries()
	require.Equal(t, StateDead, ds[0].State)
	require.Equal(t, OutcomePayloadGone, ds[0].Outcome)
	require.Zero(t, ds[0].Attempt, "no attempt burnt")
	require.Nil(t, ds[0].Payload)
	require.Equal(t, StateDone, ds[1].State)
	require.EqualValues(t, 1, calls.Load())
}

func TestUnknownHandlerDisabledRemovedRevoked(t *testing.T) {
	e := newTenv(t)
	reg := NewRegistry()
	var calls atomic.Int32
	f := func(context.Context, Delivery) error { calls.Add(1); return nil }
	gone := e.goHandler(reg, f)
	disabled := e.goHandler(reg, f, func(d *Def) { d.Table = "lines" })
	removed := e.goHandler(reg, f, func(d *Def) { d.Table = "items" })
	revoked := e.goHandler(reg, f, func(d *Def) { d.Table = "notes" })
	r := e.row(1)
	e.enqueue(1, r)
	for i, tbl := range []string{"lines", "items", "notes"} {
		x := e.row(10 + i)
		x.Table = tbl
		e.enqueue(1, x)
	}
	ctx := context.Background()
	// A handler id nothing knows (deleted behind the CLI's back).
	_, err := e.pool.Exec(ctx, `DELETE FROM epitaph.handlers WHERE id = $1`, gone.ID)
	require.NoError(t, err)
	require.NoError(t, SetEnabled(ctx, e.pool, disabled.ID, false))
	n, err := Remove(ctx, e.pool, removed.ID)
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	n, err = Revoke(ctx, e.pool, revoked.ID)
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	d := e.dispatcher(Config{Registry: reg})
	e.flush(d) // the disabled handler's delivery is not waited for
	byTable := map[string]drow{}
	rows, err := e.pool.Query(ctx, `SELECT table_name, state, COALESCE(outcome, ''), last_error FROM epitaph.deliveries`)
	require.NoError(t, err)
	for rows.Next() {
		var tbl string
		var r drow
		require.NoError(t, rows.Scan(&tbl, &r.State, &r.Outcome, &r.LastError))
		byTable[tbl] = r
	}
	require.NoError(t, rows.Err())
	require.Equal(t, StateDead, byTable["orders"].State)
	require.Equal(t, OutcomeUnknownHandler, byTable["orders"].Outcome)
	require.Contains(t, *byTable["orders"].LastError, "unknown_handler")
	require.Equal(t, StatePending, byTable["lines"].State, "a disabled handler's work waits")
	require.Equal(t, StateStopped, byTable["items"].State)
	require.Equal(t, string(StopCompleted), byTable["items"].Outcome)
	require.Equal(t, StateStopped, byTable["notes"].State)
	require.Equal(t, string(StopRevoked), byTable["notes"].Outcome)
	require.Zero(t, calls.Load())
	// Enabled again, it runs.
	require.NoError(t, SetEnabled(ctx, e.pool, disabled.ID, true))
	e.flush(d)
	require.EqualValues(t, 1, calls.Load())
}

func TestRevalidationSeam(t *testing.T) {
	e := newTenv(t)
	reg := NewRegistry()
	var calls atomic.Int32
	e.goHandler(reg, func(context.Context, Delivery) error { calls.Add(1); return nil })
	e.enqueue(1, e.row(1), e.row(2), e.row(3))
	var seen sync.Map
	reval := func(_ context.Context, d Delivery) (Decision, error) {
		switch string(d.Key) {
		case `{"id": 1}`:
			return Decision{Outcome: StopChanged, Fingerprint: "fp1"}, nil
		case `{"id": 2}`:
			if _, again := seen.LoadOrStore(d.ID, true); !again {
				return Decision{Outcome: Defer}, nil
			}
		}
		return Decision{Outcome: Send}, nil
	}
	e.flush(e.dispatcher(Config{Registry: reg, Revalidate: reval}))
	ds := e.deliveries()
	require.Equal(t, StateStopped, ds[0].State)
	require.Equal(t, string(StopChanged), ds[0].Outcome)
	require.Equal(t, StateDone, ds[1].State)
	require.Equal(t, 1, ds[1].Attempt, "a defer spends no attempt")
	require.Equal(t, StateDone, ds[2].State)
	var defers int
	var fp string
	require.NoError(t, e.pool.QueryRow(context.Background(), `SELECT defers FROM epitaph.deliveries WHERE key = '{"id":2}'`).Scan(&defers))
	require.Equal(t, 1, defers)
	require.NoError(t, e.pool.QueryRow(context.Background(), `SELECT observed_fingerprint FROM epitaph.deliveries WHERE key = '{"id":1}'`).Scan(&fp))
	require.Equal(t, "fp1", fp)
	require.EqualValues(t, 2, calls.Load())
}

func TestDispatcherServiceRunsAndStops(t *testing.T) {
	e := newTenv(t)
	reg := NewRegistry()
	var calls atomic.Int32
	e.goHandler(reg, func(context.Context, Delivery) error { calls.Add(1); return nil })
	d := e.dispatcher(Config{Registry: reg})
	require.NoError(t, d.Start(context.Background()))
	e.enqueue(1, e.row(1), e.row(2), e.row(3))
	eventually(t, func() bool { return calls.Load() == 3 }, "three deliveries run by the service")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, d.Stop(ctx))
	require.NoError(t, d.Wait())
	for _, r := range e.deliveries() {
		require.Equal(t, StateDone, r.State)
	}
}

func TestGroupSettleTimeoutReleasesUnsignedRowsOnly(t *testing.T) {
	e := newTenv(t)
	reg := NewRegistry()
	var calls atomic.Int32
	e.goHandler(reg, func(context.Context, Delivery) error { calls.Add(1); return nil }, func(d *Def) { d.Phase = PhaseAfterGroup })
	legacy := e.row(1)
	legacy.Committed = false // an unsigned stream's row whose commit never came
	forged := e.row(2)
	forged.Committed, forged.Verified = false, false // a signed stream's row, not verified
	e.enqueue(1, legacy, forged)
	d := e.dispatcher(Config{Registry: reg, GroupSettleTimeout: time.Hour})
	e.flush(d)
	require.Zero(t, calls.Load(), "nothing released yet")
	_, err := e.pool.Exec(context.Background(), `UPDATE epitaph.deliveries SET created_at = now() - interval '2 hours'`)
	require.NoError(t, err)
	e.flush(d)
	require.EqualValues(t, 1, calls.Load())
	var unsettled bool
	require.NoError(t, e.pool.QueryRow(context.Background(), `SELECT released_unsettled FROM epitaph.deliveries WHERE key = '{"id":1}' AND state = 'done'`).Scan(&unsettled))
	require.True(t, unsettled)
	ds := e.deliveries()
	require.Equal(t, StatePending, ds[1].State, "an unverified row's delivery is never released by the timeout")
	var released bool
	require.NoError(t, e.pool.QueryRow(context.Background(), `SELECT released_at IS NOT NULL FROM epitaph.deliveries WHERE key = '{"id":2}'`).Scan(&released))
	require.False(t, released)
}

func TestNATSDeliveriesWaitWithoutJetStream(t *testing.T) {
	e := newTenv(t)
	e.addHandler(KindNATS, "purges.orders")
	e.enqueue(1, e.row(1))
	e.flush(e.dispatcher(Config{})) // no JetStream: not claimed, not waited for
	ds := e.deliveries()
	require.Equal(t, StatePending, ds[0].State)
	require.Zero(t, ds[0].Attempt)
}

func TestMetrics(t *testing.T) {
	e := newTenv(t)
	reg := NewRegistry()
	h := e.goHandler(reg, func(_ context.Context, d Delivery) error {
		if string(d.Key) == `{"id": 2}` {
			return Permanent("nope", errors.New("x"))
		}
		return nil
	})
	e.enqueue(1, e.row(1), e.row(2), e.row(3))
	preg := prometheus.NewRegistry()
	d := e.dispatcher(Config{Registry: reg, Registerer: preg})
	e.flush(d)
	e.enqueue(1, e.row(4)) // pending
	got := metricValues(t, preg)
	require.Equal(t, 2.0, got["epitaph_projector_deliveries,handler="+h.ID+",state=done"])
	require.Equal(t, 1.0, got["epitaph_projector_deliveries,handler="+h.ID+",state=dead"])
	require.Equal(t, 1.0, got["epitaph_projector_deliveries,handler="+h.ID+",state=pending"])
	require.GreaterOrEqual(t, got["epitaph_projector_delivery_oldest_pending_age_seconds,handler="+h.ID], 0.0)
	require.Contains(t, got, "epitaph_projector_delivery_oldest_pending_age_seconds,handler="+h.ID)
	require.Equal(t, 2.0, got["epitaph_projector_delivery_attempts_total,handler="+h.ID+",result=done"])
	require.Equal(t, 1.0, got["epitaph_projector_delivery_attempts_total,handler="+h.ID+",result=failed"])
	require.Equal(t, 1.0, got["epitaph_projector_delivery_dead_letters_total,handler="+h.ID])
}

// The batch seam: one call decides the claimed batch, each verdict taken
// per delivery; an attempt that starts more than verdictMaxAge after its
// batch was read asks Revalidate afresh.
func TestBatchRevalidationSeam(t *testing.T) {
	e := newTenv(t)
	reg := NewRegistry()
	var calls atomic.Int32
	var slow atomic.Bool
	e.goHandler(reg, func(context.Context, Delivery) error {
		if calls.Add(1) > 0 && slow.CompareAndSwap(true, false) {
			time.Sleep(verdictMaxAge + 200*time.Millisecond) // a slow handler: the next verdict goes stale
		}
		return nil
	})
	e.enqueue(1, e.row(1), e.row(2), e.row(3))
	var batches, batched, alone atomic.Int32
	batch := func(_ context.Context, ds []Delivery) []Verdict {
		batches.Add(1)
		batched.Add(int32(len(ds)))
		vs := make([]Verdict, len(ds))
		for i, d := range ds {
			vs[i].Decision.Outcome = Send
			if string(d.Key) == `{"id": 3}` {
				vs[i].Decision = Decision{Outcome: StopSuperseded, Fingerprint: "fp3"}
			}
		}
		return vs
	}
	reval := func(context.Context, Delivery) (Decision, error) {
		alone.Add(1)
		return Decision{Outcome: Send}, nil
	}
	preg := prometheus.NewRegistry()
	d := e.dispatcher(Config{Registry: reg, Parallelism: 1, Revalidate: reval, RevalidateBatch: batch, Registerer: preg})
	e.flush(d)
	require.EqualValues(t, 1, batches.Load(), "one call for the claimed batch")
	require.Zero(t, aloneMetric(t, preg), "no attempt revalidated alone")
	require.EqualValues(t, 3, batched.Load())
	require.Zero(t, alone.Load(), "fresh verdicts are not read again")
	ds := e.deliveries()
	require.Equal(t, StateDone, ds[0].State)
	require.Equal(t, StateDone, ds[1].State)
	require.Equal(t, StateStopped, ds[2].State)
	require.Equal(t, string(StopSuperseded), ds[2].Outcome)
	var fp string
	require.NoError(t, e.pool.QueryRow(context.Background(), `SELECT observed_fingerprint FROM epitaph.deliveries WHERE key = '{"id":3}'`).Scan(&fp))
	require.Equal(t, "fp3", fp)
	require.EqualValues(t, 2, calls.Load())

	// The first of two waits longer than a verdict stands: the second is
	// revalidated alone when it starts, then sent.
	slow.Store(true)
	e.enqueue(1, e.row(4), e.row(5))
	e.flush(d)
	require.EqualValues(t, 2, batches.Load())
	require.EqualValues(t, 1, alone.Load(), "the stale verdict was read again, alone")
	require.EqualValues(t, 1, aloneMetric(t, preg), "counted as revalidated alone")
	require.EqualValues(t, 4, calls.Load())
	for _, r := range e.deliveries()[3:] {
		require.Equal(t, StateDone, r.State)
	}
}

// aloneMetric is epitaph_projector_delivery_revalidations_alone_total,
// summed over handlers.
func aloneMetric(t *testing.T, reg *prometheus.Registry) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	var n float64
	for _, mf := range mfs {
		if mf.GetName() == "epitaph_projector_delivery_revalidations_alone_total" {
			for _, m := range mf.GetMetric() {
				n += m.GetCounter().GetValue()
			}
		}
	}
	return n
}

// The claim loop of the service evaluates each revalidated batch beside
// it: more deliveries than the queue holds (twice over) each go through
// one batch evaluation, run once, and the stops the verdicts say are
// recorded.
func TestServiceRevalidatesBatchesBesideTheClaimLoop(t *testing.T) {
	e := newTenv(t)
	reg := NewRegistry()
	var mu sync.Mutex
	sent := map[string]int{}
	e.goHandler(reg, func(_ context.Context, d Delivery) error {
		mu.Lock()
		sent[string(d.Key)]++
		mu.Unlock()
		return nil
	})
	const n = 300
	rows := make([]Row, n)
	for i := range rows {
		rows[i] = e.row(i + 1)
	}
	e.enqueue(1, rows...)
	var batched, alone atomic.Int32
	stop := func(d Delivery) bool { return strings.HasSuffix(string(d.Key), "7}") }
	batch := func(_ context.Context, ds []Delivery) []Verdict {
		batched.Add(int32(len(ds)))
		vs := make([]Verdict, len(ds))
		for i, d := range ds {
			vs[i].Decision.Outcome = Send
			if stop(d) {
				vs[i].Decision.Outcome = StopSuperseded
			}
		}
		return vs
	}
	// Read again alone only if a verdict aged a second before its worker
	// took it (a stalled machine): the same decision, counted.
	reval := func(_ context.Context, d Delivery) (Decision, error) {
		alone.Add(1)
		if stop(d) {
			return Decision{Outcome: StopSuperseded}, nil
		}
		return Decision{Outcome: Send}, nil
	}
	preg := prometheus.NewRegistry()
	d := e.dispatcher(Config{Registry: reg, Parallelism: 1, Revalidate: reval, RevalidateBatch: batch, Registerer: preg})
	require.NoError(t, d.Start(context.Background()))
	eventually(t, func() bool {
		var open int
		require.NoError(t, e.pool.QueryRow(context.Background(),
			`SELECT count(*) FROM epitaph.deliveries WHERE state IN ('pending', 'in_flight')`).Scan(&open))
		return open == 0
	}, "every delivery settled by the service")
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	require.NoError(t, d.Stop(ctx))
	require.NoError(t, d.Wait())
	require.EqualValues(t, n, batched.Load(), "each delivery in one batch")
	require.EqualValues(t, alone.Load(), aloneMetric(t, preg), "every lone evaluation counted")
	t.Logf("%d of %d read again alone", alone.Load(), n)
	ds := e.deliveries() // by key id: ds[i] is id i+1
	require.Len(t, ds, n)
	stopped := 0
	for i, r := range ds {
		key := fmt.Sprintf(`{"id": %d}`, i+1)
		if (i+1)%10 == 7 {
			stopped++
			require.Equal(t, StateStopped, r.State, "delivery %s", key)
			require.Equal(t, string(StopSuperseded), r.Outcome)
			require.Zero(t, sent[key], "a stopped delivery was not sent")
			continue
		}
		require.Equal(t, StateDone, r.State, "delivery %s", key)
		require.Equal(t, 1, sent[key], "delivery %s sent once", key)
	}
	require.Equal(t, 30, stopped)
	mu.Lock()
	require.Len(t, sent, n-30, "nothing else was sent")
	mu.Unlock()
}
