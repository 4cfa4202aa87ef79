package capture

import (
	"context"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// TestRefusalNamesEveryPublicationOptionOn18: a capture role that does not
// own the publication is refused, with the publication its owner should
// make. On PostgreSQL 18 the capture also needs publish_generated_columns =
// stored, so the refusal names it: before, a DBA who made the publication
// as told was refused again with the same words.
func TestRefusalNamesEveryPublicationOptionOn18(t *testing.T) {
	t.Parallel()
	e := setup(t)
	if queryString(t, e.db, `SELECT (current_setting('server_version_num')::int >= 180000)::text`) != "true" {
		t.Skip("publish_generated_columns is PostgreSQL 18+")
	}
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
	testenv.Exec(t, pg.UserURL(app, db), `CREATE TABLE g (id int PRIMARY KEY, v text, d int GENERATED ALWAYS AS (id * 2) STORED);
		ALTER TABLE g REPLICA IDENTITY FULL; INSERT INTO g (id, v) VALUES (1, 'a')`)
	e.exec(t, `CREATE PUBLICATION epitaph FOR TABLE ONLY g WITH (publish = 'delete, truncate', publish_via_partition_root = true)`)
	err := e.startErr(t, func(c *Config) { c.SourceURL = pg.UserURL(capRole, db) })
	require.ErrorContains(t, err, "WITH (publish = 'delete, truncate', publish_via_partition_root = true, publish_generated_columns = stored)")

	// Made as the refusal says: accepted.
	e.exec(t, `DROP PUBLICATION epitaph;
		CREATE PUBLICATION epitaph FOR TABLE ONLY g WITH (publish = 'delete, truncate', publish_via_partition_root = true, publish_generated_columns = stored)`)
	var logs lockedBuffer
	cfg := e.config()
	cfg.SourceURL = pg.UserURL(capRole, db)
	svc, err := New(cfg, WithLogger(slog.New(slog.NewTextHandler(io.MultiWriter(&logs, testLogWriter{t}), nil))))
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, svc.Stop(context.Background())) })
	require.NoError(t, svc.Start(context.Background()))
	e.exec(t, `DELETE FROM g`)
	ms := e.deletes(t, "main", 1)
	require.JSONEq(t, `{"id":1,"v":"a","d":2}`, string(ms[0].ev.Row))
}

// TestVirtualGeneratedColumnNeverMadeFullOn18: PostgreSQL 18 refuses the
// DELETEs of a published table whose REPLICA IDENTITY FULL holds a virtual
// generated column (no publication can send one). The capture neither
// sets such a table FULL (--set-replica-identity-full is refused naming
// it) nor publishes it when it is FULL already, so the application's
// DELETEs keep working. Before, it set it FULL and every DELETE failed.
func TestVirtualGeneratedColumnNeverMadeFullOn18(t *testing.T) {
	t.Parallel()
	e := setup(t)
	if queryString(t, e.db, `SELECT (current_setting('server_version_num')::int >= 180000)::text`) != "true" {
		t.Skip("virtual generated columns are PostgreSQL 18+")
	}
	e.exec(t, `CREATE TABLE gv (id int PRIMARY KEY, v text, d int GENERATED ALWAYS AS (id * 2) VIRTUAL);
		CREATE TABLE plain (id int PRIMARY KEY, v text);
		INSERT INTO gv (id, v) VALUES (1, 'a'), (2, 'b'), (3, 'c'); INSERT INTO plain VALUES (1, 'p')`)
	err := e.startErr(t, func(c *Config) { c.SetReplicaIdentityFull = true })
	require.ErrorContains(t, err, "public.gv")
	require.ErrorContains(t, err, "virtual generated column")
	require.Equal(t, "d", queryString(t, e.db, `SELECT relreplident::text FROM pg_class WHERE relname = 'gv'`), "left as it was")
	e.exec(t, `DELETE FROM gv WHERE id = 1`)

	// Made FULL by hand: not published, its DELETEs keep working.
	e.exec(t, `ALTER TABLE gv REPLICA IDENTITY FULL; ALTER TABLE plain REPLICA IDENTITY FULL`)
	svc := e.start(t, nil)
	require.Equal(t, []string{"public.plain"}, svc.CurrentStatus().PublicationTables)
	require.Contains(t, strings.Join(svc.CurrentStatus().SkippedTables, "\n"), "public.gv: no usable replica identity: REPLICA IDENTITY FULL with a virtual generated column")
	e.exec(t, `DELETE FROM gv WHERE id = 2; DELETE FROM plain`)
	ms := e.deletes(t, "main", 1)
	require.Equal(t, []string{"delete public.plain"}, ops(ms))
}

// TestAnotherPublicationWithoutGeneratedColumnsKeepsATableFromFullOn18:
// another publication publishes a table with a stored generated column,
// without publish_generated_columns (its default). Made REPLICA IDENTITY
// FULL, the table's DELETEs would fail on PostgreSQL 18, so
// --set-replica-identity-full refuses it, naming the publication, as it
// does for a column list; the table is left as it was and its DELETEs work.
func TestAnotherPublicationWithoutGeneratedColumnsKeepsATableFromFullOn18(t *testing.T) {
	t.Parallel()
	e := setup(t)
	if queryString(t, e.db, `SELECT (current_setting('server_version_num')::int >= 180000)::text`) != "true" {
		t.Skip("publish_generated_columns is PostgreSQL 18+")
	}
	e.exec(t, `CREATE TABLE gs (id int PRIMARY KEY, v text, d int GENERATED ALWAYS AS (id * 2) STORED);
		INSERT INTO gs (id, v) VALUES (1, 'a'), (2, 'b');
		CREATE PUBLICATION replica_feed FOR TABLE gs`)
	err := e.startErr(t, func(c *Config) { c.SetReplicaIdentityFull = true })
	require.ErrorContains(t, err, `publication replica_feed publishes public.gs without its stored generated columns`)
	require.Equal(t, "d", queryString(t, e.db, `SELECT relreplident::text FROM pg_class WHERE relname = 'gs'`))
	e.exec(t, `DELETE FROM gs WHERE id = 1`)

	// Once that publication sends them, the table is made FULL and captured whole.
	e.exec(t, `ALTER PUBLICATION replica_feed SET (publish_generated_columns = stored)`)
	e.start(t, func(c *Config) { c.SetReplicaIdentityFull = true })
	e.exec(t, `DELETE FROM gs WHERE id = 2`)
	ms := e.deletes(t, "main", 1)
	require.JSONEq(t, `{"id":2,"v":"b","d":4}`, string(ms[0].ev.Row))
}

// TestInlineGuardNeverMakesAVirtualGeneratedColumnsTableFull: the inline
// DDL guard acts in the application's DDL transaction. Setting a new
// table with a virtual generated column REPLICA IDENTITY FULL
// (--set-replica-identity-full) would make every DELETE of the
// application on it fail once it is published (no publication sends a
// virtual column): it leaves the table as it is and publishes it by its
// key, so its DELETEs work and are captured.
func TestInlineGuardNeverMakesAVirtualGeneratedColumnsTableFull(t *testing.T) {
	t.Parallel()
	e := setup(t)
	if queryString(t, e.db, `SELECT (current_setting('server_version_num')::int >= 180000)::text`) != "true" {
		t.Skip("virtual generated columns are PostgreSQL 18+")
	}
	e.start(t, func(c *Config) {
		c.InstallDDLGuard, c.DDLGuardMode, c.CatalogPoll = true, DDLGuardInline, -1
		c.SetReplicaIdentityFull = true
	})
	app, _ := e.connect(t)
	timedExec(t, app, 5*time.Second, `CREATE TABLE gvi (id int PRIMARY KEY, v text, d int GENERATED ALWAYS AS (id * 2) VIRTUAL)`)
	require.Equal(t, "d", queryString(t, e.db, `SELECT relreplident::text FROM pg_class WHERE relname = 'gvi'`), "left as it was")
	timedExec(t, app, 5*time.Second, `INSERT INTO gvi (id, v) VALUES (1, 'a'), (2, 'b')`)
	timedExec(t, app, 5*time.Second, `DELETE FROM gvi WHERE id = 1`)
	ms := e.deletes(t, "main", 1)
	require.Equal(t, []string{"delete public.gvi"}, ops(ms))

	// A virtual column added to a published FULL table: the guard takes
	// the table out of the publication (a gap), so its DELETEs still work.
	timedExec(t, app, 5*time.Second, `CREATE TABLE gvf (id int PRIMARY KEY, v text); INSERT INTO gvf VALUES (1, 'a'), (2, 'b')`)
	require.Equal(t, "f", queryString(t, e.db, `SELECT relreplident::text FROM pg_class WHERE relname = 'gvf'`))
	timedExec(t, app, 5*time.Second, `ALTER TABLE gvf ADD COLUMN d int GENERATED ALWAYS AS (id * 2) VIRTUAL`)
	timedExec(t, app, 5*time.Second, `DELETE FROM gvf WHERE id = 1`)
}
