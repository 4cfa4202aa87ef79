package capture

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// TestUninstallAfterAKilledRunDropsTheGuardFunction: uninstall drops the
// DDL guard's event trigger and its function in two statements, each
// committed on its own. A run killed between them leaves the function;
// running uninstall again (what Apply's doc says picks up from there) must
// still drop it, not report "nothing to do" and leave the SECURITY
// DEFINER function on the source for good.
func TestUninstallAfterAKilledRunDropsTheGuardFunction(t *testing.T) {
	t.Parallel()
	db := testenv.NewDatabase(t)
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, db)
	require.NoError(t, err)
	defer pool.Close()
	_, err = pool.Exec(ctx, `CREATE PUBLICATION killed`)
	require.NoError(t, err)
	require.NoError(t, InstallDDLGuard(ctx, pool, &Config{PublicationName: "killed", DDLGuardMode: DDLGuardNotify}))

	plan, err := PlanUninstall(ctx, UninstallConfig{SourceURL: db, PublicationName: "killed", SlotName: "none_here"})
	require.NoError(t, err)
	require.Contains(t, plan.Steps[0], "DROP EVENT TRIGGER")
	// The first run, killed after its first statement committed.
	_, err = pool.Exec(ctx, plan.Steps[0])
	require.NoError(t, err)

	plan, err = PlanUninstall(ctx, UninstallConfig{SourceURL: db, PublicationName: "killed", SlotName: "none_here"})
	require.NoError(t, err)
	require.NoError(t, plan.Apply(ctx))
	var fn *string
	require.NoError(t, pool.QueryRow(ctx, `SELECT to_regprocedure('epitaph.ddl_guard_killed()')::text`).Scan(&fn))
	require.Nil(t, fn, "the second uninstall left the guard's function; its plan was:\n%s", plan)
}
