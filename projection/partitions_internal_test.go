package projection

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/archive"
)

// legacyRowsDDL is the rows table as releases before partitioning created
// it: one table, its primary key (source, commit_lsn, seq).
const legacyRowsDDL = `CREATE SCHEMA %[1]s;
CREATE TABLE %[1]s.rows (source text NOT NULL, schema_name text NOT NULL, table_name text NOT NULL, key jsonb, row jsonb,
    identity text, correlation_id text NOT NULL, is_root boolean, xid bigint, commit_lsn pg_lsn NOT NULL, commit_time timestamptz,
    seq integer NOT NULL, archived_at timestamptz NOT NULL DEFAULT now(), expires_at timestamptz, refs jsonb, columns jsonb,
    PRIMARY KEY (source, commit_lsn, seq));
CREATE INDEX rows_expires_at_idx ON %[1]s.rows (expires_at) WHERE expires_at IS NOT NULL;`

// An event applied twice is archived once, in a partitioned archive (its
// key includes commit_time) as in an unpartitioned one from an earlier
// release; rows go to the partition of their commit_time, rows no
// partition covers (older, or without a commit time) to the default one,
// and a partition made later takes its rows out of the default.
func TestPartitionedInsertIsIdempotent(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, testenv.NewDatabase(t))
	require.NoError(t, err)
	defer pool.Close()
	require.NoError(t, migrations.Apply(ctx, pool))
	part, legacy := archive.Schema(1), archive.Schema(2)
	_, err = pool.Exec(ctx, archive.DDL(part))
	require.NoError(t, err)
	_, err = pool.Exec(ctx, fmt.Sprintf(legacyRowsDDL, archive.Ident(legacy))+archive.DDL(legacy))
	require.NoError(t, err)

	nov := time.Date(2026, 11, 14, 12, 0, 0, 0, time.UTC)
	old := time.Date(2020, 1, 3, 0, 0, 0, 0, time.UTC)
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	made, err := archive.EnsurePartitions(ctx, tx, part, archive.PeriodMonth, nov)
	require.NoError(t, err)
	require.Equal(t, []time.Time{time.Date(2026, 11, 1, 0, 0, 0, 0, time.UTC)}, made)
	none, err := archive.EnsurePartitions(ctx, tx, legacy, archive.PeriodMonth, nov)
	require.NoError(t, err)
	require.Empty(t, none, "an unpartitioned table gets no partitions")
	require.NoError(t, tx.Commit(ctx))

	row := func(lsn event.LSN, seq int, at time.Time) *archiveRow {
		ev := &event.Event{Op: event.OpDelete, Source: "main", Schema: "public", Table: "docs", Identity: event.IdentityFull,
			XID: int64(lsn), CommitLSN: lsn, CommitTime: at, Seq: seq, Key: []byte(fmt.Sprintf(`{"id":%d}`, int(lsn)*10+seq))}
		return &archiveRow{ev: ev, row: []byte(fmt.Sprintf(`{"id":%d}`, int(lsn)*10+seq))}
	}
	page := []*archiveRow{row(1, 0, nov), row(1, 1, nov), row(2, 0, old), row(3, 0, time.Time{})}
	for _, schema := range []string{part, legacy} {
		for attempt := range 2 {
			tx, err := pool.Begin(ctx)
			require.NoError(t, err)
			got, _, err := insertRowsCounted(ctx, tx, schema, page)
			require.NoError(t, err)
			require.NoError(t, tx.Commit(ctx))
			n := 0
			for _, g := range got {
				n += g.Rows
			}
			if attempt == 0 {
				require.Equal(t, 4, n, "%s: first apply", schema)
			} else {
				require.Zero(t, n, "%s: the same events applied again insert nothing", schema)
			}
		}
		require.Equal(t, 4, countRows(t, pool, `SELECT count(*) FROM `+archive.Ident(schema, "rows")), schema)
	}
	where := func(schema string) map[string]string {
		rows, err := pool.Query(ctx, `SELECT commit_lsn::text || '/' || seq, tableoid::regclass::text FROM `+archive.Ident(schema, "rows"))
		require.NoError(t, err)
		out := map[string]string{}
		for rows.Next() {
			var k, v string
			require.NoError(t, rows.Scan(&k, &v))
			out[k] = v
		}
		require.NoError(t, rows.Err())
		return out
	}
	require.Equal(t, map[string]string{"0/1/0": "archive_v1.rows_p20261101", "0/1/1": "archive_v1.rows_p20261101",
		"0/2/0": "archive_v1.rows_default", "0/3/0": "archive_v1.rows_default"}, where(part))
	require.Equal(t, map[string]string{"0/1/0": "archive_v2.rows", "0/1/1": "archive_v2.rows",
		"0/2/0": "archive_v2.rows", "0/3/0": "archive_v2.rows"}, where(legacy))

	// January 2020's partition, made now, takes its row out of the default.
	tx, err = pool.Begin(ctx)
	require.NoError(t, err)
	_, err = archive.EnsurePartitions(ctx, tx, part, archive.PeriodMonth, old)
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, "archive_v1.rows_p20200101", where(part)["0/2/0"])
	require.Equal(t, 4, countRows(t, pool, `SELECT count(*) FROM `+archive.Ident(part, "rows")))
	// ... and the key still holds there: applied again, nothing is added.
	tx, err = pool.Begin(ctx)
	require.NoError(t, err)
	got, _, err := insertRowsCounted(ctx, tx, part, page)
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	require.Empty(t, got)
	require.Equal(t, 4, countRows(t, pool, `SELECT count(*) FROM `+archive.Ident(part, "rows")))
	ps, err := archive.Partitions(ctx, pool, part)
	require.NoError(t, err)
	var names []string
	for _, p := range ps {
		names = append(names, p.Name)
	}
	require.Equal(t, []string{"rows_p20200101", "rows_p20261101", archive.DefaultPartition}, names)
	// Every index of the table exists in each partition.
	require.Equal(t, 3*6, countRows(t, pool, `SELECT count(*) FROM pg_index x JOIN pg_inherits i ON i.inhrelid = x.indrelid
		WHERE i.inhparent = to_regclass('archive_v1.rows')`))
}

func countRows(t *testing.T, pool *pgxpool.Pool, sql string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, pool.QueryRow(context.Background(), sql, args...).Scan(&n))
	return n
}
