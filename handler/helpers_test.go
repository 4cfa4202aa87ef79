package handler

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
)

func TestMain(m *testing.M) { testenv.MainNoLeaks(m) }

// tenv is one test's migrated target with a live archive version.
type tenv struct {
	t    *testing.T
	pool *pgxpool.Pool
	logs *syncBuffer
	log  *slog.Logger
	lsn  int
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func newTenv(t *testing.T) *tenv {
	t.Helper()
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, testenv.NewDatabase(t))
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	require.NoError(t, migrations.Apply(ctx, pool))
	_, err = pool.Exec(ctx, `INSERT INTO epitaph.projection_versions (projection, version, state, schema_name, partitions)
		VALUES ('archive', 1, 'live', 'archive_v1', 1), ('archive', 2, 'building', 'archive_v2', 1)`)
	require.NoError(t, err)
	logs := &syncBuffer{}
	return &tenv{t: t, pool: pool, logs: logs, log: slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug})), lsn: 0x1000}
}

// addHandler adds a handler with fast defaults; mod adjusts it.
func (e *tenv) addHandler(kind, target string, mod ...func(*Def)) Def {
	e.t.Helper()
	d := Def{ID: newUUID(), Schema: "public", Table: "orders", Kind: kind, Target: target, MaxAttempts: 5,
		Backoff: 20 * time.Millisecond, ClaimTimeout: 30 * time.Second, Revalidate: true}
	for _, m := range mod {
		m(&d)
	}
	require.NoError(e.t, Add(context.Background(), e.pool, d))
	d, err := Get(context.Background(), e.pool, d.ID)
	require.NoError(e.t, err)
	return d
}

// row returns a verified, committed row of public.orders with key id=n.
func (e *tenv) row(n int) Row {
	e.lsn += 0x10
	ct := time.Date(2026, 12, 1, 9, 0, 0, 0, time.UTC)
	return Row{Source: "main", Schema: "public", Table: "orders", Key: []byte(fmt.Sprintf(`{"id":%d}`, n)),
		Image: []byte(fmt.Sprintf(`{"id":%d,"blob":"b-%d","secret":"s-%d"}`, n, n, n)), CorrelationID: fmt.Sprintf("main:%d:0/%X", n, e.lsn),
		CommitLSN: fmt.Sprintf("0/%X", e.lsn), Seq: 1, CommitTime: &ct, Verified: true, Committed: true}
}

// enqueue queues rows as the apply of version does.
func (e *tenv) enqueue(version int, rows ...Row) {
	e.t.Helper()
	ctx := context.Background()
	c := NewCache(e.pool, time.Millisecond)
	require.NoError(e.t, c.Refresh(ctx))
	tx, err := e.pool.Begin(ctx)
	require.NoError(e.t, err)
	_, err = Enqueue(ctx, tx, c, "archive", version, rows)
	require.NoError(e.t, err)
	require.NoError(e.t, tx.Commit(ctx))
}

func (e *tenv) dispatcher(cfg Config) *Dispatcher {
	e.t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = e.log
	}
	if cfg.Poll == 0 {
		cfg.Poll = 20 * time.Millisecond
	}
	d, err := NewDispatcher(e.pool, cfg)
	require.NoError(e.t, err)
	return d
}

// flush runs queued work to completion within a minute.
func (e *tenv) flush(d *Dispatcher) {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	left, err := d.Flush(ctx)
	require.NoError(e.t, err)
	require.Zero(e.t, left, "deliveries left open")
}

type drow struct {
	Handler, State, Outcome string
	Attempt                 int
	LastError               *string
	Payload                 *string
}

// deliveries returns every delivery by key id and handler priority.
func (e *tenv) deliveries() []drow {
	e.t.Helper()
	rows, err := e.pool.Query(context.Background(), `SELECT handler_id::text, state, COALESCE(outcome, ''), attempt, last_error, payload::text
		FROM epitaph.deliveries ORDER BY (key->>'id')::int, priority, handler_id`)
	require.NoError(e.t, err)
	defer rows.Close()
	var out []drow
	for rows.Next() {
		var r drow
		require.NoError(e.t, rows.Scan(&r.Handler, &r.State, &r.Outcome, &r.Attempt, &r.LastError, &r.Payload))
		out = append(out, r)
	}
	require.NoError(e.t, rows.Err())
	return out
}

// eventually polls cond until it holds or the deadline passes.
func eventually(t *testing.T, cond func() bool, msg string) {
	t.Helper()
	deadline := time.Now().Add(90 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out: %s", msg)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// startUntilCleanup starts d and stops it (soft stop, at most 30 s) when
// the test ends.
func startUntilCleanup(t *testing.T, d *Dispatcher) {
	t.Helper()
	require.NoError(t, d.Start(context.Background()))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		require.NoError(t, d.Stop(ctx))
		require.NoError(t, d.Wait())
	})
}

// metricValues gathers reg: each series by its name and labels
// ("name,label=value,..."), a gauge's or counter's value, a histogram's
// sample count.
func metricValues(t *testing.T, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	got := map[string]float64{}
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			name := mf.GetName()
			for _, l := range m.GetLabel() {
				name += "," + l.GetName() + "=" + l.GetValue()
			}
			switch {
			case m.GetGauge() != nil:
				got[name] = m.GetGauge().GetValue()
			case m.GetCounter() != nil:
				got[name] = m.GetCounter().GetValue()
			case m.GetHistogram() != nil:
				got[name] = float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	return got
}

// waitsForALock waits until a statement of this test's database whose
// text holds like waits for a lock.
func waitsForALock(t *testing.T, pool *pgxpool.Pool, like, msg string) {
	t.Helper()
	require.Eventually(t, func() bool {
		var n int
		require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
			WHERE wait_event_type = 'Lock' AND datname = current_database() AND query LIKE '%' || $1 || '%'`, like).Scan(&n))
		return n > 0
	}, 10*time.Second, 10*time.Millisecond, msg)
}
