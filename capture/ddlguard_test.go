package capture

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
)

// Tests that the DDL guard never gets in the application's way.

// connect opens one session on the test database, closed at the end;
// warnings lists the WARNING messages the server sent it.
func (e *env) connect(t *testing.T) (conn *pgx.Conn, warnings func() []string) {
	t.Helper()
	cfg, err := pgx.ParseConfig(e.db)
	require.NoError(t, err)
	var mu sync.Mutex
	var got []string
	cfg.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
		if n.Severity == "WARNING" {
			mu.Lock()
			got = append(got, n.Message)
			mu.Unlock()
		}
	}
	conn, err = pgx.ConnectConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	return conn, func() []string {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(got)
	}
}

// prepare leaves sql's transaction prepared (two-phase) under gid; it is
// rolled back when the test ends if it is still there.
func (e *env) prepare(t *testing.T, gid, sql string) {
	t.Helper()
	e.exec(t, "BEGIN; "+sql+"; PREPARE TRANSACTION '"+gid+"'")
	t.Cleanup(func() {
		conn, err := pgx.Connect(context.Background(), e.db)
		if err != nil {
			return
		}
		defer conn.Close(context.Background())
		var n int
		_ = conn.QueryRow(context.Background(), `SELECT count(*) FROM pg_prepared_xacts WHERE gid = $1`, gid).Scan(&n)
		if n > 0 {
			_, _ = conn.Exec(context.Background(), "ROLLBACK PREPARED '"+gid+"'")
		}
	})
}

// timedExec runs sql on conn within bound: it fails the test when the
// statement errs or takes longer.
func timedExec(t *testing.T, conn *pgx.Conn, bound time.Duration, sql string) time.Duration {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), bound)
	defer cancel()
	start := time.Now()
	_, err := conn.Exec(ctx, sql)
	took := time.Since(start)
	require.NoError(t, err, "%s (after %s)", sql, took)
	return took
}

// TestDDLGuardNeverWaitsBehindAPreparedTransaction: a prepared (two-phase)
// transaction that created a table holds the publication until it is
// committed. The application's DDL meanwhile neither fails nor waits,
// the capture keeps streaming, and a table the guard left out is added
// by the catalog poll once it can be, with a gap naming it for the rows
// deleted before.
//
// The notify guard takes no lock the prepared transaction holds: the
// capture publishes fresh at once, so its first delete is captured too.
func TestDDLGuardNeverWaitsBehindAPreparedTransaction(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{DDLGuardInline, DDLGuardNotify} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			neverWaitsBehindAPreparedTransaction(t, mode)
		})
	}
}

func neverWaitsBehindAPreparedTransaction(t *testing.T, mode string) {
	e := setup(t)
	e.exec(t, `CREATE TABLE keep (id int PRIMARY KEY, v text); ALTER TABLE keep REPLICA IDENTITY FULL;
		INSERT INTO keep SELECT g, 'k' FROM generate_series(1, 3) g`)
	e.start(t, func(c *Config) {
		c.InstallDDLGuard = true
		c.DDLGuardMode = mode
		c.CatalogPoll = 100 * time.Millisecond
	})
	e.prepare(t, "held_ddl_"+mode, `CREATE TABLE held (id int PRIMARY KEY, v text); ALTER TABLE held REPLICA IDENTITY FULL`)

	app, warnings := e.connect(t)
	took := timedExec(t, app, 5*time.Second, `CREATE TABLE fresh (id int PRIMARY KEY, v text)`)
	took += timedExec(t, app, 5*time.Second, `ALTER TABLE fresh REPLICA IDENTITY FULL`)
	took += timedExec(t, app, 5*time.Second, `ALTER TABLE keep ADD COLUMN w text`)
	require.Less(t, took, time.Second, "the application's DDL waited")
	require.Empty(t, warnings())
	if mode == DDLGuardNotify {
		e.waitPublished(t, "fresh", 2*time.Second)
	}
	timedExec(t, app, 5*time.Second, `INSERT INTO fresh SELECT g, 'f' FROM generate_series(1, 3) g; DELETE FROM fresh WHERE id = 1`)

	// The capture streams meanwhile, its catalog poll blocked by nothing.
	e.exec(t, `DELETE FROM keep WHERE id = 1`)
	keep := deletesOf(e.deletes(t, "main", 1), "public.keep")
	for deadline := time.Now().Add(60 * time.Second); len(keep) == 0 && time.Now().Before(deadline); {
		time.Sleep(50 * time.Millisecond)
		keep = deletesOf(e.deletes(t, "main", 1), "public.keep")
	}
	require.Len(t, keep, 1)
	pub, err := publicationTablesOf(e.db, e.slotPub())
	require.NoError(t, err)
	// PostgreSQL 15+ locks a publication while changing it, till the end of
	// the transaction; 14 does not, and the guard publishes fresh at once.
	// The notify guard's transaction changes no publication.
	locked := e.serverVersion(t) >= 150000 && mode == DDLGuardInline
	if locked {
		require.NotContains(t, pub, "fresh", "added while the prepared transaction holds the publication")
		// Committed: the poll adds fresh, with a gap for the row deleted
		// before (the statistics it reads have that delete seconds after).
		deadline := time.Now().Add(30 * time.Second)
		for queryString(t, e.db, `SELECT pg_stat_get_tuples_deleted('fresh'::regclass)::text`) != "1" {
			require.True(t, time.Now().Before(deadline), "the delete never reached the statistics")
			time.Sleep(50 * time.Millisecond)
		}
	} else {
		require.Contains(t, pub, "fresh")
	}
	e.exec(t, `COMMIT PREPARED 'held_ddl_`+mode+`'`)
	e.waitPublication(t, e.slotPub(), "fresh", "held", "keep")
	e.exec(t, `DELETE FROM fresh WHERE id = 2; DELETE FROM held`)
	want := []string{`{"id":2,"v":"f"}`}
	if !locked {
		want = []string{`{"id":1,"v":"f"}`, `{"id":2,"v":"f"}`}
	}
	ms := e.messages(t, "main", 0)
	deadline := time.Now().Add(60 * time.Second)
	for len(deletesOf(ms, "public.fresh")) < len(want) && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
		ms = e.messages(t, "main", 0)
	}
	var rows []string
	for _, ev := range deletesOf(ms, "public.fresh") {
		rows = append(rows, string(ev.Row))
	}
	require.Equal(t, want, rows)
	var named []string
	for _, g := range gapsOf(ms) {
		require.Equal(t, event.GapLostUpstream, g.Kind)
		named = append(named, g.QualifiedTable())
	}
	if locked {
		require.Equal(t, []string{"public.fresh"}, slices.Compact(named), "one gap, naming fresh")
	} else {
		require.Empty(t, named)
	}
}

// TestDDLGuardUnderConcurrentMigrations: sessions creating, keying and
// dropping tables at once, each in transactions holding what it created,
// never see an error (a deadlock, a lock timeout) from the guard, and every
// table ends up published.
//
// With the notify guard the catalog poll is an hour: its signals alone
// publish every table.
func TestDDLGuardUnderConcurrentMigrations(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{DDLGuardInline, DDLGuardNotify} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			underConcurrentMigrations(t, mode)
		})
	}
}

func underConcurrentMigrations(t *testing.T, mode string) {
	e := setup(t)
	e.start(t, func(c *Config) {
		c.InstallDDLGuard, c.DDLGuardMode, c.CatalogPoll = true, mode, 100*time.Millisecond
		if mode == DDLGuardNotify {
			c.CatalogPoll = time.Hour
		}
	})
	const sessions, rounds = 4, 8
	errs := make(chan error, sessions)
	for s := range sessions {
		go func() {
			conn, err := pgx.Connect(context.Background(), e.db)
			if err != nil {
				errs <- err
				return
			}
			defer conn.Close(context.Background())
			for r := range rounds {
				name := fmt.Sprintf("m%d_%d", s, r)
				other := fmt.Sprintf("m%d_%d", (s+1)%sessions, r)
				sql := fmt.Sprintf(`BEGIN;
					CREATE TABLE %[1]s (id int, v text);
					ALTER TABLE %[1]s ADD PRIMARY KEY (id);
					SELECT pg_sleep(0.02);
					ALTER TABLE IF EXISTS %[2]s ADD COLUMN IF NOT EXISTS w%[3]d text;
					CREATE TABLE %[1]s_tmp (id int PRIMARY KEY); DROP TABLE %[1]s_tmp;
					COMMIT`, name, other, s)
				if _, err := conn.Exec(context.Background(), sql); err != nil {
					errs <- fmt.Errorf("session %d round %d: %w", s, r, err)
					return
				}
			}
			errs <- nil
		}()
	}
	for range sessions {
		require.NoError(t, <-errs)
	}
	var want []string
	for s := range sessions {
		for r := range rounds {
			want = append(want, fmt.Sprintf("m%d_%d", s, r))
		}
	}
	e.waitPublication(t, e.slotPub(), want...)
}

// TestDDLGuardLeavesTheSessionAsItWas: the guard gives up a lock at once
// only while it changes the publication; the application's lock_timeout,
// set for the session or for its transaction, is what it was after the
// DDL, whether the guard had something to do or not. A replica identity
// index dropped takes its table out of the publication (the inline guard
// says so in a WARNING; with the notify guard the capture does it, right
// after the DDL's commit, with no catalog poll at all).
func TestDDLGuardLeavesTheSessionAsItWas(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{DDLGuardInline, DDLGuardNotify} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			leavesTheSessionAsItWas(t, mode)
		})
	}
}

func leavesTheSessionAsItWas(t *testing.T, mode string) {
	e := setup(t)
	e.start(t, func(c *Config) { c.InstallDDLGuard = true; c.DDLGuardMode = mode; c.CatalogPoll = -1 })
	app, warnings := e.connect(t)
	ctx := context.Background()
	show := func() string {
		var v string
		require.NoError(t, app.QueryRow(ctx, `SHOW lock_timeout`).Scan(&v))
		return v
	}
	timedExec(t, app, 5*time.Second, `SET lock_timeout = '7s'`)
	timedExec(t, app, 5*time.Second, `CREATE TABLE loose (id int, v text)`) // nothing to do
	require.Equal(t, "7s", show())
	timedExec(t, app, 5*time.Second, `CREATE TABLE ri (id int NOT NULL, v text); CREATE UNIQUE INDEX ri_id ON ri (id)`)
	timedExec(t, app, 5*time.Second, `ALTER TABLE ri REPLICA IDENTITY USING INDEX ri_id`) // published
	require.Equal(t, "7s", show())
	e.waitPublication(t, e.slotPub(), "ri")
	require.Empty(t, warnings())

	tx, err := app.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `SET LOCAL lock_timeout = '3s'`)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `CREATE TABLE keyed (id int PRIMARY KEY)`) // published
	require.NoError(t, err)
	var v string
	require.NoError(t, tx.QueryRow(ctx, `SHOW lock_timeout`).Scan(&v))
	require.Equal(t, "3s", v)
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, "7s", show())
	e.waitPublication(t, e.slotPub(), "keyed", "ri")

	timedExec(t, app, 5*time.Second, `DROP INDEX ri_id`) // unsafe: removed, with a gap
	require.Equal(t, "7s", show())
	e.waitPublication(t, e.slotPub(), "keyed")
	if mode == DDLGuardNotify {
		require.Empty(t, warnings())
		return
	}
	require.Len(t, warnings(), 1)
	require.Contains(t, warnings()[0], "public.ri removed from publication")
}

// TestDDLGuardKeepsToTheConfiguredTables: with --tables the guard takes a
// configured table out when it loses its key and back in when it gets one,
// and leaves a table nobody configured alone, however safe. It acts in the
// DDL's transaction: there is no catalog poll here.
func TestDDLGuardKeepsToTheConfiguredTables(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE w (id int PRIMARY KEY, v text)`)
	e.start(t, func(c *Config) {
		c.Tables = []string{"w"}
		c.InstallDDLGuard = true
		c.DDLGuardMode = DDLGuardInline
		c.CatalogPoll = -1
	})
	published := func() []string {
		got, err := publicationTablesOf(e.db, e.slotPub())
		require.NoError(t, err)
		return got
	}
	require.Equal(t, []string{"w"}, published())
	app, warnings := e.connect(t)
	timedExec(t, app, 5*time.Second, `CREATE TABLE other (id int PRIMARY KEY, v text)`)
	require.Equal(t, []string{"w"}, published(), "a table not configured was published")
	timedExec(t, app, 5*time.Second, `ALTER TABLE w DROP CONSTRAINT w_pkey`)
	require.Empty(t, published(), "w lost its key but stayed published")
	require.Len(t, warnings(), 1)
	timedExec(t, app, 5*time.Second, `ALTER TABLE w ADD PRIMARY KEY (id)`)
	require.Equal(t, []string{"w"}, published(), "w got its key back but was not published")
	timedExec(t, app, 5*time.Second, `ALTER TABLE other ADD COLUMN n int`)
	require.Equal(t, []string{"w"}, published())
}

// TestDDLGuardOverhead measures what the guard adds to the application's
// DDL: a loop of CREATE TABLE (with a key: the guard publishes it) and
// DROP TABLE, on a database that already holds a few hundred published
// tables, with the guard's event trigger disabled and enabled in
// alternating rounds. The bound here is generous, for a shared machine;
// the figures of record come from `make bench-ddlguard`.
func TestDDLGuardOverhead(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `DO $$ BEGIN FOR i IN 1..300 LOOP
		EXECUTE format('CREATE TABLE pre%s (id int PRIMARY KEY, v text)', i); END LOOP; END $$`)
	e.start(t, func(c *Config) { c.InstallDDLGuard = true; c.DDLGuardMode = DDLGuardInline; c.CatalogPoll = -1 })
	trigger := pgx.Identifier{guardTriggerName(e.slotPub())}.Sanitize()
	conn, _ := e.connect(t)
	ctx := context.Background()
	const n, rounds = 40, 5
	loop := func(keyed, byHand bool) time.Duration {
		start := time.Now()
		for i := range n {
			def := "(id int PRIMARY KEY, v text)"
			if !keyed {
				def = "(id int, v text)"
			}
			sql := fmt.Sprintf("CREATE TABLE loop%d %s", i, def)
			if byHand {
				sql = fmt.Sprintf("BEGIN; %s; ALTER PUBLICATION %s ADD TABLE ONLY loop%d; COMMIT", sql, e.slotPub(), i)
			}
			_, err := conn.Exec(ctx, sql)
			require.NoError(t, err)
			_, err = conn.Exec(ctx, fmt.Sprintf("DROP TABLE loop%d", i))
			require.NoError(t, err)
		}
		return time.Since(start)
	}
	for _, keyed := range []bool{true, false} {
		var off, on, manual []time.Duration
		for range rounds {
			_, err := conn.Exec(ctx, "ALTER EVENT TRIGGER "+trigger+" DISABLE")
			require.NoError(t, err)
			off = append(off, loop(keyed, false))
			if keyed {
				manual = append(manual, loop(keyed, true))
			}
			_, err = conn.Exec(ctx, "ALTER EVENT TRIGGER "+trigger+" ENABLE")
			require.NoError(t, err)
			on = append(on, loop(keyed, false))
		}
		base, guarded := median(off), median(on)
		kind := "unkeyed (nothing to publish)"
		if keyed {
			kind = "keyed (published by the guard)"
		}
		t.Logf("DDL guard overhead, %s CREATE TABLE + DROP TABLE, %d pairs, median of %d rounds: without %.2f ms/pair, with %.2f ms/pair (%+.0f%%)",
			kind, n, rounds, ms(base)/n, ms(guarded)/n, 100*(ms(guarded)-ms(base))/ms(base))
		if keyed {
			t.Logf("  the same with ALTER PUBLICATION .. ADD TABLE run by hand in the CREATE's transaction, no guard: %.2f ms/pair (%+.0f%%)",
				ms(median(manual))/n, 100*(ms(median(manual))-ms(base))/ms(base))
		}
		// Generous, for a shared machine: the guard before this one took
		// ninety times as long on this catalog.
		require.Less(t, ms(guarded), 5*ms(base)+50, "%s: the guard makes the DDL five times slower", kind)
	}
}

func median(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2]
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
