package projection_test

import (
	"context"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// TestTargetRoleRecipe is the README's recipe for the roles on the target:
// the projector's role needs only CREATE on the database; readers need
// USAGE on archive, SELECT on its views and the default privileges that
// keep that grant on views a promotion re-creates, and nothing on
// archive_v<N>.
func TestTargetRoleRecipe(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	admin := testenv.NewDatabase(t)
	u, err := url.Parse(admin)
	require.NoError(t, err)
	db := strings.TrimPrefix(u.Path, "/")
	pg := testenv.SharedPostgres(t)
	proj, reader := db+"_projector", db+"_reader"
	testenv.Exec(t, admin, `CREATE ROLE `+proj+` LOGIN; GRANT CREATE ON DATABASE `+db+` TO `+proj+`; CREATE ROLE `+reader+` LOGIN`)
	t.Cleanup(func() { testenv.Exec(t, pg.URL("postgres"), `DROP OWNED BY `+proj+`, `+reader+` CASCADE`) })

	e := newEnvWith(t, pg.UserURL(proj, db), 2)
	e.start(e.config("w1"))
	for i := 0; i < 3; i++ {
		e.publish(e.nextTx(orderRows(i+1, 1)...))
	}
	c := e.conn()
	eventually(t, 30*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 6 })

	testenv.Exec(t, admin, `GRANT USAGE ON SCHEMA archive TO `+reader+`;
		GRANT SELECT ON ALL TABLES IN SCHEMA archive TO `+reader+`;
		ALTER DEFAULT PRIVILEGES FOR ROLE `+proj+` IN SCHEMA archive GRANT SELECT ON TABLES TO `+reader)
	rc, err := pgx.Connect(ctx, pg.UserURL(reader, db))
	require.NoError(t, err)
	defer rc.Close(ctx)
	require.Equal(t, 6, count(t, rc, `SELECT count(*) FROM archive.rows`))
	require.Equal(t, 1, count(t, rc, `SELECT count(*) FROM archive.status WHERE version = 1`))
	_, err = rc.Exec(ctx, `SELECT 1 FROM archive_v1.rows LIMIT 1`)
	require.ErrorContains(t, err, "permission denied", "readers read the views, not the version tables")

	// A rebuilt version promoted: the reader still reads.
	pool := e.pool()
	v, err := version.CreateVersion(ctx, pool, e.js, version.RebuildOptions{Source: src})
	require.NoError(t, err)
	e.heartbeat()
	eventually(t, 60*time.Second, func() bool { return state(t, pool, v.Version) == version.StateReady })
	_, err = version.Promote(ctx, pool, archive.Projection, v.Version, false)
	require.NoError(t, err)
	require.Equal(t, 6, count(t, rc, `SELECT count(*) FROM archive.rows`))
	require.Equal(t, 1, count(t, rc, `SELECT count(*) FROM archive.status WHERE version = 2 AND state = 'live'`))
}
