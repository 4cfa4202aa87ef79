package handler

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// cursorEnv is a migrated target with a real live archive (version 1, two
// partitions) whose rows are written directly.
type cursorEnv struct {
	t    *testing.T
	dsn  string
	pool *pgxpool.Pool
	lsn  int
}

func newCursorEnv(t *testing.T) *cursorEnv {
	t.Helper()
	ctx := context.Background()
	dsn := testenv.NewDatabase(t)
	pool, err := pgxpool.New(ctx, dsn)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	require.NoError(t, migrations.Apply(ctx, pool))
	require.NoError(t, version.EnsureArchive(ctx, pool, 2, nil))
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := archive.EnsurePartitions(ctx, tx, archive.Schema(1), archive.DefaultPeriod, time.Now())
		return err
	}))
	return &cursorEnv{t: t, dsn: dsn, pool: pool, lsn: 0x1000}
}

// archive writes rows of table (keys) in one transaction each, verified
// unless told, and returns their commit LSNs.
func (e *cursorEnv) archive(table string, verified bool, keys ...int) []string {
	e.t.Helper()
	var lsns []string
	for _, k := range keys {
		e.lsn += 0x100
		lsn := fmt.Sprintf("0/%X", e.lsn)
		_, err := e.pool.Exec(context.Background(), `INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row,
			correlation_id, commit_lsn, commit_time, seq, verified)
			VALUES ('main', 'public', $1, $2::jsonb, $3::jsonb, $4, $5::pg_lsn, now(), 0, $6)`,
			table, fmt.Sprintf(`{"id": %d}`, k), fmt.Sprintf(`{"id": %d, "note": "n-%d"}`, k, k), "main:"+lsn, lsn, verified)
		require.NoError(e.t, err)
		lsns = append(lsns, lsn)
	}
	return lsns
}

// horizon sets every partition's watermark.
func (e *cursorEnv) horizon(lsn string) {
	e.t.Helper()
	_, err := e.pool.Exec(context.Background(), `UPDATE epitaph.progress SET source_lsn = $1::pg_lsn
		WHERE projection = 'archive' AND version = 1`, lsn)
	require.NoError(e.t, err)
}

func (e *cursorEnv) flush(d *Dispatcher) {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	left, err := d.Flush(ctx)
	require.NoError(e.t, err)
	require.Zero(e.t, left, "deliveries left open")
}

// handler adds a cursor handler of public.orders (batch 3) to target;
// mod adjusts it first.
func (e *cursorEnv) handler(target, secret string, mod ...func(*Def)) Def {
	e.t.Helper()
	def := Def{ID: newUUID(), Schema: "public", Table: "orders", Kind: KindWebhook, Target: target, MaxAttempts: 5,
		Backoff: time.Millisecond, ClaimTimeout: 30 * time.Second, BatchSize: 3, BatchWait: time.Second,
		SecretFile: writeSecret(e.t, secret)}
	for _, m := range mod {
		m(&def)
	}
	require.NoError(e.t, Add(context.Background(), e.pool, def))
	def, err := Get(context.Background(), e.pool, def.ID)
	require.NoError(e.t, err)
	require.True(e.t, def.UsesCursor())
	return def
}

// dispatcher is a dispatcher on the env's pool.
func (e *cursorEnv) dispatcher() *Dispatcher {
	e.t.Helper()
	d, err := NewDispatcher(e.pool, Config{Poll: 20 * time.Millisecond})
	require.NoError(e.t, err)
	return d
}

// settled returns "state:outcome:attempt" of handler's deliveries in
// commit order.
func (e *cursorEnv) settled(handlerID string) []string {
	e.t.Helper()
	rows, err := e.pool.Query(context.Background(), `SELECT state || ':' || COALESCE(outcome, '') || ':' || attempt
		FROM epitaph.deliveries WHERE handler_id = $1 ORDER BY commit_lsn, seq`, handlerID)
	require.NoError(e.t, err)
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(e.t, err)
	return out
}

// cursorAt returns handler's cursor position and whether it has one.
func (e *cursorEnv) cursorAt(handlerID string) (string, bool) {
	e.t.Helper()
	var lsn string
	err := e.pool.QueryRow(context.Background(), `SELECT commit_lsn::text FROM epitaph.handler_cursors WHERE handler_id = $1`,
		handlerID).Scan(&lsn)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", false
	}
	require.NoError(e.t, err)
	return lsn, true
}

// answers returns a receiver's answer function giving codes in turn,
// then 200.
func answers(codes ...int) func(int) int {
	return func(n int) int {
		if n <= len(codes) {
			return codes[n-1]
		}
		return 200
	}
}

// A cursor handler's deliveries are the verified archived rows of its
// table after its cursor up to the horizon, in batches in commit order,
// each with the delivery id the queued path gives it; each is written
// once, done, when its batch succeeds. A failed batch is retried as a
// whole (same webhook-id and body); rows past the horizon wait for it.
func TestCursorHandlerDeliversArchivedRowsOnceInBatches(t *testing.T) {
	e := newCursorEnv(t)
	secret := NewSecret()
	br, srv := newBatchReceiver(t, secret, func(n int) int {
		if n == 1 {
			return 503
		}
		return 200
	})
	ctx := context.Background()
	def := Def{ID: newUUID(), Schema: "public", Table: "orders", Kind: KindWebhook, Target: srv.URL, MaxAttempts: 5,
		Backoff: time.Millisecond, ClaimTimeout: 30 * time.Second, BatchSize: 3, BatchWait: time.Second,
		SecretFile: writeSecret(t, secret)}
	require.NoError(t, Add(ctx, e.pool, def))
	require.True(t, def.UsesCursor())

	lsns := e.archive("orders", true, 1, 2, 3, 4)
	e.archive("customers", true, 9)             // another table's row
	unverified := e.archive("orders", false, 5) // waits for its commit: the cursor stops before it
	late := e.archive("orders", true, 6)        // past the horizon
	preg := prometheus.NewRegistry()
	d, err := NewDispatcher(e.pool, Config{Poll: 20 * time.Millisecond, Registerer: preg})
	require.NoError(t, err)
	// One partition has applied nothing yet: its rows may still come,
	// so nothing is behind the horizon.
	_, err = e.pool.Exec(ctx, `UPDATE epitaph.progress SET source_lsn = $1::pg_lsn
		WHERE projection = 'archive' AND version = 1 AND partition = 0`, lsns[3])
	require.NoError(t, err)
	e.flush(d)
	require.Empty(t, br.got(), "a partition without a watermark holds the horizon")

	e.horizon(lsns[3])
	e.flush(d)
	time.Sleep(5 * time.Millisecond) // the backoff of the failed batch
	e.flush(d)
	posts := br.got()
	require.Len(t, posts, 3, "a batch of 3 refused, retried, then the partial batch of 1")
	require.Equal(t, ids(posts[0]), ids(posts[1]), "retried as a whole")
	require.Equal(t, string(posts[0].body), string(posts[1].body), "byte-identical")
	require.Equal(t, posts[0].id, posts[1].id)
	require.Equal(t, []string{"1", "2", "1"}, []string{posts[0].attempt, posts[1].attempt, posts[2].attempt})
	var got []string
	for _, p := range posts[1:] {
		for _, b := range p.ds {
			got = append(got, b.DeliveryID)
		}
	}
	var want []string
	for _, l := range lsns {
		want = append(want, DeliveryID(def.ID, "main", l, 0, 0))
	}
	require.Equal(t, want, got, "rows 1-4 in commit order, once each")

	// Past the horizon, but behind the unverified row: nothing yet.
	e.horizon(late[0])
	e.flush(d)
	require.Len(t, br.got(), 3)
	_, err = e.pool.Exec(ctx, `UPDATE archive_v1.rows SET verified = true WHERE commit_lsn = $1::pg_lsn`, unverified[0])
	require.NoError(t, err)
	e.flush(d)
	posts = br.got()
	require.Len(t, posts, 4)
	require.Equal(t, []string{DeliveryID(def.ID, "main", unverified[0], 0, 0), DeliveryID(def.ID, "main", late[0], 0, 0)}, ids(posts[3]))

	var states []string
	rows, err := e.pool.Query(ctx, `SELECT state || ':' || attempt FROM epitaph.deliveries ORDER BY commit_lsn`)
	require.NoError(t, err)
	states, err = pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, strings.Split("done:2 done:2 done:2 done:1 done:1 done:1", " "), states)

	// Each delivery of a batch counts as an attempt, with its duration.
	m := metricValues(t, preg)
	require.Equal(t, 6.0, m["epitaph_projector_delivery_attempts_total,handler="+def.ID+",result=done"])
	require.Equal(t, 3.0, m["epitaph_projector_delivery_attempts_total,handler="+def.ID+",result=failed"])
	require.Equal(t, 9.0, m["epitaph_projector_delivery_attempt_seconds,handler="+def.ID])
}

// Each cursor handler claims its own batches: three handlers of batch size
// 100 on three tables whose 300 rows are interleaved in commit order send
// three full batches, without waiting for their batch wait, and Flush
// sends the same three (where the queued path's claims, ordered across
// handlers, need room for every handler's batch: see
// TestClaimFillsTheBatchesOfEveryBatchingHandler).
func TestCursorHandlersEachFillTheirOwnBatches(t *testing.T) {
	for _, flush := range []bool{false, true} {
		t.Run(fmt.Sprintf("flush=%v", flush), func(t *testing.T) {
			e := newCursorEnv(t)
			ctx := context.Background()
			secret := NewSecret()
			br, srv := newBatchReceiver(t, secret, answers())
			tables := []string{"a", "b", "c"}
			for _, tb := range tables {
				e.handler(srv.URL, secret, func(d *Def) {
					d.Table, d.BatchSize, d.BatchWait, d.ClaimTimeout = tb, 100, 5*time.Second, time.Minute
				})
			}
			var last []string
			for i := range 300 {
				last = e.archive(tables[i%3], true, i+1)
			}
			e.horizon(last[0])
			d := e.dispatcher()
			start := time.Now()
			if flush {
				e.flush(d)
			} else {
				require.NoError(t, d.Start(ctx))
				eventually(t, func() bool { return len(br.got()) == 3 }, "three batches")
				require.Less(t, time.Since(start), 5*time.Second, "full batches do not wait")
				sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
				defer cancel()
				require.NoError(t, d.Stop(sctx))
				require.NoError(t, d.Wait())
			}
			posts := br.got()
			require.Len(t, posts, 3)
			seen := map[string]bool{}
			for _, p := range posts {
				require.Len(t, p.ds, 100)
				for _, id := range ids(p) {
					require.False(t, seen[id], "delivery %s sent once", id)
					seen[id] = true
				}
			}
			var done int
			require.NoError(t, e.pool.QueryRow(ctx, `SELECT count(*) FROM epitaph.deliveries WHERE state = 'done'`).Scan(&done))
			require.Equal(t, 300, done)
		})
	}
}

// A batch whose claim expired is reclaimed as an attempt, as a queued
// delivery's is: re-sent while attempts remain, and written dead
// (claim_expired, no POST) when the expired claim was the last attempt;
// the cursor passes it. A permanent answer (4xx but 408 and 429) makes
// the batch dead at once; 429 is retried.
func TestCursorBatchDeadAtAnExpiredLastClaimOrAPermanentAnswer(t *testing.T) {
	e := newCursorEnv(t)
	ctx := context.Background()
	secret := NewSecret()
	br, srv := newBatchReceiver(t, secret, answers(200, 400, 429, 200))
	def := e.handler(srv.URL, secret, func(d *Def) {
		d.BatchSize, d.MaxAttempts, d.ClaimTimeout, d.BatchWait = 2, 2, 300*time.Millisecond, 10*time.Millisecond
	})
	d := e.dispatcher()
	// A dispatcher that claims a batch and dies before sending it.
	dies := func() {
		t.Helper()
		live, err := d.live(ctx)
		require.NoError(t, err)
		send, _, _, _, err := d.cursorClaim(ctx, def, live)
		require.NoError(t, err)
		require.Len(t, send, 2)
		eventually(t, func() bool {
			var expired bool
			require.NoError(t, e.pool.QueryRow(ctx, `SELECT claim_expires_at < now() FROM epitaph.handler_cursors
				WHERE handler_id = $1`, def.ID).Scan(&expired))
			return expired
		}, "the claim expires")
	}

	e.horizon(e.archive("orders", true, 1, 2)[1])
	dies()
	e.flush(d)
	posts := br.got()
	require.Len(t, posts, 1, "reclaimed with an attempt left: sent")
	require.Equal(t, "2", posts[0].attempt)
	require.Equal(t, []string{"done:done:2", "done:done:2"}, e.settled(def.ID))

	e.horizon(e.archive("orders", true, 3, 4)[1])
	dies()
	dies()
	e.flush(d)
	require.Equal(t, 1, len(br.got()), "an expired last attempt is not sent again")
	require.Equal(t, []string{"done:done:2", "done:done:2", "dead:claim_expired:2", "dead:claim_expired:2"}, e.settled(def.ID))

	e.horizon(e.archive("orders", true, 5, 6)[1])
	e.flush(d)
	require.Equal(t, 2, len(br.got()), "400: dead after one POST")
	var m dto.Metric
	require.NoError(t, d.met.dead.WithLabelValues(def.ID).Write(&m))
	require.Equal(t, 2.0, m.GetCounter().GetValue(), "each dead delivery counted")
	e.horizon(e.archive("orders", true, 7, 8)[1])
	e.flush(d)
	posts = br.got()
	require.Len(t, posts, 4, "429: retried")
	require.Equal(t, ids(posts[2]), ids(posts[3]))
	got := e.settled(def.ID)
	require.Equal(t, []string{"dead:failed:1", "dead:failed:1", "done:done:2", "done:done:2"}, got[4:])
	var lastErr string
	require.NoError(t, e.pool.QueryRow(ctx, `SELECT last_error FROM epitaph.deliveries WHERE handler_id = $1
		AND outcome = 'failed'LIMIT 1`, def.ID).Scan(&lastErr))
	require.Contains(t, lastErr, "code=http_400")
	at, ok := e.cursorAt(def.ID)
	require.True(t, ok)
	require.Equal(t, fmt.Sprintf("0/%X", e.lsn), at, "the cursor passed every batch")
}

// Flush waits out a failed cursor batch's backoff, as it does a queued
// delivery's, and when ctx ends first it returns how many deliveries are
// still open, without an error.
func TestFlushWaitsOutAFailedCursorBatchsBackoff(t *testing.T) {
	e := newCursorEnv(t)
	secret := NewSecret()
	br, srv := newBatchReceiver(t, secret, answers(503))
	def := e.handler(srv.URL, secret, func(d *Def) { d.Backoff = 300 * time.Millisecond })
	e.horizon(e.archive("orders", true, 1, 2, 3)[2])
	e.flush(e.dispatcher())
	posts := br.got()
	require.Len(t, posts, 2, "refused, then retried after the backoff within one Flush")
	require.GreaterOrEqual(t, posts[1].at.Sub(posts[0].at), 200*time.Millisecond, "the backoff (300 ms, ±25%%)")
	require.Equal(t, []string{"done:done:2", "done:done:2", "done:done:2"}, e.settled(def.ID))

	slow, slowSrv := newBatchReceiver(t, secret, answers(503))
	e.handler(slowSrv.URL, secret, func(d *Def) { d.Table, d.Backoff = "customers", time.Hour })
	// A queued delivery, left when ctx ends: counted too.
	queued := Def{ID: newUUID(), Schema: "public", Table: "orders", Kind: KindWebhook, Target: slowSrv.URL, MaxAttempts: 5,
		Backoff: time.Millisecond, ClaimTimeout: 30 * time.Second, Revalidate: true}
	require.NoError(t, Add(context.Background(), e.pool, queued))
	e.archiveQueued(10)
	e.horizon(e.archive("customers", true, 1, 2)[1])
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	left, err := e.dispatcher().Flush(ctx)
	require.NoError(t, err)
	require.Equal(t, 3, left, "the failed batch's two deliveries wait for their retry, and the queued one")
	require.Len(t, slow.got(), 1)
}

// archiveQueued archives rows of public.orders as archive does and queues
// them as the apply does (for the handlers on the queued path).
func (e *cursorEnv) archiveQueued(keys ...int) []string {
	e.t.Helper()
	ctx := context.Background()
	lsns := e.archive("orders", true, keys...)
	rows := make([]Row, len(keys))
	for i, k := range keys {
		ct := time.Now()
		rows[i] = Row{Source: "main", Schema: "public", Table: "orders", Key: []byte(fmt.Sprintf(`{"id": %d}`, k)),
			Image: []byte(fmt.Sprintf(`{"id": %d, "note": "n-%d"}`, k, k)), CorrelationID: "main:" + lsns[i],
			CommitLSN: lsns[i], CommitTime: &ct, Verified: true, Committed: true}
	}
	c := NewCache(e.pool, time.Millisecond)
	require.NoError(e.t, c.Refresh(ctx))
	require.NoError(e.t, pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
		_, err := Enqueue(ctx, tx, c, "archive", 1, rows)
		return err
	}))
	return lsns
}

// sentIDs are the delivery ids a receiver got, in order.
func sentIDs(br *batchReceiver) []string {
	var out []string
	for _, p := range br.got() {
		out = append(out, ids(p)...)
	}
	return out
}

func idsOf(handlerID string, lsns ...string) []string {
	out := make([]string, len(lsns))
	for i, l := range lsns {
		out[i] = DeliveryID(handlerID, "main", l, 0, 0)
	}
	return out
}

// A cursor handler's lifecycle does to its pending rows what a queued
// handler's does to its queued deliveries, side by side on one table:
// neither delivers rows archived before it existed; disabled, both wait
// and go out on enable; revoke and remove stop every pending one (a batch
// in flight included, its attempt kept) as stop_revoked / stop_completed,
// with the same count, and deliver nothing afterwards; remove deletes the
// cursor.
func TestCursorHandlerLifecycleMatchesTheQueuedPath(t *testing.T) {
	e := newCursorEnv(t)
	ctx := context.Background()
	secret := NewSecret()
	qr, qsrv := newBatchReceiver(t, secret, answers())
	cr, csrv := newBatchReceiver(t, secret, answers())
	pair := func() (q, c Def) {
		t.Helper()
		base := Def{Schema: "public", Table: "orders", Kind: KindWebhook, MaxAttempts: 5, Backoff: time.Millisecond,
			ClaimTimeout: 30 * time.Second, BatchSize: 2, BatchWait: time.Second, SecretFile: writeSecret(t, secret)}
		q, c = base, base
		q.ID, q.Target, q.Revalidate = newUUID(), qsrv.URL, true
		c.ID, c.Target = newUUID(), csrv.URL
		require.NoError(t, Add(ctx, e.pool, q))
		require.NoError(t, Add(ctx, e.pool, c))
		require.False(t, q.UsesCursor())
		require.True(t, c.UsesCursor())
		return q, c
	}
	enable := func(on bool, defs ...Def) {
		t.Helper()
		for _, def := range defs {
			require.NoError(t, SetEnabled(ctx, e.pool, def.ID, on))
		}
	}
	d := e.dispatcher()

	e.horizon(e.archiveQueued(1)[0])
	q, c := pair()
	enable(false, q, c)
	lsns := e.archiveQueued(2, 3)
	e.horizon(lsns[1])
	e.flush(d)
	require.Empty(t, qr.got(), "disabled: waits")
	require.Empty(t, cr.got(), "disabled: waits")
	require.Equal(t, []string{"pending::0", "pending::0"}, e.settled(q.ID))

	enable(true, q, c)
	e.flush(d)
	require.Equal(t, idsOf(q.ID, lsns...), sentIDs(qr), "row 1 was archived before the handler: not delivered")
	require.Equal(t, idsOf(c.ID, lsns...), sentIDs(cr), "row 1 was behind the horizon when the handler was added")

	// Rows 4 and 5 pending, row 6 past the horizon.
	lsns = e.archiveQueued(4, 5, 6)
	e.horizon(lsns[1])
	nq, err := Revoke(ctx, e.pool, q.ID)
	require.NoError(t, err)
	nc, err := Revoke(ctx, e.pool, c.ID)
	require.NoError(t, err)
	require.Equal(t, int64(3), nq)
	require.Equal(t, nq, nc)
	stopped := []string{"done:done:1", "done:done:1", "stopped:stop_revoked:0", "stopped:stop_revoked:0", "stopped:stop_revoked:0"}
	require.Equal(t, stopped, e.settled(q.ID))
	require.Equal(t, stopped, e.settled(c.ID))
	_, ok := e.cursorAt(c.ID)
	require.False(t, ok, "a revoked handler's cursor is gone")
	e.horizon(e.archiveQueued(7)[0])
	e.flush(d)
	require.Len(t, sentIDs(qr), 2)
	require.Len(t, sentIDs(cr), 2)
	require.Equal(t, stopped, e.settled(q.ID), "nothing queued after the revoke")
	require.Equal(t, stopped, e.settled(c.ID))

	// Remove, with a batch of each in flight (claimed by a worker that
	// has not settled it).
	q2, c2 := pair()
	e.horizon(e.archiveQueued(8, 9)[1])
	cs, err := d.claim(ctx, 10)
	require.NoError(t, err)
	require.Len(t, cs, 2)
	live, err := d.live(ctx)
	require.NoError(t, err)
	send, tok, _, _, err := d.cursorClaim(ctx, c2, live)
	require.NoError(t, err)
	require.Len(t, send, 2)
	nq, err = Remove(ctx, e.pool, q2.ID)
	require.NoError(t, err)
	nc, err = Remove(ctx, e.pool, c2.ID)
	require.NoError(t, err)
	require.Equal(t, int64(2), nq)
	require.Equal(t, nq, nc)
	stopped = []string{"stopped:stop_completed:1", "stopped:stop_completed:1"}
	require.Equal(t, stopped, e.settled(q2.ID))
	require.Equal(t, stopped, e.settled(c2.ID))
	_, ok = e.cursorAt(c2.ID)
	require.False(t, ok, "a removed handler's cursor is deleted")
	_, err = Get(ctx, e.pool, c2.ID)
	require.ErrorIs(t, err, ErrNotFound)
	// The batch in flight settles nothing afterwards.
	require.NoError(t, d.cursorSettle(ctx, c2, live, send, tok, settlement{state: StateDone, outcome: OutcomeDone}, 1))
	require.Equal(t, stopped, e.settled(c2.ID))
	e.flush(d)
	require.Len(t, sentIDs(cr), 2)
}

// Two workers' dispatchers (two pools) on one cursor handler, while rows
// are archived and the horizon moves, never send two of its batches at
// once, and every row goes out once, in commit order: a batch is sent
// again only as a retry of a refused one (same webhook-id). The claim is
// guarded by the cursor row (its token and position).
func TestTwoDispatchersNeverRunACursorHandlersBatchTwiceAtOnce(t *testing.T) {
	e := newCursorEnv(t)
	ctx := context.Background()
	secret := NewSecret()
	var inFlight, overlaps atomic.Int32
	br, srv := newBatchReceiver(t, secret, func(n int) int {
		if inFlight.Add(1) > 1 {
			overlaps.Add(1)
		}
		defer inFlight.Add(-1)
		time.Sleep(time.Duration(n%4) * 3 * time.Millisecond)
		if n%7 == 0 {
			return 503
		}
		return 200
	})
	def := e.handler(srv.URL, secret, func(d *Def) { d.BatchSize, d.BatchWait = 5, 10*time.Millisecond })
	pool2, err := pgxpool.New(ctx, e.dsn)
	require.NoError(t, err)
	t.Cleanup(pool2.Close)
	var ds []*Dispatcher
	var sent [2]atomic.Int32
	for i, p := range []*pgxpool.Pool{e.pool, pool2} {
		client := &http.Client{Transport: countingTransport{n: &sent[i], rt: http.DefaultTransport}}
		d, err := NewDispatcher(p, Config{Poll: 5 * time.Millisecond, Parallelism: 4, HTTPClient: client})
		require.NoError(t, err)
		require.NoError(t, d.Start(ctx))
		ds = append(ds, d)
	}
	const rows = 200
	var want []string
	for i := range rows {
		l := e.archive("orders", true, i+1)
		want = append(want, DeliveryID(def.ID, "main", l[0], 0, 0))
		if i%10 == 9 {
			e.horizon(l[0])
			time.Sleep(2 * time.Millisecond)
		}
	}
	var done int
	eventually(t, func() bool {
		require.NoError(t, e.pool.QueryRow(ctx, `SELECT count(*) FROM epitaph.deliveries WHERE state = 'done'`).Scan(&done))
		return done == rows
	}, "every row done")
	for _, d := range ds {
		sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		require.NoError(t, d.Stop(sctx))
		cancel()
		require.NoError(t, d.Wait())
	}
	require.Zero(t, overlaps.Load(), "two batches of the handler at once")
	require.Positive(t, sent[0].Load(), "the first worker sent batches")
	require.Positive(t, sent[1].Load(), "the second worker sent batches")
	posts := br.got()
	var got []string
	batchOf := map[string]string{}
	for _, p := range posts {
		for _, id := range ids(p) {
			if b, ok := batchOf[id]; ok {
				require.Equal(t, b, p.id, "delivery %s sent again in another batch", id)
				continue
			}
			batchOf[id] = p.id
			got = append(got, id)
		}
	}
	require.Equal(t, want, got, "every row once, in commit order")
	require.Greater(t, len(posts), rows/5, "some batches were refused and retried")
}

// countingTransport counts the requests sent through it.
type countingTransport struct {
	n  *atomic.Int32
	rt http.RoundTripper
}

func (c countingTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	c.n.Add(1)
	return c.rt.RoundTrip(r)
}

// A cursor handler's dead delivery is retried like a queued one: its row
// in epitaph.deliveries has no payload (written settled), so retry
// rebuilds it from the live archive's row and the queued path sends it,
// with the same delivery id and body as the batch that failed; discard
// stops a dead one. A row no longer archived cannot be retried, and says
// why.
func TestRetryAndDiscardACursorHandlersDeadDelivery(t *testing.T) {
	e := newCursorEnv(t)
	ctx := context.Background()
	secret := NewSecret()
	br, srv := newBatchReceiver(t, secret, answers(400))
	def := e.handler(srv.URL, secret, func(d *Def) { d.Columns = []string{"note"} })
	lsns := e.archive("orders", true, 1, 2, 3)
	e.horizon(lsns[2])
	d := e.dispatcher()
	e.flush(d)
	require.Equal(t, []string{"dead:failed:1", "dead:failed:1", "dead:failed:1"}, e.settled(def.ID))
	first := br.got()[0].ds
	require.Len(t, first, 3)
	dead := idsOf(def.ID, lsns...)
	for _, id := range dead {
		info, err := ShowDelivery(ctx, e.pool, id)
		require.NoError(t, err)
		require.True(t, info.PayloadScrubbed, "settled without a payload")
	}

	require.NoError(t, Retry(ctx, e.pool, dead[0]))
	info, err := ShowDelivery(ctx, e.pool, dead[0])
	require.NoError(t, err)
	require.Equal(t, StatePending, info.State)
	require.JSONEq(t, `{"key": {"id": 1}, "columns": {"note": "n-1"}}`, string(info.Payload))
	require.NoError(t, Discard(ctx, e.pool, dead[1]))
	e.flush(d)
	posts := br.got()
	require.Len(t, posts, 2)
	require.Equal(t, []string{dead[0]}, ids(posts[1]))
	require.Equal(t, "1", posts[1].attempt, "a fresh attempt count")
	retried, err := json.Marshal(posts[1].ds[0])
	require.NoError(t, err)
	original, err := json.Marshal(first[0])
	require.NoError(t, err)
	require.JSONEq(t, string(original), string(retried), "the body the failed batch carried")
	require.Equal(t, []string{"done:done:1", "stopped:discarded:1", "dead:failed:1"}, e.settled(def.ID))

	_, err = e.pool.Exec(ctx, `DELETE FROM archive_v1.rows WHERE commit_lsn = $1::pg_lsn`, lsns[2])
	require.NoError(t, err)
	err = Retry(ctx, e.pool, dead[2])
	require.ErrorContains(t, err, "cannot be retried")
	require.Equal(t, "dead:failed:1", e.settled(def.ID)[2])
}

// A cursor's position is a source position, the same in every archive
// version: promoting a version ahead of the live one, rolling back to
// one that lags, and promoting again one behind the cursor deliver every
// row once, in commit order, each from whichever version is live.
func TestCursorAcrossVersionPromoteAndRollback(t *testing.T) {
	e := newCursorEnv(t)
	ctx := context.Background()
	_, err := e.pool.Exec(ctx, `INSERT INTO epitaph.projection_versions (projection, version, state, schema_name, partitions, boundary_seq)
		VALUES ('archive', 2, 'ready', 'archive_v2', 2, 0)`)
	require.NoError(t, err)
	require.NoError(t, version.EnsureArchive(ctx, e.pool, 2, nil))
	require.NoError(t, pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
		_, err := archive.EnsurePartitions(ctx, tx, archive.Schema(2), archive.DefaultPeriod, time.Now())
		return err
	}))
	// copy archives in v2 the rows archived in v1 at lsns; only moves
	// them there.
	copyTo2 := func(only bool, lsns ...string) {
		t.Helper()
		_, err := e.pool.Exec(ctx, `INSERT INTO archive_v2.rows SELECT * FROM archive_v1.rows WHERE commit_lsn = ANY($1::pg_lsn[])`, lsns)
		require.NoError(t, err)
		if only {
			_, err = e.pool.Exec(ctx, `DELETE FROM archive_v1.rows WHERE commit_lsn = ANY($1::pg_lsn[])`, lsns)
			require.NoError(t, err)
		}
	}
	horizon := func(v int, lsn string) {
		t.Helper()
		_, err := e.pool.Exec(ctx, `UPDATE epitaph.progress SET source_lsn = $2::pg_lsn
			WHERE projection = 'archive' AND version = $1`, v, lsn)
		require.NoError(t, err)
	}
	secret := NewSecret()
	br, srv := newBatchReceiver(t, secret, answers())
	def := e.handler(srv.URL, secret)
	d := e.dispatcher()

	var all []string
	l := e.archive("orders", true, 1, 2)
	all = append(all, l...)
	copyTo2(false, l...)
	horizon(1, l[1])
	horizon(2, l[1])
	e.flush(d)
	require.Equal(t, idsOf(def.ID, all...), sentIDs(br))

	// v1 has rows 3 and 4; v2, ahead, has 3 to 6 too.
	l = e.archive("orders", true, 3, 4)
	all = append(all, l...)
	copyTo2(false, l...)
	horizon(1, l[1])
	l = e.archive("orders", true, 5, 6)
	all = append(all, l...)
	copyTo2(true, l...)
	horizon(2, l[1])
	_, err = version.Promote(ctx, e.pool, "archive", 2, true)
	require.NoError(t, err)
	e.flush(d)
	require.Equal(t, idsOf(def.ID, all...), sentIDs(br), "rows 3 to 6 from v2")

	// Back to v1, which has not archived 5 and 6 yet: nothing sent again,
	// and its rows after the cursor go out.
	_, _, err = version.Rollback(ctx, e.pool, "archive", false)
	require.NoError(t, err)
	e.flush(d)
	require.Len(t, sentIDs(br), 6)
	_, err = e.pool.Exec(ctx, `INSERT INTO archive_v1.rows SELECT * FROM archive_v2.rows WHERE commit_lsn > $1::pg_lsn`, all[3])
	require.NoError(t, err)
	l = e.archive("orders", true, 7)
	all = append(all, l...)
	horizon(1, l[0])
	e.flush(d)
	require.Equal(t, idsOf(def.ID, all...), sentIDs(br), "rows 5 and 6 not again; row 7 from v1")

	// v2 again, behind the cursor: it waits, then delivers from there.
	_, err = version.Promote(ctx, e.pool, "archive", 2, true)
	require.NoError(t, err)
	e.flush(d)
	require.Len(t, sentIDs(br), 7)
	copyTo2(false, l...)
	l = e.archive("orders", true, 8)
	all = append(all, l...)
	copyTo2(false, l...)
	horizon(2, l[0])
	e.flush(d)
	require.Equal(t, idsOf(def.ID, all...), sentIDs(br), "every row once, in commit order")
	done := e.settled(def.ID)
	require.Len(t, done, 8)
	for _, s := range done {
		require.Equal(t, "done:done:1", s)
	}
}

// A secret rotated while a cursor batch waits for its retry signs the
// retry, as it would a queued delivery's: the same webhook-id and body,
// verified with the new secret alone (a rotation window of 0).
func TestRotatedSecretSignsACursorBatchsRetry(t *testing.T) {
	e := newCursorEnv(t)
	secret := NewSecret()
	br, srv := newBatchReceiver(t, secret, answers(503))
	// The retry waits longer than the first Flush, and than the secret
	// cache's second.
	def := e.handler(srv.URL, secret, func(d *Def) { d.Backoff = 4 * time.Second })
	e.horizon(e.archive("orders", true, 1, 2)[1])
	d := e.dispatcher()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	left, err := d.Flush(ctx)
	require.NoError(t, err)
	require.Equal(t, 2, left)

	next := NewSecret()
	_, err = RotateSecretFile(def.SecretFile, next, 0, time.Now())
	require.NoError(t, err)
	br.mu.Lock()
	br.wh = verifier(t, next)
	br.mu.Unlock()
	e.flush(d)
	posts := br.got()
	require.Len(t, posts, 2)
	require.Equal(t, posts[0].id, posts[1].id)
	require.Equal(t, string(posts[0].body), string(posts[1].body))
	require.Equal(t, []string{"done:done:2", "done:done:2"}, e.settled(def.ID))
}

// A cursor handler is added with its cursor or not at all: when the
// cursor cannot be written, no handler is left without one (the apply
// queues nothing for it, so its rows would go nowhere).
func TestCursorHandlerIsAddedWithItsCursorOrNotAtAll(t *testing.T) {
	e := newCursorEnv(t)
	ctx := context.Background()
	_, err := e.pool.Exec(ctx, `ALTER TABLE epitaph.handler_cursors RENAME TO handler_cursors_away`)
	require.NoError(t, err)
	def := Def{ID: newUUID(), Schema: "public", Table: "orders", Kind: KindWebhook, Target: "http://127.0.0.1:1/", MaxAttempts: 5,
		Backoff: time.Millisecond, ClaimTimeout: 30 * time.Second, BatchSize: 3, BatchWait: time.Second}
	require.True(t, def.UsesCursor())
	require.Error(t, Add(ctx, e.pool, def))
	_, err = Get(ctx, e.pool, def.ID)
	require.ErrorIs(t, err, ErrNotFound)

	_, err = e.pool.Exec(ctx, `ALTER TABLE epitaph.handler_cursors_away RENAME TO handler_cursors`)
	require.NoError(t, err)
	e.horizon(e.archive("orders", true, 1)[0])
	require.NoError(t, Add(ctx, e.pool, def))
	at, ok := e.cursorAt(def.ID)
	require.True(t, ok)
	require.Equal(t, fmt.Sprintf("0/%X", e.lsn), at, "at the horizon")
	require.ErrorContains(t, Add(ctx, e.pool, def), "exists already")

	// One without a cursor all the same (its row deleted by hand) is an
	// error for Flush, not "nothing open".
	_, err = e.pool.Exec(ctx, `DELETE FROM epitaph.handler_cursors`)
	require.NoError(t, err)
	_, err = e.dispatcher().Flush(ctx)
	require.ErrorContains(t, err, "has no cursor")
}

// An idle cursor handler (nothing claimed, its position at the horizon)
// is polled without locking its cursor row: no transaction id, no WAL,
// however often the dispatcher looks. Rows archived later go out as
// before.
func TestIdleCursorIsPolledWithoutALock(t *testing.T) {
	e := newCursorEnv(t)
	ctx := context.Background()
	secret := NewSecret()
	br, srv := newBatchReceiver(t, secret, func(int) int { return 200 })
	def := e.handler(srv.URL, secret, func(d *Def) { d.BatchWait = 10 * time.Millisecond })
	first := e.archive("orders", true, 1, 2)
	e.horizon(first[1])
	d, err := NewDispatcher(e.pool, Config{Poll: 5 * time.Millisecond})
	require.NoError(t, err)
	startUntilCleanup(t, d)
	eventually(t, func() bool { return len(e.settled(def.ID)) == 2 }, "the first rows done")
	locker := func() string {
		var x string
		require.NoError(t, e.pool.QueryRow(ctx, `SELECT xmax::text FROM epitaph.handler_cursors WHERE handler_id = $1`, def.ID).Scan(&x))
		return x
	}
	// The step after the last batch claims once more and finds nothing;
	// from then on the handler is idle.
	before := locker()
	eventually(t, func() bool {
		time.Sleep(50 * time.Millisecond)
		now := locker()
		defer func() { before = now }()
		return now == before
	}, "the cursor row settles")
	time.Sleep(500 * time.Millisecond) // about a hundred polls
	require.Equal(t, before, locker(), "an idle poll locked the cursor row")

	more := e.archive("orders", true, 3)
	e.horizon(more[0])
	eventually(t, func() bool { return len(e.settled(def.ID)) == 3 }, "a later row done")
	require.Len(t, br.got(), 2)
	require.Equal(t, idsOf(def.ID, more[0]), ids(br.got()[1]))
}

// More cursor handlers than --handler-parallelism take turns without
// waiting for the poll: a step that found nothing to send still hands
// its slot on to a handler the loop left for want of one. (Each idle
// handler's step used to leave the busy ones to the next poll, a batch
// per poll: 355 s instead of a second for 100,000 deliveries of four
// tables at parallelism 1.)
func TestCursorHandlersBeyondTheParallelismDoNotWaitForThePoll(t *testing.T) {
	e := newCursorEnv(t)
	secret := NewSecret()
	br, srv := newBatchReceiver(t, secret, answers())
	for _, tb := range []string{"idle1", "busy1", "idle2", "busy2"} {
		e.handler(srv.URL, secret, func(d *Def) {
			d.Table, d.BatchSize, d.BatchWait = tb, 10, time.Second
		})
	}
	var last []string
	for i := range 100 {
		last = e.archive([]string{"busy1", "busy2"}[i%2], true, i+1)
	}
	e.horizon(last[0])
	const poll = 3 * time.Second
	d, err := NewDispatcher(e.pool, Config{Poll: poll, Parallelism: 1})
	require.NoError(t, err)
	start := time.Now()
	startUntilCleanup(t, d)
	deadline := time.Now().Add(2 * time.Minute)
	for len(br.got()) < 10 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	took := time.Since(start)
	require.Len(t, br.got(), 10, "ten batches of ten")
	// Ten batches, and the idle handlers' steps between them, in less
	// than two polls: without the hand-on, every step of an idle handler
	// costs a poll.
	require.Less(t, took, 2*poll, "the batches waited for the poll")
	seen := map[string]bool{}
	for _, p := range br.got() {
		require.Len(t, p.ds, 10)
		for _, id := range ids(p) {
			require.False(t, seen[id], "delivery %s sent once", id)
			seen[id] = true
		}
	}
}

// Archived wakes the cursor handlers at once, so a batch leaves as soon
// as its rows are behind the horizon rather than at the next poll.
func TestArchivedWakesCursorHandlersBeforeThePoll(t *testing.T) {
	e := newCursorEnv(t)
	secret := NewSecret()
	br, srv := newBatchReceiver(t, secret, answers())
	def := e.handler(srv.URL, secret, func(d *Def) { d.BatchWait = 10 * time.Millisecond })
	const poll = 10 * time.Second
	d, err := NewDispatcher(e.pool, Config{Poll: poll})
	require.NoError(t, err)
	startUntilCleanup(t, d)
	// The first pass finds nothing; the next would be the poll's.
	time.Sleep(300 * time.Millisecond)
	require.Empty(t, br.got())
	lsns := e.archive("orders", true, 1, 2, 3)
	e.horizon(lsns[2])
	start := time.Now()
	d.Archived()
	eventually(t, func() bool { return len(br.got()) == 1 }, "the batch sent")
	require.Less(t, time.Since(start), poll/2, "the batch waited for the poll")
	require.Equal(t, idsOf(def.ID, lsns...), ids(br.got()[0]))
}

// Archived wakes at most once per archivedWakeGap, and a call inside the
// gap is not lost: it wakes at the gap's end, once however many came.
func TestArchivedWakesAreSpacedAndNoneLost(t *testing.T) {
	d := &Dispatcher{cursorState: cursorState{cursorWake: make(chan struct{}, 1)}}
	woken := func() bool {
		select {
		case <-d.cursorWake:
			return true
		default:
			return false
		}
	}
	d.Archived()
	require.True(t, woken(), "the first call wakes at once")
	for range 5 {
		d.Archived()
	}
	require.False(t, woken(), "calls inside the gap wait for its end")
	time.Sleep(archivedWakeGap + 50*time.Millisecond)
	require.True(t, woken(), "the calls inside the gap woke at its end")
	time.Sleep(archivedWakeGap + 50*time.Millisecond)
	require.False(t, woken(), "one wake for the calls inside the gap")
	d.Archived()
	require.True(t, woken(), "a call after the gap wakes at once")
}
