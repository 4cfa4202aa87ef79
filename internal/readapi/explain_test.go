package readapi

import (
	"context"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
)

// TestReadAPILookupsUseIndexes: with enough rows (70,000 archived rows,
// 10,000 snapshots) and fresh statistics, each lookup of the read API is
// an index scan (no planner settings changed), and the README's example
// (schema_name + table_name + key) is too. A page of a table that holds
// most of the rows is read in order from the rows' unique key, without
// sorting the table's rows, first page and later ones.
func TestReadAPILookupsUseIndexes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := setup(t, "")
	corr, _ := e.deleteTx(42, 1)
	e.startProjector()
	require.Eventually(t, func() bool {
		return e.get("/v1/transactions/"+url.PathEscape(corr)).status == 200
	}, 120*time.Second, 100*time.Millisecond)
	_, err := e.pool.Exec(ctx, `
		INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row, identity, correlation_id, xid, commit_lsn, seq, columns)
		SELECT 'main', 'public', 't' || (g % 50), jsonb_build_object('id', g), jsonb_build_object('id', g, 'v', 'x'), 'full',
		       'main:' || (g / 10) || ':0/' || to_hex(g / 10), g / 10, ('0/' || to_hex(g / 10))::pg_lsn, g % 10, '[]'
		FROM generate_series(1, 50000) g;
		INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row, identity, correlation_id, xid, commit_lsn, seq, columns)
		SELECT 'main', 'public', 'big', jsonb_build_object('id', g), jsonb_build_object('id', g, 'v', 'x'), 'full',
		       'main:' || g || ':1/' || to_hex(g), g, ('1/' || to_hex(g))::pg_lsn, 0, '[]'
		FROM generate_series(1, 20000) g;
		INSERT INTO archive_v1.snapshots (correlation_id, root_table, root_key, status, source, commit_lsn, root_seq)
		SELECT 'main:' || g || ':0/1', 'public.t' || (g % 20), jsonb_build_object('id', g), 'complete', 'main', '0/1', 0
		FROM generate_series(1, 10000) g;
		ANALYZE archive_v1.rows; ANALYZE archive_v1.snapshots`)
	require.NoError(t, err)
	explain := func(sql string, args ...any) string {
		rows, err := e.pool.Query(ctx, "EXPLAIN "+sql, args...)
		require.NoError(t, err)
		lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		return strings.Join(lines, "\n")
	}
	// The rows table is partitioned: the 50,000 rows (no commit time) are
	// in its default partition, scanned by its copy of each index; the
	// other partitions hold a row or none and are rightly scanned whole.
	const tableKey, correlation = `(rows_table_key_idx|rows_default_schema_name_table_name_key_idx)`, `(rows_correlation_idx|rows_default_correlation_id_idx)`
	const bigSeqScan = `Seq Scan on (rows|rows_default|snapshots) `
	plan := explain(rowsSQL, "public", "t7", `{"id": 7}`, nil, nil, 101, nil)
	require.Regexp(t, "Index Scan using "+tableKey, plan)
	require.NotRegexp(t, bigSeqScan, plan)
	plan = explain(rowsSQL, "public", "t7", `{"id": 7}`, "0/10", 3, 101, "main")
	require.Regexp(t, tableKey, plan)
	require.NotRegexp(t, bigSeqScan, plan)
	// A table's rows: a backward scan of the unique key (the partitions'
	// copies, merged), never a sort of all the rows of the table.
	const rowsKey = `Index Scan Backward using (rows_key|rows_pkey|rows_default_source_commit_lsn_seq_commit_time_key)`
	sort := regexp.MustCompile(`(?m)^\s*(->\s+)?Sort\s+\(`)
	plan = explain(tableRowsSQL, "main", "public", "big", nil, nil, nil, nil, 101)
	require.Regexp(t, rowsKey, plan)
	require.NotRegexp(t, sort, plan)
	require.NotRegexp(t, bigSeqScan, plan)
	plan = explain(tableRowsSQL, "main", "public", "big", nil, nil, "1/2710", 0, 101)
	require.Regexp(t, rowsKey, plan)
	require.Regexp(t, `Index Cond: \(\(source = 'main'::text\) AND \(ROW\(commit_lsn, seq\) < ROW\('1/2710'::pg_lsn, 0\)\)\)`, plan)
	require.NotRegexp(t, sort, plan)
	plan = explain(transactionSQL, "main:77:0/4d", -1, 101)
	require.Regexp(t, correlation, plan)
	require.NotRegexp(t, bigSeqScan, plan)
	plan = explain(snapshotsSQL, "public.t3", `{"id": 3}`, nil, 101, nil)
	require.Contains(t, plan, "snapshots_root_idx", plan)
	require.NotRegexp(t, bigSeqScan, plan)
	// The README's support query.
	plan = explain(`SELECT correlation_id, row FROM archive.rows
		WHERE schema_name = 'public' AND table_name = 't2' AND key = '{"id": 42}' ORDER BY commit_lsn DESC`)
	require.Regexp(t, tableKey, plan)
	require.NotRegexp(t, bigSeqScan, plan)
}
