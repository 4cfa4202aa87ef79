package handler

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
)

// lateApply is what the apply does with a late row of the handlers'
// table in its transaction: it archives the row at (lsn, seq) and hands it
// to Enqueue marked late. It returns whether a delivery row was queued.
func lateApply(ctx context.Context, pool *pgxpool.Pool, c *Cache, table, lsn string, seq, key int) (bool, error) {
	var queued bool
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row,
			correlation_id, commit_lsn, commit_time, seq, verified)
			VALUES ('main', 'public', $1, $2::jsonb, $2::jsonb, $3, $4::pg_lsn, now(), $5, true)`,
			table, fmt.Sprintf(`{"id": %d}`, key), "main:"+lsn, lsn, seq); err != nil {
			return err
		}
		now := time.Now()
		if _, err := Enqueue(ctx, tx, c, archiveProjection, 1, []Row{{Source: "main", Schema: "public", Table: table,
			Key: json.RawMessage(fmt.Sprintf(`{"id": %d}`, key)), CorrelationID: "main:" + lsn, CommitLSN: lsn, Seq: seq,
			CommitTime: &now, Verified: true, Committed: true, Late: true}}); err != nil {
			return err
		}
		return tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM epitaph.deliveries WHERE commit_lsn = $1::pg_lsn AND seq = $2)`,
			lsn, seq).Scan(&queued)
	})
	return queued, err
}

func (e *cursorEnv) cache() *Cache {
	e.t.Helper()
	c := NewCache(e.pool, time.Hour)
	require.NoError(e.t, c.Refresh(context.Background()))
	return c
}

// settledStates returns each delivery row as "id state", in commit order.
func settledStates(t *testing.T, pool *pgxpool.Pool) map[string]string {
	t.Helper()
	rows, err := pool.Query(context.Background(), `SELECT id::text, state FROM epitaph.deliveries`)
	require.NoError(t, err)
	out := map[string]string{}
	for rows.Next() {
		var id, state string
		require.NoError(t, rows.Scan(&id, &state))
		out[id] = state
	}
	require.NoError(t, rows.Err())
	return out
}

// A row archived at or behind a cursor handler's claimed position is
// delivered once, on the queued path: behind the settled cursor, and
// inside a claimed range whose batch the receiver refused (the retry
// resends exactly the batch it claimed, without the late row). A late
// row ahead of the claimed position is left to the cursor.
func TestCursorLateRowBehindTheClaimIsQueuedOnce(t *testing.T) {
	e := newCursorEnv(t)
	ctx := context.Background()
	secret := NewSecret()
	br, srv := newBatchReceiver(t, secret, func(n int) int {
		if n == 2 {
			return 503 // the second batch (rows 4-6) once
		}
		return 200
	})
	def := Def{ID: newUUID(), Schema: "public", Table: "orders", Kind: KindWebhook, Target: srv.URL, MaxAttempts: 5,
		Backoff: time.Millisecond, ClaimTimeout: 30 * time.Second, BatchSize: 3, BatchWait: 2 * time.Second,
		SecretFile: writeSecret(t, secret)}
	require.NoError(t, Add(ctx, e.pool, def))
	c := e.cache()
	d, err := NewDispatcher(e.pool, Config{Poll: 20 * time.Millisecond})
	require.NoError(t, err)
	id := func(lsn string, seq int) string { return DeliveryID(def.ID, "main", lsn, seq, 0) }

	lsns := e.archive("orders", true, 1, 2, 3)
	e.horizon(lsns[2])
	e.flush(d)
	require.Len(t, br.got(), 1)

	// Behind the settled cursor: queued, and sent by the queued path.
	queued, err := lateApply(ctx, e.pool, c, "orders", lsns[1], 1, 21)
	require.NoError(t, err)
	require.True(t, queued, "behind the cursor")
	// Ahead of the cursor (which passed the horizon: no row of the table
	// was left behind it): the cursor's.
	more := e.archive("orders", true, 4, 5, 6)
	queued, err = lateApply(ctx, e.pool, c, "orders", more[0], 2, 31)
	require.NoError(t, err)
	require.False(t, queued, "ahead of the cursor")
	e.horizon(more[2])

	// The next batch (4, 4+2, 5) is claimed and refused; a row archived
	// inside its range meanwhile is queued, and the retry is the same batch.
	_, tok, _, _, err := d.cursorClaim(ctx, def, liveArchive{version: 1, rows: "archive_v1.rows"})
	require.NoError(t, err)
	require.NotEmpty(t, tok)
	queued, err = lateApply(ctx, e.pool, c, "orders", more[0], 1, 41)
	require.NoError(t, err)
	require.True(t, queued, "inside the claimed range")
	_, err = e.pool.Exec(ctx, `UPDATE epitaph.handler_cursors SET claim_token = NULL, claim_expires_at = NULL`)
	require.NoError(t, err) // the claim is dropped (a crashed dispatcher): the next claim retries its range

	e.flush(d)
	time.Sleep(5 * time.Millisecond) // the refused batch's backoff
	e.flush(d)
	posts := br.got()
	late := map[string]bool{id(lsns[1], 1): true, id(more[0], 1): true}
	var cursorPosts [][]string
	var rowDeliveries []string
	for _, p := range posts[1:] {
		if late[p.ds[0].DeliveryID] {
			rowDeliveries = append(rowDeliveries, ids(p)...)
		} else {
			cursorPosts = append(cursorPosts, ids(p))
		}
	}
	wantBatch := []string{id(more[0], 0), id(more[0], 2), id(more[1], 0)}
	require.Equal(t, [][]string{wantBatch, wantBatch, {id(more[2], 0)}}, cursorPosts,
		"refused, retried whole without the late row, then the rest")
	require.ElementsMatch(t, []string{id(lsns[1], 1), id(more[0], 1)}, rowDeliveries, "the late rows, on the queued path, once")

	states := settledStates(t, e.pool)
	require.Len(t, states, 9, "one delivery row per archived row")
	for k, s := range states {
		require.Equal(t, "done", s, k)
	}
}

// A cursor batch whose delivery was queued as a row too (the
// serialisation with the apply broken): its settle does not insert the
// delivery again, reports it, and the cursor goes on (it is not retried,
// and sent, forever).
func TestCursorSettleOverAQueuedDeliveryReportsItAndGoesOn(t *testing.T) {
	e := newCursorEnv(t)
	ctx := context.Background()
	secret := NewSecret()
	var def Def
	var lsns []string
	var dup string
	// The delivery's row appears while its batch is in flight (a claim
	// leaves out rows that have one): the settle finds it.
	br, srv := newBatchReceiver(t, secret, func(n int) int {
		if n == 1 {
			_, err := e.pool.Exec(ctx, `INSERT INTO epitaph.deliveries (id, handler_id, source, commit_lsn, seq, schema_name, table_name,
				correlation_id, version, phase, state, outcome, settled_at)
				VALUES ($1::uuid, $2::uuid, 'main', $3::pg_lsn, 0, 'public', 'orders', 'x', 1, 'immediate', 'done', 'done', now())`,
				dup, def.ID, lsns[1])
			if err != nil {
				return 599
			}
		}
		return 200
	})
	def = Def{ID: newUUID(), Schema: "public", Table: "orders", Kind: KindWebhook, Target: srv.URL, MaxAttempts: 5,
		Backoff: time.Millisecond, ClaimTimeout: 30 * time.Second, BatchSize: 2, BatchWait: 2 * time.Second,
		SecretFile: writeSecret(t, secret)}
	require.NoError(t, Add(ctx, e.pool, def))
	lsns = e.archive("orders", true, 1, 2, 3, 4)
	e.horizon(lsns[3])
	dup = DeliveryID(def.ID, "main", lsns[1], 0, 0)

	logs := &syncBuffer{}
	reg := prometheus.NewRegistry()
	d, err := NewDispatcher(e.pool, Config{Poll: 20 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(logs, nil)), Registerer: reg})
	require.NoError(t, err)
	e.flush(d)
	require.NotContains(t, cursorSettlePlainSQL, "ON CONFLICT", "the common settle pays no speculative insertion")
	require.Len(t, br.got(), 2, "both batches: the cursor passed the first")
	require.Contains(t, logs.String(), "queued as rows too")
	require.Equal(t, 1.0, counterValue(t, reg, "epitaph_projector_delivery_duplicates_total", def.ID), "counted")
	require.Contains(t, logs.String(), dup)
	states := settledStates(t, e.pool)
	require.Len(t, states, 4)
	var pos string
	require.NoError(t, e.pool.QueryRow(ctx, `SELECT commit_lsn::text FROM epitaph.handler_cursors`).Scan(&pos))
	require.Equal(t, lsns[3], pos)
}

// acceptedReceiver counts the deliveries of the batches it accepted, by
// id; it refuses one batch in seven.
type acceptedReceiver struct {
	mu    sync.Mutex
	posts int
	got   map[string]int
	bad   []string
}

func newAcceptedReceiver(t *testing.T) (*acceptedReceiver, *httptest.Server) {
	ar := &acceptedReceiver{got: map[string]int{}}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		var b BatchBody
		ar.mu.Lock()
		defer ar.mu.Unlock()
		if err := json.Unmarshal(body, &b); err != nil {
			ar.bad = append(ar.bad, err.Error())
		}
		ar.posts++
		if ar.posts%7 == 3 {
			w.WriteHeader(503)
			return
		}
		for _, dv := range b.Deliveries {
			ar.got[dv.DeliveryID]++
		}
		w.WriteHeader(200)
	}))
	t.Cleanup(srv.Close)
	return ar, srv
}

// Late applies race the cursor's claims (two pools: the applies', the
// dispatcher's): rows are archived at the horizon as it advances, and rows
// behind it, around the cursor, at random. Every row is delivered exactly
// once (the receiver's accepted deliveries by id) and has one delivery
// row, done; the late rows went both ways (queued, left to the cursor).
func TestCursorLateAppliesRacingTheClaimDeliverEveryRowOnce(t *testing.T) {
	e := newCursorEnv(t)
	ctx := context.Background()
	ar, srv := newAcceptedReceiver(t)
	def := Def{ID: newUUID(), Schema: "public", Table: "orders", Kind: KindWebhook, Target: srv.URL, MaxAttempts: 1000,
		Backoff: time.Millisecond, ClaimTimeout: 30 * time.Second, BatchSize: 4, BatchWait: time.Millisecond,
		SecretFile: writeSecret(t, NewSecret())}
	require.NoError(t, Add(ctx, e.pool, def))
	c := e.cache()

	cfg, err := pgxpool.ParseConfig(e.pool.Config().ConnString())
	require.NoError(t, err)
	dpool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(dpool.Close)
	logs := &syncBuffer{}
	d, err := NewDispatcher(dpool, Config{Poll: time.Millisecond, Parallelism: 2, Logger: slog.New(slog.NewTextHandler(logs, nil))})
	require.NoError(t, err)
	require.NoError(t, d.Start(ctx))
	stopped := false
	stop := func() {
		if !stopped {
			stopped = true
			require.NoError(t, d.Stop(ctx))
		}
	}
	t.Cleanup(stop)

	const iterations = 500
	var (
		mu      sync.Mutex
		heads   []string // the rows archived at the horizon
		want    = map[string]bool{}
		queued  atomic.Int64
		cursors atomic.Int64
	)
	head := func() []string {
		mu.Lock()
		defer mu.Unlock()
		return heads
	}
	done := make(chan error, 3)
	go func() { // the horizon's rows: each with its partitions' watermark, as an apply
		for i := range iterations {
			lsn := fmt.Sprintf("0/%X", 0x10000+i*0x100)
			err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
				if _, err := tx.Exec(ctx, `INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row,
					correlation_id, commit_lsn, commit_time, seq, verified)
					VALUES ('main', 'public', 'orders', $1::jsonb, $1::jsonb, $2, $3::pg_lsn, now(), 0, true)`,
					fmt.Sprintf(`{"id": %d}`, i), "main:"+lsn, lsn); err != nil {
					return err
				}
				_, err := tx.Exec(ctx, `UPDATE epitaph.progress SET source_lsn = $1::pg_lsn WHERE projection = 'archive' AND version = 1`, lsn)
				return err
			})
			if err != nil {
				done <- err
				return
			}
			mu.Lock()
			heads = append(heads, lsn)
			want[DeliveryID(def.ID, "main", lsn, 0, 0)] = true
			mu.Unlock()
			time.Sleep(time.Duration(rand.IntN(1000)) * time.Microsecond)
		}
		done <- nil
	}()
	const lateAppliers = 2
	for g := range lateAppliers {
		go func() { // late rows around the cursor
			rng := rand.New(rand.NewPCG(1, uint64(g)))
			for i := range iterations {
				h := head()
				if len(h) == 0 {
					time.Sleep(time.Millisecond)
					continue
				}
				// Around the claimed position: inside, just behind or
				// just ahead of the batch being claimed.
				var at string
				if err := e.pool.QueryRow(ctx, `SELECT GREATEST(commit_lsn, COALESCE(claimed_to_lsn, commit_lsn))::text
					FROM epitaph.handler_cursors`).Scan(&at); err != nil {
					done <- err
					return
				}
				j, _ := slices.BinarySearchFunc(h, at, func(x, y string) int {
					return cmp.Compare(len(x), len(y))*2 + cmp.Compare(x, y)
				})
				lsn := h[min(len(h)-1, max(0, j-4+rng.IntN(7)))]
				seq := 1 + g*iterations + i
				q, err := lateApply(ctx, e.pool, c, "orders", lsn, seq, 100000+seq)
				if err != nil {
					done <- err
					return
				}
				if q {
					queued.Add(1)
				} else {
					cursors.Add(1)
				}
				mu.Lock()
				want[DeliveryID(def.ID, "main", lsn, seq, 0)] = true
				mu.Unlock()
				time.Sleep(time.Duration(rng.IntN(800)) * time.Microsecond)
			}
			done <- nil
		}()
	}
	for range 1 + lateAppliers {
		require.NoError(t, <-done)
	}

	total := len(want)
	// Until every row is done, or nothing moved for 5 s (a row lost).
	last, lastAt := -1, time.Now()
	for {
		var n int
		require.NoError(t, e.pool.QueryRow(ctx, `SELECT count(*) FROM epitaph.deliveries WHERE state = 'done'`).Scan(&n))
		if n != last {
			last, lastAt = n, time.Now()
		}
		if n >= total || time.Since(lastAt) > 5*time.Second {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	stop()

	ar.mu.Lock()
	defer ar.mu.Unlock()
	require.Empty(t, ar.bad)
	var lost, twice, unknown []string
	for id := range want {
		switch ar.got[id] {
		case 0:
			lost = append(lost, id)
		case 1:
		default:
			twice = append(twice, id)
		}
	}
	for id := range ar.got {
		if !want[id] {
			unknown = append(unknown, id)
		}
	}
	first := func(ids []string) []string { return ids[:min(len(ids), 5)] }
	require.Empty(t, first(lost), "every row delivered: %d of %d lost", len(lost), total)
	require.Empty(t, first(twice), "no row delivered twice: %d twice", len(twice))
	require.Empty(t, first(unknown))
	states := settledStates(t, e.pool)
	require.Len(t, states, total, "one delivery row per row")
	for id, s := range states {
		require.True(t, want[id], id)
		require.Equal(t, "done", s, id)
	}
	require.NotContains(t, logs.String(), "queued as rows too")
	t.Logf("%d rows, %d late: %d queued, %d left to the cursor; %d POSTs", total, queued.Load()+cursors.Load(),
		queued.Load(), cursors.Load(), ar.posts)
	require.NotZero(t, queued.Load(), "late rows behind the claimed position")
	require.NotZero(t, cursors.Load(), "late rows ahead of it")
}

// counterValue is the value of the counter name with label handler.
func counterValue(t *testing.T, reg *prometheus.Registry, name, handler string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "handler" && l.GetValue() == handler {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}

// A late row's queued delivery goes out before a later deletion of the
// same key that the cursor sends (DESIGN 10: "deliveries of one (table,
// key) stay in order"): while the late row waits for its retry, the
// cursor's batch stops before the key's later row, and the rows after it
// wait too.
func TestCursorWaitsForALateRowOfTheSameKeyQueuedBeforeIt(t *testing.T) {
	e := newCursorEnv(t)
	ctx := context.Background()
	secret := NewSecret()
	br, srv := newBatchReceiver(t, secret, answers(200, 503)) // the late row's first attempt is refused
	def := e.handler(srv.URL, secret, func(d *Def) { d.Backoff, d.BatchWait = time.Second, 10*time.Millisecond })
	c := e.cache()
	d := e.dispatcher()

	lsns := e.archive("orders", true, 1, 2, 3)
	e.horizon(lsns[2])
	e.flush(d)
	require.Len(t, br.got(), 1)
	queued, err := lateApply(ctx, e.pool, c, "orders", lsns[1], 1, 21)
	require.NoError(t, err)
	require.True(t, queued, "behind the cursor")
	late := DeliveryID(def.ID, "main", lsns[1], 1, 0)

	startUntilCleanup(t, d)
	eventually(t, func() bool { return len(br.got()) == 2 }, "the late row's first attempt")
	// Key 21 is deleted again, with rows of other keys after it, while
	// the late row waits out its backoff.
	more := e.archive("orders", true, 21, 22, 23)
	e.horizon(more[2])
	eventually(t, func() bool { return len(sentIDs(br)) == 8 }, "every delivery sent")
	require.Equal(t, append([]string{late}, idsOf(def.ID, more...)...), sentIDs(br)[4:],
		"the late row's retry, then key 21's later row and the rest")
}
