package capture

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// TestRDSReplicationRoleIsEnough: on Amazon RDS and Aurora a role gets
// replication by membership in rds_replication (it cannot be given the
// REPLICATION attribute there): the preflight accepts it, and a role with
// neither is refused naming both fixes.
func TestRDSReplicationRoleIsEnough(t *testing.T) {
	t.Parallel()
	pg := testenv.NewPostgres(t) // a cluster of its own: rds_replication is a cluster-wide role
	url := pg.NewDatabase(t)
	db := dbName(t, url)
	rdsUser, plain := db+"_rds", db+"_plain"
	testenv.Exec(t, url, `CREATE ROLE rds_replication; CREATE ROLE `+rdsUser+` LOGIN IN ROLE rds_replication; CREATE ROLE `+plain+` LOGIN`)

	check := func(user string) error {
		pool, err := pgxpool.New(context.Background(), pg.UserURL(user, db))
		require.NoError(t, err)
		defer pool.Close()
		_, err = checkServer(context.Background(), pool)
		return err
	}
	require.NoError(t, check(rdsUser))
	requireFix(t, check(plain), "lacks the REPLICATION privilege", `ALTER ROLE "`+plain+`" WITH REPLICATION`, `GRANT rds_replication TO "`+plain+`"`)
}
