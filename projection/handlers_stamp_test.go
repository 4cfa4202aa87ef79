package projection_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/handler/revalidate"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
)

// The apply stamps revalidation's promise on the deliveries it releases:
// the fingerprint and the cheap pair of each one's set (the group's rows of
// its table), in the page's transaction, also for a transaction spanning
// pages (released when its commit is applied). The evaluator, reading the
// same predicate, finds the set unchanged on the cheap path.
func TestAppliedDeliveriesAreStampedForRevalidation(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, e.url)
	require.NoError(t, err)
	defer pool.Close()
	require.NoError(t, migrations.Apply(ctx, pool))
	_, err = pool.Exec(ctx, `INSERT INTO epitaph.handlers (id, schema_name, table_name, kind, target)
		VALUES ('00000000-0000-4000-8000-0000000000b1', 'public', 'order_lines', 'go', 'noop')`)
	require.NoError(t, err)
	cfg := e.config("w1")
	cfg.BatchSize = 2 // the second transaction spans three pages
	e.start(cfg)

	small, big := e.nextTx(orderRows(1, 2)...), e.nextTx(orderRows(2, 4)...)
	e.publish(small)
	e.publish(big)
	c := e.conn()
	eventually(t, 30*time.Second, func() bool {
		return count(t, c, `SELECT count(*) FROM epitaph.deliveries WHERE fingerprint IS NOT NULL`) == 6
	}, "every delivery stamped")

	source := testenv.NewDatabase(t)
	sp, err := pgxpool.New(ctx, source)
	require.NoError(t, err)
	defer sp.Close()
	_, err = sp.Exec(ctx, `CREATE TABLE public.order_lines (id int8 PRIMARY KEY)`)
	require.NoError(t, err)
	ev, err := revalidate.New(pool, revalidate.Config{SourceURL: source, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.NoError(t, err)
	defer ev.Close()

	for _, tx := range []*txn{small, big} {
		rows, err := pool.Query(ctx, `SELECT id::text, group_rows, fingerprint FROM epitaph.deliveries
			WHERE commit_lsn = $1::pg_lsn ORDER BY seq`, tx.lsn.String())
		require.NoError(t, err)
		var ids, fps []string
		for rows.Next() {
			var id, fp string
			var n int
			require.NoError(t, rows.Scan(&id, &n, &fp))
			require.Equal(t, len(tx.rows)-1, n, "the group's rows of the handler's table")
			ids, fps = append(ids, id), append(fps, fp)
		}
		require.NoError(t, rows.Err())
		require.Len(t, ids, len(tx.rows)-1)
		for _, id := range ids {
			res, err := ev.Evaluate(ctx, id)
			require.NoError(t, err)
			require.Equal(t, revalidate.Send, res.Outcome, res.Reason)
			require.Equal(t, revalidate.PathCheap, res.Path)
			require.Equal(t, fps[0], res.ObservedFingerprint)
		}
	}
}

// Only the deliveries of handlers that revalidate get the promise: a
// handler added with revalidation off never reads it, and the apply does
// not hash its groups for it. Both handlers' deliveries are queued.
func TestOnlyRevalidatingHandlersAreStamped(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, e.url)
	require.NoError(t, err)
	defer pool.Close()
	require.NoError(t, migrations.Apply(ctx, pool))
	const checks, plain = "00000000-0000-4000-8000-0000000000c1", "00000000-0000-4000-8000-0000000000c2"
	_, err = pool.Exec(ctx, `INSERT INTO epitaph.handlers (id, schema_name, table_name, kind, target, revalidate)
		VALUES ($1, 'public', 'order_lines', 'go', 'noop', true), ($2, 'public', 'order_lines', 'go', 'noop', false)`, checks, plain)
	require.NoError(t, err)
	cfg := e.config("w1")
	cfg.BatchSize = 2 // the second transaction spans three pages
	e.start(cfg)
	e.publish(e.nextTx(orderRows(1, 2)...))
	e.publish(e.nextTx(orderRows(2, 4)...))
	c := e.conn()
	eventually(t, 30*time.Second, func() bool {
		return count(t, c, `SELECT count(*) FROM epitaph.deliveries WHERE fingerprint IS NOT NULL`) == 6
	}, "every delivery of the revalidating handler stamped")
	rows, err := pool.Query(ctx, `SELECT handler_id::text, count(*), count(fingerprint), count(group_rows), count(group_max)
		FROM epitaph.deliveries GROUP BY 1 ORDER BY 1`)
	require.NoError(t, err)
	type stamped struct{ handler, n, fps, pairs, maxes string }
	var got []stamped
	for rows.Next() {
		var s stamped
		var n, fps, pairs, maxes int
		require.NoError(t, rows.Scan(&s.handler, &n, &fps, &pairs, &maxes))
		s.n, s.fps, s.pairs, s.maxes = fmt.Sprint(n), fmt.Sprint(fps), fmt.Sprint(pairs), fmt.Sprint(maxes)
		got = append(got, s)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, []stamped{{checks, "6", "6", "6", "6"}, {plain, "6", "0", "0", "0"}}, got)
}
