package migrations_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
)

func TestMain(m *testing.M) { testenv.Main(m) }

func TestApplyTwiceIsIdempotent(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, testenv.NewDatabase(t))
	require.NoError(t, err)
	defer pool.Close()

	before, err := migrations.Applied(ctx, pool)
	require.NoError(t, err)
	require.Empty(t, before)

	all, err := migrations.All()
	require.NoError(t, err)
	require.GreaterOrEqual(t, len(all), 2)
	require.Equal(t, 1, all[0].Version)
	require.Equal(t, "progress", all[0].Name)

	// Concurrent first runs serialize on the advisory lock.
	errs := make(chan error, 3)
	for i := 0; i < 3; i++ {
		go func() { errs <- migrations.Apply(ctx, pool) }()
	}
	for i := 0; i < 3; i++ {
		require.NoError(t, <-errs)
	}
	require.NoError(t, migrations.Apply(ctx, pool))

	applied, err := migrations.Applied(ctx, pool)
	require.NoError(t, err)
	want := make([]int, len(all))
	for i, m := range all {
		want[i] = m.Version
	}
	require.Equal(t, want, applied)

	var n int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM epitaph.schema_migrations`).Scan(&n))
	require.Equal(t, len(all), n)

	// The tables exist with the contract's columns.
	rows, err := pool.Query(ctx, `SELECT table_name || '.' || column_name FROM information_schema.columns
		WHERE table_schema = 'epitaph' AND table_name IN ('progress', 'workers', 'projection_versions')`)
	require.NoError(t, err)
	cols, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	for _, c := range []string{
		"progress.cursor", "progress.last_commit_lsn", "progress.last_seq", "progress.last_msg_id",
		"progress.source_lsn", "progress.attempts", "progress.last_advance_at", "progress.last_failure_category",
		"progress.last_failure_at", "progress.owner", "progress.epoch", "progress.lease_expires_at",
		"workers.worker_id", "workers.heartbeat_at",
		"projection_versions.state", "projection_versions.schema_name", "projection_versions.boundary_seq",
		"projection_versions.boundary_lsn", "projection_versions.config", "projection_versions.created_at",
	} {
		require.Contains(t, cols, c)
	}

	// At most one live version per projection.
	_, err = pool.Exec(ctx, `INSERT INTO epitaph.projection_versions (projection, version, state, schema_name)
		VALUES ('archive', 1, 'live', 'archive_v1'), ('archive', 2, 'building', 'archive_v2')`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `UPDATE epitaph.projection_versions SET state = 'live' WHERE version = 2`)
	require.Error(t, err)
}

// A control schema migrated by a newer binary (a version this one does not
// know) is never migrated by this one; Status names the unknown versions.
func TestNewerSchemaIsRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, testenv.NewDatabase(t))
	require.NoError(t, err)
	defer pool.Close()
	all, err := migrations.All()
	require.NoError(t, err)

	st, err := migrations.Status(ctx, pool)
	require.NoError(t, err)
	require.Empty(t, st.Applied)
	require.Len(t, st.Pending, len(all))
	require.Equal(t, all[len(all)-1].Version, st.Latest)

	require.NoError(t, migrations.Apply(ctx, pool))
	st, err = migrations.Status(ctx, pool)
	require.NoError(t, err)
	require.Len(t, st.Applied, len(all))
	require.Empty(t, st.Pending)
	require.Empty(t, st.Unknown)

	_, err = pool.Exec(ctx, `INSERT INTO epitaph.schema_migrations (version, name) VALUES (9999, 'from_the_future')`)
	require.NoError(t, err)
	err = migrations.Apply(ctx, pool)
	var newer *migrations.NewerSchemaError
	require.ErrorAs(t, err, &newer)
	require.Equal(t, []int{9999}, newer.Unknown)
	require.Contains(t, err.Error(), "newer than this binary")
	st, err = migrations.Status(ctx, pool)
	require.NoError(t, err)
	require.Equal(t, []int{9999}, st.Unknown)
}
