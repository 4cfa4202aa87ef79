package retention

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/archive"
)

// cursorHandler adds a cursor handler of public.<table> and puts its
// cursor at (lsn, seq).
func cursorHandler(t *testing.T, pool *pgxpool.Pool, table, lsn string, seq int, mod ...func(*handler.Def)) handler.Def {
	t.Helper()
	ctx := context.Background()
	d := handler.Def{ID: newID(t, pool), Schema: "public", Table: table, Kind: handler.KindWebhook, Target: "http://127.0.0.1:1/hook",
		MaxAttempts: 5, Backoff: time.Second, ClaimTimeout: time.Minute, BatchSize: 10, BatchWait: time.Second}
	for _, m := range mod {
		m(&d)
	}
	require.NoError(t, handler.Add(ctx, pool, d))
	moveCursor(t, pool, d.ID, lsn, seq)
	return d
}

func newID(t *testing.T, pool *pgxpool.Pool) string {
	t.Helper()
	var id string
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT gen_random_uuid()::text`).Scan(&id))
	return id
}

// moveCursor puts a handler's cursor at (lsn, seq), creating it if need be.
func moveCursor(t *testing.T, pool *pgxpool.Pool, id, lsn string, seq int) {
	t.Helper()
	_, err := pool.Exec(context.Background(), `INSERT INTO epitaph.handler_cursors (handler_id, commit_lsn, seq) VALUES ($1, $2, $3)
		ON CONFLICT (handler_id) DO UPDATE SET commit_lsn = EXCLUDED.commit_lsn, seq = EXCLUDED.seq`, id, lsn, seq)
	require.NoError(t, err)
}

// A cursor handler's pending deliveries are the rows of its table after
// its cursor: retention keeps exactly those, expired or not, in the
// row-by-row delete and in the partition drop, for the smallest cursor of
// the table's cursor handlers (a disabled one included), and lets them go
// once the cursors pass them. Revoked and removed handlers, and a cursor
// row left by a handler that does not use one, hold nothing.
func TestCleanupKeepsRowsAfterCursorHandlers(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, testenv.NewDatabase(t))
	require.NoError(t, err)
	defer pool.Close()
	require.NoError(t, migrations.Apply(ctx, pool))
	_, err = pool.Exec(ctx, archive.DDL("archive_v1")+`
		INSERT INTO epitaph.projection_versions (projection, version, state, schema_name, partitions)
		VALUES ('archive', 1, 'live', 'archive_v1', 1)`)
	require.NoError(t, err)
	aug, sep := time.Date(2026, 8, 10, 0, 0, 0, 0, time.UTC), time.Date(2026, 9, 10, 0, 0, 0, 0, time.UTC)
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := archive.EnsurePartitions(ctx, tx, "archive_v1", archive.PeriodMonth, aug, sep)
		return err
	}))
	// One transaction a month, all expired: August's at 1/0 (orders, seq
	// 0-9), September's at 2/0 (orders, seq 0-9; customers, seq 10-14).
	insert := func(source, table string, lsn string, at time.Time, from, to int) {
		_, err := pool.Exec(ctx, `INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row, correlation_id,
			commit_lsn, commit_time, seq, expires_at)
			SELECT $6, 'public', $1, jsonb_build_object('id', s), jsonb_build_object('id', s), 'c' || $2,
			       $2::pg_lsn, $3, s, now() - interval '1 day'
			FROM generate_series($4::int, $5::int) s`, table, lsn, at, from, to, source)
		require.NoError(t, err)
	}
	insert("main", "orders", "1/0", aug, 0, 9)
	insert("main", "orders", "2/0", sep, 0, 9)
	insert("main", "customers", "2/0", sep, 10, 14)
	// A row of another source in August, after both cursors by position:
	// kept too (positions are compared without the source), found past
	// the first source of the partition.
	insert("zzz", "orders", "3/0", aug, 0, 0)

	lead := cursorHandler(t, pool, "orders", "1/0", 4)
	lag := cursorHandler(t, pool, "orders", "2/0", 2)
	require.NoError(t, handler.SetEnabled(ctx, pool, lag.ID, false))
	// Hold nothing: a revoked cursor handler, a removed one (its cursor
	// row left behind), a revalidating batch handler with a stray cursor.
	revoked := cursorHandler(t, pool, "customers", "0/0", 0)
	_, err = handler.Revoke(ctx, pool, revoked.ID)
	require.NoError(t, err)
	removed := cursorHandler(t, pool, "customers", "0/0", 0)
	_, err = handler.Remove(ctx, pool, removed.ID)
	require.NoError(t, err)
	moveCursor(t, pool, removed.ID, "0/0", 0)
	queued := cursorHandler(t, pool, "customers", "0/0", 0, func(d *handler.Def) { d.Revalidate = true })
	require.False(t, queued.UsesCursor())

	left := func() []string {
		t.Helper()
		rows, err := pool.Query(ctx, `SELECT tableoid::regclass::text || ':' || table_name || ':' || commit_lsn::text || ':' || seq
			FROM archive_v1.rows ORDER BY commit_lsn, seq`)
		require.NoError(t, err)
		out, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		return out
	}
	span := func(part, table, lsn string, from, to int) []string {
		var out []string
		for s := from; s <= to; s++ {
			out = append(out, fmt.Sprintf("archive_v1.%s:%s:%s:%d", part, table, lsn, s))
		}
		return out
	}

	// The leading handler is behind in August: August's partition stays,
	// its rows after the cursor with it; every orders row of September is
	// after both cursors; the customers rows go.
	res, err := CleanupBatch(ctx, pool, CleanupOptions{Batch: 1000})
	require.NoError(t, err)
	require.Empty(t, res.Dropped, "August has rows after a cursor; September too")
	other := span("rows_p20260801", "orders", "3/0", 0, 0)
	require.Equal(t, slices.Concat(span("rows_p20260801", "orders", "1/0", 5, 9), span("rows_p20260901", "orders", "2/0", 0, 9), other), left())
	require.Equal(t, map[string]int{"public.orders": 5, "public.customers": 5}, res.ByTable)
	require.Nil(t, res.OldestDue, "the rows left are held: none is due")

	// The leading handler passes every row of the source: the disabled
	// one, at 2/0 seq 2, holds the rest of September, and the other
	// source's row keeps August, whose other rows go one by one.
	moveCursor(t, pool, lead.ID, "2/0", 9)
	res, err = CleanupBatch(ctx, pool, CleanupOptions{Batch: 1000})
	require.NoError(t, err)
	require.Empty(t, res.Dropped)
	require.Equal(t, slices.Concat(span("rows_p20260901", "orders", "2/0", 3, 9), other), left())
	require.Equal(t, 5+3, res.Deleted)

	// Removed, the disabled handler holds nothing; the leading one has
	// passed the other source's row too: both partitions go whole.
	_, err = handler.Remove(ctx, pool, lag.ID)
	require.NoError(t, err)
	moveCursor(t, pool, lead.ID, "3/0", 0)
	res, err = CleanupBatch(ctx, pool, CleanupOptions{Batch: 1000})
	require.NoError(t, err)
	require.Equal(t, []string{"archive_v1.rows_p20260801", "archive_v1.rows_p20260901"}, res.Dropped)
	require.Empty(t, left())
	require.Equal(t, 1+7, res.Deleted)
}
