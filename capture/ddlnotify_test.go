package capture

import (
	"context"
	"fmt"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// Tests of the notify DDL guard: it only signals the capture, which
// publishes a new table at once instead of at the next catalog poll.

// notifyGuard installs the notify guard with a catalog poll of an hour:
// only the guard's signal can publish a table within the tests' bounds.
func notifyGuard(c *Config) {
	c.InstallDDLGuard = true
	c.DDLGuardMode = DDLGuardNotify
	c.CatalogPoll = time.Hour
}

// setupNoTwoPhase is setup on a private server without prepared
// transactions (max_prepared_transactions = 0, PostgreSQL's default),
// where the guard signals with NOTIFY.
func setupNoTwoPhase(t *testing.T) *env {
	t.Helper()
	pg := testenv.NewPostgres(t)
	require.NoError(t, pg.SetConfig("max_prepared_transactions = 0"))
	require.NoError(t, pg.Restart())
	e := &env{db: pg.NewDatabase(t), nats: testenv.NewNATS(t), dir: t.TempDir()}
	e.slot = dbName(t, e.db)
	_, e.js = e.nats.Connect(t)
	require.Equal(t, "0", queryString(t, e.db, `SHOW max_prepared_transactions`))
	return e
}

// waitPublished waits at most bound for table to be in the capture's
// publication and returns how long it took.
func (e *env) waitPublished(t *testing.T, table string, bound time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	for {
		got, err := publicationTablesOf(e.db, e.slotPub())
		require.NoError(t, err)
		if slices.Contains(got, table) {
			return time.Since(start)
		}
		if time.Since(start) > bound {
			// What the source's sessions were doing, to tell a lock or a
			// dead connection from a missed signal.
			activity := queryString(t, e.db, `SELECT coalesce(string_agg(format('%s %s %s/%s xact=%s: %s', pid, state, wait_event_type, wait_event,
				now() - xact_start, left(query, 60)), E'\n'), '') FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()`)
			t.Fatalf("%s not in the publication after %s (it holds %v); sessions:\n%s\nthe capture's goroutines:\n%s", table, bound, got, activity, captureStacks())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// captureStacks is the stacks of this process's goroutines that run the
// capture's code (where a catalog check waits, if it does).
func captureStacks() string {
	buf := make([]byte, 8<<20)
	buf = buf[:runtime.Stack(buf, true)]
	var out []string
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, "epitaph/capture.(*Service)") {
			out = append(out, g)
		}
	}
	return strings.Join(out, "\n\n")
}

// listenPID is the backend of the capture's LISTEN, once it is there
// (found by its last query: within ddlListenQuiet of the LISTEN, before
// its first ping).
func (e *env) listenPID(t *testing.T, not int) int {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		pid, err := strconv.Atoi(queryString(t, e.db, `SELECT coalesce(max(pid), 0)::text FROM pg_stat_activity
			WHERE datname = current_database() AND query LIKE 'LISTEN %' AND pid <> $1`, not))
		require.NoError(t, err)
		if pid != 0 {
			return pid
		}
		require.True(t, time.Now().Before(deadline), "no LISTEN session of the capture")
		time.Sleep(20 * time.Millisecond)
	}
}

// requireFreshDeletes checks that the stream holds exactly the deletes of
// keys from table, in order, and no gap.
func (e *env) requireFreshDeletes(t *testing.T, table string, keys ...int) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	got := deletesOf(e.messages(t, "main", 0), table)
	for len(got) < len(keys) && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
		got = deletesOf(e.messages(t, "main", 0), table)
	}
	require.Len(t, got, len(keys))
	for i, k := range keys {
		require.JSONEq(t, fmt.Sprintf(`{"id":%d}`, k), string(got[i].Key))
		require.JSONEq(t, fmt.Sprintf(`{"id":%d,"v":"r%d"}`, k, k), string(got[i].Row))
	}
	require.Empty(t, gapsOf(e.messages(t, "main", 0)))
}

// TestDDLGuardNotifyPublishesPromptly: with the notify guard and a catalog
// poll of an hour, a keyed table the application creates is in the
// publication within 2 s and its deletes from then on are captured. The
// LISTEN session killed, the capture reconnects it (reporting it down
// meanwhile) and a table created later is published as promptly.
func TestDDLGuardNotifyPublishesPromptly(t *testing.T) {
	t.Parallel()
	e := setupNoTwoPhase(t)
	svc := e.start(t, notifyGuard)
	require.Equal(t, DDLGuardNotify, svc.CurrentStatus().DDLGuard)
	pid := e.listenPID(t, 0)

	e.exec(t, `CREATE TABLE fresh (id int PRIMARY KEY, v text); ALTER TABLE fresh REPLICA IDENTITY FULL`)
	took := e.waitPublished(t, "fresh", 2*time.Second)
	t.Logf("published %s after the CREATE TABLE committed", took)
	e.exec(t, `INSERT INTO fresh SELECT g, 'r' || g FROM generate_series(1, 3) g`)
	e.exec(t, `DELETE FROM fresh WHERE id = 1; DELETE FROM fresh WHERE id = 3`)
	e.requireFreshDeletes(t, "public.fresh", 1, 3)
	up := svc.CurrentStatus().DDLListenUp
	require.NotNil(t, up)
	require.True(t, *up)

	// The LISTEN session killed: reconnected, and the next table is
	// published as promptly.
	e.exec(t, `SELECT pg_terminate_backend($1)`, pid)
	e.listenPID(t, pid)
	time.Sleep(300 * time.Millisecond) // the reconnect's own catalog check is done
	e.exec(t, `CREATE TABLE later (id int PRIMARY KEY, v text); ALTER TABLE later REPLICA IDENTITY FULL`)
	took = e.waitPublished(t, "later", 2*time.Second)
	t.Logf("after the reconnect: published %s after the CREATE TABLE committed", took)
	e.exec(t, `INSERT INTO later VALUES (7, 'r7'); DELETE FROM later`)
	e.requireFreshDeletes(t, "public.later", 7)
}

// TestDDLGuardNotifyWithPreparedTransactions: on a server with prepared
// transactions the notify guard writes a logical message instead of a
// notification (a transaction that ran NOTIFY cannot be prepared): a
// prepared transaction creating a table neither fails nor waits, and the
// table is published within 2 s of its COMMIT PREPARED, as one created
// outside such a transaction is of its commit.
func TestDDLGuardNotifyWithPreparedTransactions(t *testing.T) {
	t.Parallel()
	e := setup(t)
	require.NotEqual(t, "0", queryString(t, e.db, `SHOW max_prepared_transactions`))
	e.start(t, notifyGuard)
	e.exec(t, `CREATE TABLE fresh (id int PRIMARY KEY, v text); ALTER TABLE fresh REPLICA IDENTITY FULL`)
	e.waitPublished(t, "fresh", 2*time.Second)

	app, warnings := e.connect(t)
	timedExec(t, app, 5*time.Second, `BEGIN; CREATE TABLE held (id int PRIMARY KEY, v text);
		ALTER TABLE held REPLICA IDENTITY FULL; PREPARE TRANSACTION 'notify_held'`)
	t.Cleanup(func() { _, _ = app.Exec(context.Background(), `ROLLBACK PREPARED 'notify_held'`) })
	require.Empty(t, warnings())
	timedExec(t, app, 5*time.Second, `COMMIT PREPARED 'notify_held'`)
	e.waitPublished(t, "held", 2*time.Second)
	e.exec(t, `INSERT INTO held VALUES (4, 'r4'); DELETE FROM held`)
	e.requireFreshDeletes(t, "public.held", 4)
}

// TestDDLGuardModeSwitchReplacesTheOther: installing one mode replaces
// the other's event trigger and function (one of each per publication),
// and capture uninstall removes either.
func TestDDLGuardModeSwitchReplacesTheOther(t *testing.T) {
	t.Parallel()
	db := testenv.NewDatabase(t)
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, db)
	require.NoError(t, err)
	defer pool.Close()
	_, err = pool.Exec(ctx, `CREATE PUBLICATION sw`)
	require.NoError(t, err)
	installed := func() (triggers []string, source string) {
		t.Helper()
		rows, err := pool.Query(ctx, `SELECT evtname || ':' || evtfoid::regproc::text FROM pg_event_trigger ORDER BY 1`)
		require.NoError(t, err)
		triggers, err = pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		err = pool.QueryRow(ctx, `SELECT coalesce(string_agg(prosrc, ''), '') FROM pg_proc p
			JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = 'epitaph'`).Scan(&source)
		require.NoError(t, err)
		return triggers, source
	}
	for _, mode := range []string{DDLGuardInline, DDLGuardNotify, DDLGuardInline, DDLGuardNotify} {
		require.NoError(t, InstallDDLGuard(ctx, pool, &Config{PublicationName: "sw", DDLGuardMode: mode}))
		triggers, source := installed()
		require.Equal(t, []string{"epitaph_ddl_guard_sw:epitaph.ddl_guard_sw"}, triggers, mode)
		require.Equal(t, mode == DDLGuardNotify, strings.Contains(source, "pg_notify"), mode)
		require.Equal(t, mode == DDLGuardInline, strings.Contains(source, "ALTER PUBLICATION"), mode)
	}
	err = InstallDDLGuard(ctx, pool, &Config{PublicationName: "sw", DDLGuardMode: "later"})
	var ce *ConfigError
	require.ErrorAs(t, err, &ce)
	require.Contains(t, err.Error(), `"later"`)
	_, err = New(Config{SourceURL: db, DataDir: t.TempDir(), DDLGuardMode: "later"})
	require.ErrorAs(t, err, &ce)
	require.Contains(t, err.Error(), `DDL guard mode "later": use notify or inline`)

	plan, err := PlanUninstall(ctx, UninstallConfig{SourceURL: db, PublicationName: "sw", SlotName: "none_here"})
	require.NoError(t, err)
	require.NoError(t, plan.Apply(ctx))
	triggers, source := installed()
	require.Empty(t, triggers)
	require.Empty(t, source)
}

// TestDDLGuardNotifyForAnApplicationRole: DDL run by an application role
// (no superuser, no REPLICATION) goes through the notify guard, whose
// function runs as its owner, and a search_path the application put its
// own functions and operators first in is not followed: the guard calls
// PostgreSQL's, the DDL succeeds and the table is published.
func TestDDLGuardNotifyForAnApplicationRole(t *testing.T) {
	t.Parallel()
	e := setup(t)
	db := dbName(t, e.db)
	pg := testenv.SharedPostgres(t)
	app := db + "_notified"
	e.exec(t, `CREATE ROLE `+app+` LOGIN; GRANT CREATE ON SCHEMA public TO `+app+`; GRANT CREATE ON DATABASE `+db+` TO `+app)
	t.Cleanup(func() { testenv.Exec(t, pg.URL("postgres"), `DROP OWNED BY `+app+` CASCADE`) })
	e.start(t, notifyGuard)
	appURL := pg.UserURL(app, db)
	testenv.Exec(t, appURL, `CREATE SCHEMA trap;
		CREATE FUNCTION trap.current_setting(text) RETURNS text LANGUAGE plpgsql AS $$BEGIN RAISE EXCEPTION 'trap.current_setting called'; END$$;
		CREATE FUNCTION trap.pg_notify(text, text) RETURNS void LANGUAGE plpgsql AS $$BEGIN RAISE EXCEPTION 'trap.pg_notify called'; END$$;
		CREATE FUNCTION trap.pg_logical_emit_message(boolean, text, text) RETURNS pg_lsn LANGUAGE plpgsql AS $$BEGIN RAISE EXCEPTION 'trap.pg_logical_emit_message called'; END$$;
		CREATE FUNCTION trap.texteq(text, text) RETURNS boolean LANGUAGE plpgsql AS $$BEGIN RAISE EXCEPTION 'trap.= called'; END$$;
		CREATE OPERATOR trap.= (LEFTARG = text, RIGHTARG = text, FUNCTION = trap.texteq)`)
	testenv.Exec(t, appURL, `SET search_path = trap, pg_catalog, public;
		CREATE TABLE public.fresh (id int PRIMARY KEY, v text); ALTER TABLE public.fresh REPLICA IDENTITY FULL`)
	e.waitPublished(t, "fresh", 2*time.Second)
	testenv.Exec(t, appURL, `INSERT INTO fresh VALUES (5, 'r5'); DELETE FROM fresh`)
	e.requireFreshDeletes(t, "public.fresh", 5)
}
