package handler

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/projection/archive"
)

// A deliveries table that grew past its statistics (a backlog queued in a
// burst) is analyzed by the dispatcher (in the background of its claim loop, and
// by Flush), once, on the columns its statements filter on; a table whose
// statistics are current is not analyzed again.
func TestMaintainAnalyzesTablesThatOutgrewTheirStatistics(t *testing.T) {
	e := newTenv(t)
	ctx := context.Background()
	e.addHandler(KindGo, "noop")
	rows := make([]Row, 0, 2*analyzeMinRows)
	for i := range 2 * analyzeMinRows {
		rows = append(rows, e.row(i))
	}
	e.enqueue(1, rows...)
	d := e.dispatcher(Config{})
	analyzed := func() int {
		var n int
		require.NoError(t, e.pool.QueryRow(ctx, `SELECT analyze_count FROM pg_stat_user_tables
			WHERE relid = 'epitaph.deliveries'::regclass`).Scan(&n))
		return n
	}
	require.Zero(t, analyzed())
	// The inserts reach the statistics collector within a second or so;
	// the running dispatcher (no handler of this process: nothing is
	// claimed) looks every second.
	require.NoError(t, d.Start(ctx))
	eventually(t, func() bool { return analyzed() > 0 }, "the grown deliveries table analyzed")
	require.NoError(t, d.Stop(ctx))
	require.Equal(t, 1, analyzed())
	for range 3 {
		require.NoError(t, d.analyzeGrown(ctx))
	}
	require.Equal(t, 1, analyzed(), "not analyzed again: its statistics are current")
}

// The live archive's rows table, partitioned by commit time, that grew
// past its statistics while a handler revalidates: the dispatcher analyzes
// the parent (whose statistics the planner uses for the reader views, and
// which autovacuum never analyzes), on the columns revalidation filters
// on, which analyzes its partitions too; once current, not again.
func TestMaintainAnalyzesThePartitionedArchive(t *testing.T) {
	e := newTenv(t)
	ctx := context.Background()
	tx, err := e.pool.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, archive.DDL("archive_v1"))
	require.NoError(t, err)
	months := []time.Time{time.Date(2026, 10, 5, 0, 0, 0, 0, time.UTC), time.Date(2026, 11, 5, 0, 0, 0, 0, time.UTC)}
	_, err = archive.EnsurePartitions(ctx, tx, "archive_v1", archive.PeriodMonth, months...)
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	var kind string
	require.NoError(t, e.pool.QueryRow(ctx, `SELECT relkind::text FROM pg_class WHERE oid = 'archive_v1.rows'::regclass`).Scan(&kind))
	require.Equal(t, "p", kind, "a partitioned rows table (PostgreSQL 15 or later)")
	e.addHandler(KindGo, "noop") // revalidates: the archive's rows are queried per delivery
	_, err = e.pool.Exec(ctx, `
		INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row, identity, correlation_id, xid, commit_lsn, commit_time, seq)
		SELECT 'main', 'public', 'orders', jsonb_build_object('id', g), jsonb_build_object('id', g), 'full',
		       'main:' || g || ':0/' || to_hex(g), g, ('0/' || to_hex(g))::pg_lsn,
		       timestamptz '2026-10-01' + make_interval(hours => g), 0
		FROM generate_series(1, $1::int) g`, 3*analyzeMinRows)
	require.NoError(t, err)

	// The parent's own statistics (inherited) and its partitions'.
	parentStats := func() []string {
		rows, err := e.pool.Query(ctx, `SELECT attname::text FROM pg_stats
			WHERE schemaname = 'archive_v1' AND tablename = 'rows' AND inherited ORDER BY attname`)
		require.NoError(t, err)
		cols, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		return cols
	}
	partitionsAnalyzed := func() int {
		var n int
		require.NoError(t, e.pool.QueryRow(ctx, `SELECT coalesce(sum(s.analyze_count), 0) FROM pg_partition_tree('archive_v1.rows') p
			JOIN pg_stat_user_tables s ON s.relid = p.relid WHERE p.isleaf`).Scan(&n))
		return n
	}
	require.Empty(t, parentStats())
	d := e.dispatcher(Config{})
	// The inserts reach the statistics within a second or so.
	eventually(t, func() bool {
		require.NoError(t, d.analyzeGrown(ctx))
		return len(parentStats()) > 0
	}, "the grown partitioned archive analyzed")
	require.Equal(t, []string{"commit_lsn", "correlation_id", "expires_at", "key", "schema_name", "seq", "source", "table_name"},
		parentStats(), "the columns revalidation filters on, not the row images")
	analyzed := partitionsAnalyzed()
	require.Equal(t, 3, analyzed, "each partition holding rows analyzed with the parent: October, November, the default")
	for range 3 {
		require.NoError(t, d.analyzeGrown(ctx))
	}
	require.Equal(t, analyzed, partitionsAnalyzed(), "not analyzed again: its statistics are current")
}

// While every handler follows a cursor, epitaph.deliveries only gains the
// rows of settled batches, which no claim plans on: the dispatcher leaves
// it to autovacuum however far it outgrows its statistics; once a handler
// queues rows again, the grown table is analyzed.
func TestMaintainLeavesTheCursorHandlersSettledRowsAlone(t *testing.T) {
	e := newTenv(t)
	ctx := context.Background()
	cur := e.addHandler(KindWebhook, "http://127.0.0.1:1/hook", func(d *Def) {
		d.Revalidate, d.BatchSize, d.BatchWait = false, 100, 100*time.Millisecond
	})
	require.True(t, cur.UsesCursor())
	_, err := e.pool.Exec(ctx, `
		INSERT INTO epitaph.deliveries (id, handler_id, source, commit_lsn, seq, schema_name, table_name, key,
		    correlation_id, version, state, outcome, attempt, settled_at)
		SELECT gen_random_uuid(), $1::uuid, 'main', ('0/' || to_hex(g))::pg_lsn, 0, 'public', 'orders',
		       jsonb_build_object('id', g), 'main:' || g, 1, 'done', 'done', 1, now()
		FROM generate_series(1, $2::int) g`, cur.ID, 3*analyzeMinRows)
	require.NoError(t, err)
	analyzed := func() (n int) {
		require.NoError(t, e.pool.QueryRow(ctx, `SELECT analyze_count FROM pg_stat_user_tables
			WHERE relid = 'epitaph.deliveries'::regclass`).Scan(&n))
		return n
	}
	eventually(t, func() bool {
		var live int64
		require.NoError(t, e.pool.QueryRow(ctx, `SELECT n_live_tup FROM pg_stat_user_tables
			WHERE relid = 'epitaph.deliveries'::regclass`).Scan(&live))
		return live >= 3*analyzeMinRows
	}, "the settled rows counted by the statistics collector")
	d := e.dispatcher(Config{})
	for range 3 {
		require.NoError(t, d.analyzeGrown(ctx))
	}
	require.Zero(t, analyzed(), "only cursor handlers: their settled rows are not analyzed")

	e.addHandler(KindGo, "noop") // queues a row per delivery
	require.NoError(t, d.analyzeGrown(ctx))
	require.Equal(t, 1, analyzed(), "a queued handler's claims plan on the grown table")
}
