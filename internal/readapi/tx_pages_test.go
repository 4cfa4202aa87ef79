package readapi

import (
	"context"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// A page of a transaction of many rows (one bulk DELETE of 30,000) reads
// about a page of them, in seq order from the rows' unique key, not every
// row of the transaction sorted again for every page.
func TestReadAPITransactionPageReadsAPageNotTheWholeTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testenv.NewDatabase(t)
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	require.NoError(t, migrations.Apply(ctx, pool))
	require.NoError(t, version.EnsureArchive(ctx, pool, 1, nil))
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := archive.EnsurePartitions(ctx, tx, archive.Schema(1), archive.DefaultPeriod, time.Now())
		return err
	}))
	const corr = "main:77:1/9000"
	_, err = pool.Exec(ctx, `
		INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row, identity, correlation_id, xid, commit_lsn, commit_time, seq, columns)
		SELECT 'main', 'public', 'notes', jsonb_build_object('id', g), jsonb_build_object('id', g), 'full', $1, 77, '1/9000', now(), g, '[]'
		FROM generate_series(0, 29999) g`, corr)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `
		INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row, identity, correlation_id, xid, commit_lsn, commit_time, seq, columns)
		SELECT 'main', 'public', 'notes', jsonb_build_object('id', g), jsonb_build_object('id', g), 'full',
		       'main:' || g || ':0/' || to_hex(g), g, ('0/' || to_hex(g))::pg_lsn, now(), 0, '[]'
		FROM generate_series(1, 5000) g;
		ANALYZE archive_v1.rows`)
	require.NoError(t, err)
	removed := regexp.MustCompile(`Rows Removed by (Filter|Index Recheck): (\d+)`)
	actual := regexp.MustCompile(`\(actual rows=(\d+) loops=(\d+)\)`)
	for _, after := range []int{-1, 15000} {
		sql, args := transactionQuery(corr, int64(after), DefaultLimit+1)
		rows, err := pool.Query(ctx, "EXPLAIN (ANALYZE, TIMING OFF) "+sql, args...)
		require.NoError(t, err)
		lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		plan := strings.Join(lines, "\n")
		for _, m := range actual.FindAllStringSubmatch(plan, -1) {
			n, _ := strconv.Atoi(m[1])
			loops, _ := strconv.Atoi(m[2])
			require.LessOrEqual(t, n*loops, 4*DefaultLimit, "after seq %d: a node read %s rows:\n%s", after, m[1], plan)
		}
		for _, m := range removed.FindAllStringSubmatch(plan, -1) {
			n, _ := strconv.Atoi(m[2])
			require.LessOrEqual(t, n, 4*DefaultLimit, "after seq %d: a node dropped %s rows:\n%s", after, m[2], plan)
		}
	}
}
