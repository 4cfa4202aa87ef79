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

	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/archive"
)

// legacyRowsDDL is the rows table as releases before partitioning made it.
const legacyRowsDDL = `CREATE SCHEMA %[1]s;
CREATE TABLE %[1]s.rows (source text NOT NULL, schema_name text NOT NULL, table_name text NOT NULL, key jsonb, row jsonb,
    identity text, correlation_id text NOT NULL, is_root boolean, xid bigint, commit_lsn pg_lsn NOT NULL, commit_time timestamptz,
    seq integer NOT NULL, archived_at timestamptz NOT NULL DEFAULT now(), expires_at timestamptz, refs jsonb, columns jsonb,
    PRIMARY KEY (source, commit_lsn, seq));
CREATE INDEX rows_expires_at_idx ON %[1]s.rows (expires_at) WHERE expires_at IS NOT NULL;`

// Three expired months: August's partition is dropped whole (with its
// rows' terminal delivery); September's has a held row and October's a
// row with an open delivery, so both stay and only their free rows are
// deleted, row by row. An unpartitioned version of an earlier release
// beside it is cleaned row by row as before.
func TestCleanupDropsExpiredPartitions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, testenv.NewDatabase(t))
	require.NoError(t, err)
	defer pool.Close()
	require.NoError(t, migrations.Apply(ctx, pool))
	_, err = pool.Exec(ctx, archive.DDL("archive_v1")+fmt.Sprintf(legacyRowsDDL, "archive_v2")+archive.DDL("archive_v2")+`
		INSERT INTO epitaph.projection_versions (projection, version, state, schema_name, partitions)
		VALUES ('archive', 1, 'live', 'archive_v1', 1), ('archive', 2, 'ready', 'archive_v2', 1)`)
	require.NoError(t, err)
	months := []time.Time{time.Date(2026, 8, 10, 0, 0, 0, 0, time.UTC), time.Date(2026, 9, 10, 0, 0, 0, 0, time.UTC),
		time.Date(2026, 10, 10, 0, 0, 0, 0, time.UTC)}
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := archive.EnsurePartitions(ctx, tx, "archive_v1", archive.PeriodMonth, months...)
		return err
	}))
	// Ten rows a month, one transaction a month (LSN m/0, seq 0-9), all
	// expired yesterday; in both versions.
	for _, schema := range []string{"archive_v1", "archive_v2"} {
		for m, at := range months {
			_, err := pool.Exec(ctx, `INSERT INTO `+schema+`.rows (source, schema_name, table_name, key, row, correlation_id,
				commit_lsn, commit_time, seq, expires_at)
				SELECT 'main', 'public', 'sessions', jsonb_build_object('id', $1::int * 100 + s), jsonb_build_object('id', $1::int * 100 + s),
				       'c' || $1::int, ($1::int + 1 || '/0')::pg_lsn, $2, s, now() - interval '1 day'
				FROM generate_series(0, 9) s`, m+1, at)
			require.NoError(t, err)
		}
	}
	_, err = pool.Exec(ctx, `
		INSERT INTO epitaph.legal_holds (schema_name, table_name, key, reason, created_by) VALUES ('public', 'sessions', '{"id":203}', 'litigation', 'tester');
		INSERT INTO epitaph.deliveries (id, handler_id, source, commit_lsn, seq, schema_name, table_name, key, correlation_id, version, state)
		VALUES (gen_random_uuid(), gen_random_uuid(), 'main', '3/0', 0, 'public', 'sessions', '{}', 'c1', 1, 'done'),
		       (gen_random_uuid(), gen_random_uuid(), 'main', '4/0', 7, 'public', 'sessions', '{}', 'c3', 1, 'pending')`)
	require.NoError(t, err)
	// The done delivery's row (August's seq 0) is also in version 2: it
	// stays until no version holds its row.
	_, err = pool.Exec(ctx, `DELETE FROM archive_v2.rows WHERE commit_lsn = '2/0' AND seq = 0`)
	require.NoError(t, err)

	res, err := CleanupBatch(ctx, pool, CleanupOptions{Batch: 1000})
	require.NoError(t, err)
	require.Equal(t, []string{"archive_v1.rows_p20260801"}, res.Dropped)
	require.Equal(t, 1, res.Deliveries, "the dropped row's done delivery (version 2 no longer has the row)")

	rows, err := pool.Query(ctx, `SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
		WHERE i.inhparent = 'archive_v1.rows'::regclass`)
	require.NoError(t, err)
	parts, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	slices.Sort(parts)
	require.Equal(t, []string{"rows_default", "rows_p20260901", "rows_p20261001"}, parts, "August's partition is gone")

	left := func(schema string) []string {
		rows, err := pool.Query(ctx, `SELECT tableoid::regclass::text || ':' || (key->>'id') FROM `+schema+`.rows ORDER BY key->>'id'`)
		require.NoError(t, err)
		out, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		return out
	}
	require.Equal(t, []string{"archive_v1.rows_p20260901:203", "archive_v1.rows_p20261001:307"}, left("archive_v1"),
		"the held row and the row with an open delivery, nothing else")
	require.Equal(t, []string{"archive_v2.rows:203", "archive_v2.rows:307"}, left("archive_v2"),
		"the unpartitioned version: the same rows left, deleted row by row")
	require.Equal(t, 10+9+9, res.ByVersion["archive_v1"])
	require.Equal(t, 9+9+9, res.ByVersion["archive_v2"])
	require.Equal(t, 10+9+9+9+9+9, res.Deleted)
}
