package console

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

// A search by table (no key, no correlation id) reads about a page per
// source of the rows' unique key, first page and later ones: never every
// row of the archive, nor a sort of all of the table's rows (the read API's
// table listing is held to the same).
func TestConsoleTableSearchReadsAPageNotTheWholeArchive(t *testing.T) {
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
	// 40,000 rows of one table from two sources (no commit time: all in the
	// default partition), and a few of another table.
	_, err = pool.Exec(ctx, `
		INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row, identity, correlation_id, xid, commit_lsn, seq, columns)
		SELECT s, 'public', 'big', jsonb_build_object('id', g), jsonb_build_object('id', g, 'v', 'x'), 'full',
		       s || ':' || g || ':1/' || to_hex(g), g, ('1/' || to_hex(g))::pg_lsn, 0, '[]'
		FROM generate_series(1, 20000) g, unnest(ARRAY['main', 'other']) s;
		INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row, identity, correlation_id, xid, commit_lsn, seq, columns)
		SELECT 'main', 'public', 'small', jsonb_build_object('id', g), jsonb_build_object('id', g), 'full',
		       'main:' || g || ':2/' || to_hex(g), g, ('2/' || to_hex(g))::pg_lsn, 0, '[]'
		FROM generate_series(1, 20) g;
		ANALYZE archive_v1.rows`)
	require.NoError(t, err)
	explain := func(a searchArgs) string {
		rows, err := pool.Query(ctx, "EXPLAIN (ANALYZE, TIMING OFF) "+searchQuery(a), a.schema, a.table, a.key, a.since, a.until, a.corr, a.lsn, a.seq, PageSize+1, a.source)
		require.NoError(t, err)
		lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		return strings.Join(lines, "\n")
	}
	whole := regexp.MustCompile(`(Seq Scan|Bitmap Heap Scan) on rows_default`)
	removed := regexp.MustCompile(`Rows Removed by Filter: (\d+)`)
	actual := regexp.MustCompile(`\(actual rows=(\d+) loops=(\d+)\)`)
	for _, page := range []struct{ name, table, lsn string }{
		{"first page", "public.big", ""}, {"later page", "public.big", "1/2710"}, {"small table", "public.small", ""},
	} {
		d := &searchData{Table: page.table}
		a, err := parseSearch(d, "")
		require.NoError(t, err)
		if page.lsn != "" {
			seq, src := 0, "other"
			a.lsn, a.seq, a.source = &page.lsn, &seq, &src
		}
		plan := explain(a)
		for _, m := range removed.FindAllStringSubmatch(plan, -1) {
			n, _ := strconv.Atoi(m[1])
			require.LessOrEqual(t, n, 4*PageSize, "%s: a node read %s rows only to drop them:\n%s", page.name, m[1], plan)
		}
		require.NotRegexp(t, whole, plan, page.name)
		for _, m := range actual.FindAllStringSubmatch(plan, -1) {
			rows, _ := strconv.Atoi(m[1])
			loops, _ := strconv.Atoi(m[2])
			require.LessOrEqual(t, rows*loops, 4*PageSize, "%s: a node read %s rows %s times:\n%s", page.name, m[1], m[2], plan)
		}
	}

	// The same rows, in the same order, as searchSQL pages them: three
	// sources at the same positions, several seqs per transaction, a
	// time range, across page boundaries.
	_, err = pool.Exec(ctx, `
		INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row, identity, correlation_id, xid, commit_lsn, commit_time, seq, columns)
		SELECT s, 'public', 'mix', jsonb_build_object('id', g, 'q', q), '{}', 'full', s || ':' || g || ':3/' || to_hex(g), g,
		       ('3/' || to_hex(g))::pg_lsn, now() - (g % 40) * interval '1 hour', q, '[]'
		FROM generate_series(1, 120) g, generate_series(0, 2) q, unnest(ARRAY['a', 'b', 'main']) s
		WHERE (g + q) % 4 <> 0`)
	require.NoError(t, err)
	pages := func(query string, since string) []string {
		var out []string
		d := &searchData{Table: "public.mix", Since: since}
		cursor := ""
		for n := 0; ; n++ {
			require.Less(t, n, 100)
			a, err := parseSearch(d, cursor)
			require.NoError(t, err)
			rows, err := pool.Query(ctx, query, a.schema, a.table, a.key, a.since, a.until, a.corr, a.lsn, a.seq, PageSize+1, a.source)
			require.NoError(t, err)
			got, err := scanRows(rows)
			require.NoError(t, err)
			if len(got) > PageSize {
				got = got[:PageSize]
				last := got[PageSize-1]
				cursor = encodeCursor(last.CommitLSN, last.Seq, last.Source)
			} else {
				cursor = ""
			}
			for _, r := range got {
				out = append(out, r.Source+" "+string(r.Key))
			}
			if cursor == "" {
				return out
			}
		}
	}
	for _, since := range []string{"", time.Now().Add(-20 * time.Hour).UTC().Format(time.RFC3339)} {
		want := pages(searchSQL, since)
		require.NotEmpty(t, want)
		require.Equal(t, want, pages(tableSearchSQL, since), "since %q", since)
	}
}
