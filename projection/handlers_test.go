package projection_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// addGoHandler adds a go handler of public.<table> named name.
func addGoHandler(t *testing.T, pool *pgxpool.Pool, id, table, name, phase string, columns ...string) {
	t.Helper()
	require.NoError(t, handler.Add(context.Background(), pool, handler.Def{ID: id, Schema: "public", Table: table,
		Kind: handler.KindGo, Target: name, Phase: phase, Columns: columns, MaxAttempts: 5, Backoff: 50 * time.Millisecond,
		ClaimTimeout: time.Minute, Revalidate: false}))
}

// recorder is a Go handler that records when each delivery ran.
type recorder struct {
	mu   sync.Mutex
	runs map[string][]time.Time
}

func (r *recorder) Handle(_ context.Context, d handler.Delivery) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.runs == nil {
		r.runs = map[string][]time.Time{}
	}
	r.runs[d.ID] = append(r.runs[d.ID], time.Now())
	return nil
}

func (r *recorder) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.runs)
}

func flushAll(t *testing.T, d *handler.Dispatcher) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	left, err := d.Flush(ctx)
	require.NoError(t, err)
	return left
}

// An after-group handler of a 1,750-row signed transaction spanning four
// pages fires only after its commit: while the rows are stored (invisible,
// not verified) their deliveries exist and are not released, for the
// immediate handler too (an unverified row may be forged); the commit
// releases all of them, and each runs once.
func TestHandlersAfterGroupBigTransaction(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	ctx := context.Background()
	pool := e.pool()
	require.NoError(t, migrations.Apply(ctx, pool))
	const lines, orders = "0b6f5e43-3d0e-4c2b-9a51-6f7f2a8c1e90", "7a1c3f00-0000-4000-8000-000000000001"
	addGoHandler(t, pool, lines, "order_lines", "lines", handler.PhaseAfterGroup, "sku")
	addGoHandler(t, pool, orders, "orders", "orders", handler.PhaseImmediate)
	reg := handler.NewRegistry()
	rec := &recorder{}
	require.NoError(t, reg.Register("lines", rec))
	require.NoError(t, reg.Register("orders", rec))
	disp, err := handler.NewDispatcher(pool, handler.Config{Registry: reg, Logger: testLogger(t)})
	require.NoError(t, err)

	tx := e.nextTx()
	rows := shopTx(1, 250, 5000) // 250 orders: 1,750 rows
	msgs := e.shopMessages(tx, rows)
	e.start(e.config("w1"))
	e.publishAll(msgs[:len(msgs)-1])
	c := e.conn()
	eventually(t, 2*time.Minute, func() bool { return count(t, c, `SELECT count(*) FROM archive_v1.rows`) == len(rows) })
	require.Equal(t, 1000, count(t, c, `SELECT count(*) FROM archive.deliveries`), "250 orders + 750 lines")
	require.Equal(t, 0, count(t, c, `SELECT count(*) FROM archive.deliveries WHERE released_at IS NOT NULL`))
	require.Equal(t, 0, count(t, c, `SELECT count(*) FROM epitaph.deliveries WHERE verified`))
	require.Zero(t, flushAll(t, disp), "nothing is due")
	require.Zero(t, rec.count(), "no handler ran before the commit")

	committed := time.Now()
	e.publishAll(msgs[len(msgs)-1:])
	eventually(t, 2*time.Minute, func() bool {
		return count(t, c, `SELECT count(*) FROM archive.deliveries WHERE released_at IS NOT NULL`) == 1000
	})
	require.Zero(t, flushAll(t, disp))
	require.Equal(t, 1000, rec.count())
	rec.mu.Lock()
	for id, at := range rec.runs {
		require.Len(t, at, 1, id)
		require.True(t, at[0].After(committed), "ran before the commit was published")
	}
	rec.mu.Unlock()
	require.Equal(t, 1000, count(t, c, `SELECT count(*) FROM archive.deliveries WHERE state = 'done' AND payload IS NULL`))
	require.Equal(t, 750, count(t, c, `SELECT count(*) FROM epitaph.deliveries d JOIN archive.rows r
		ON r.source = d.source AND r.commit_lsn = d.commit_lsn AND r.seq = d.seq
		WHERE d.handler_id = $1 AND r.table_name = 'order_lines' AND d.key = r.key`, lines))
}

// A rebuild creates no deliveries; promoting it does not replay history;
// rows applied after the promotion get theirs from the new live version,
// once.
func TestHandlersRebuildCreatesNoDeliveries(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	ctx := context.Background()
	pool := e.pool()
	require.NoError(t, migrations.Apply(ctx, pool))
	addGoHandler(t, pool, "7a1c3f00-0000-4000-8000-000000000002", "orders", "o", handler.PhaseImmediate, "status")
	e.start(e.config("w1"))
	for i := 0; i < 5; i++ {
		e.publish(e.nextTx(orderRows(i+1, 2)...))
	}
	c := e.conn()
	eventually(t, time.Minute, func() bool { return count(t, c, `SELECT count(*) FROM archive.deliveries`) == 5 })
	require.Equal(t, 5, count(t, c, `SELECT count(*) FROM epitaph.deliveries WHERE version = 1 AND payload ? 'columns'`))
	e.heartbeat()
	v2, err := version.CreateVersion(ctx, pool, e.js, version.RebuildOptions{Source: src})
	require.NoError(t, err)
	eventually(t, time.Minute, func() bool { return state(t, pool, v2.Version) == version.StateReady })
	require.Equal(t, 15, count(t, c, `SELECT count(*) FROM archive_v2.rows`))
	require.Equal(t, 5, count(t, c, `SELECT count(*) FROM epitaph.deliveries`), "the rebuild created none")
	_, err = version.Promote(ctx, pool, archive.Projection, v2.Version, false)
	require.NoError(t, err)
	e.publish(e.nextTx(orderRows(6, 1)...))
	eventually(t, time.Minute, func() bool { return count(t, c, `SELECT count(*) FROM epitaph.deliveries`) == 6 })
	require.Equal(t, 1, count(t, c, `SELECT count(*) FROM epitaph.deliveries WHERE key = '{"id":6}'`))
	require.Equal(t, 5, count(t, c, `SELECT count(*) FROM epitaph.deliveries WHERE version = 1`))
}

// Rows of a transaction that never gets its signed commit (a verified
// heartbeat comes first: they cannot be a real transaction's) are
// quarantined; their deliveries never ran and end stopped as unverified.
func TestHandlersUnverifiedRowsNeverRun(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	ctx := context.Background()
	pool := e.pool()
	require.NoError(t, migrations.Apply(ctx, pool))
	addGoHandler(t, pool, "7a1c3f00-0000-4000-8000-000000000003", "orders", "o", handler.PhaseImmediate)
	e.start(e.config("w1"))
	tx := e.nextTx(orderRows(1, 2)...)
	msgs := e.messages(tx)
	e.publishAll(msgs[:len(msgs)-1]) // no commit
	c := e.conn()
	eventually(t, time.Minute, func() bool { return count(t, c, `SELECT count(*) FROM archive.deliveries`) == 1 })
	require.Equal(t, 0, count(t, c, `SELECT count(*) FROM archive.deliveries WHERE released_at IS NOT NULL`))
	e.heartbeat()
	eventually(t, time.Minute, func() bool {
		return count(t, c, `SELECT count(*) FROM archive.deliveries WHERE state = 'stopped' AND outcome = 'unverified' AND payload IS NULL`) == 1
	})
	require.Equal(t, 0, count(t, c, `SELECT count(*) FROM archive.deliveries WHERE released_at IS NOT NULL`))
}
