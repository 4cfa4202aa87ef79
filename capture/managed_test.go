package capture

import (
	"context"
	"io"
	"log/slog"
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

// TestMovesPublicationNotCreatable: a DBA made the publication for a
// capture role without CREATE on the database; the moves publication
// cannot be made. The capture starts all the same (a warning says moved
// rows are archived as deletes, and how to fix it) and captures deletes.
func TestMovesPublicationNotCreatable(t *testing.T) {
	t.Parallel()
	e := setup(t)
	db := dbName(t, e.db)
	pg := testenv.SharedPostgres(t)
	app, capRole := db+"_app", db+"_capture"
	e.exec(t, `CREATE ROLE `+app+` LOGIN;
		GRANT CREATE ON SCHEMA public TO `+app+`;
		CREATE ROLE `+capRole+` LOGIN REPLICATION;
		GRANT `+app+` TO `+capRole)
	t.Cleanup(func() {
		testenv.Exec(t, pg.URL("postgres"), `DROP OWNED BY `+app+`, `+capRole+` CASCADE`)
	})
	testenv.Exec(t, pg.UserURL(app, db), `CREATE TABLE m (id int, region text, PRIMARY KEY (id, region)) PARTITION BY LIST (region);
		CREATE TABLE m_eu PARTITION OF m FOR VALUES IN ('eu');
		ALTER TABLE m REPLICA IDENTITY FULL; ALTER TABLE m_eu REPLICA IDENTITY FULL; INSERT INTO m VALUES (1, 'eu')`)
	// As the capture's refusal asks a DBA to make it (on 18 it publishes
	// stored generated columns too).
	opts := `publish = 'delete, truncate', publish_via_partition_root = true`
	if queryString(t, e.db, `SELECT (current_setting('server_version_num')::int >= 180000)::text`) == "true" {
		opts += `, publish_generated_columns = stored`
	}
	e.exec(t, `CREATE PUBLICATION epitaph FOR TABLE m WITH (`+opts+`)`)
	var logs lockedBuffer
	cfg := e.config()
	cfg.SourceURL = pg.UserURL(capRole, db)
	svc, err := New(cfg, WithLogger(slog.New(slog.NewTextHandler(io.MultiWriter(&logs, testLogWriter{t}), nil))))
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, svc.Stop(context.Background())) })
	require.NoError(t, svc.Start(context.Background()))
	require.Contains(t, logs.String(), `msg="cannot create or change the moves publication: rows an UPDATE moves between partitions are archived as deletes" publication=epitaph_moves`)
	require.Equal(t, "0", queryString(t, e.db, `SELECT count(*)::text FROM pg_publication WHERE pubname = 'epitaph_moves'`))
	e.exec(t, `DELETE FROM m`)
	ms := e.deletes(t, "main", 1)
	require.JSONEq(t, `{"id":1,"region":"eu"}`, string(ms[0].ev.Row))
}
