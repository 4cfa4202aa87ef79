package capture

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// Tests of following the source's schema while streaming.

func fastPoll(c *Config) { c.CatalogPoll = 100 * time.Millisecond }

// waitPublication polls until the capture's publication holds exactly
// want (sorted "schema.table").
func (e *env) waitPublication(t *testing.T, pub string, want ...string) {
	t.Helper()
	slices.Sort(want)
	deadline := time.Now().Add(60 * time.Second)
	for {
		got, err := publicationTablesOf(e.db, pub)
		require.NoError(t, err)
		if slices.Equal(got, want) || (len(got) == 0 && len(want) == 0) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("publication %s holds %v, want %v", pub, got, want)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func publicationTablesOf(dbURL, pub string) ([]string, error) {
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		return nil, err
	}
	defer conn.Close(ctx)
	rows, err := conn.Query(ctx, `SELECT pr.prrelid::regclass::text FROM pg_publication_rel pr JOIN pg_publication p ON p.oid = pr.prpubid WHERE p.pubname = $1 ORDER BY 1`, pub)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// rowsByKey indexes delete events by their table and "id" key value.
func deletesOf(ms []msg, table string) []*event.Event {
	var out []*event.Event
	for _, m := range ms {
		if m.ev.Op == event.OpDelete && m.ev.QualifiedTable() == table {
			out = append(out, m.ev)
		}
	}
	return out
}

func gapsOf(ms []msg) []*event.Event {
	var out []*event.Event
	for _, m := range ms {
		if m.ev.Op == event.OpGap {
			out = append(out, m.ev)
		}
	}
	return out
}

func TestOwnSchemaIsExact(t *testing.T) {
	t.Parallel()
	for s, want := range map[string]bool{
		"epitaph": true, "archive": true, "archive_v1": true, "archive_v12": true,
		"archive_vendors": false, "archive_v": false, "archive_v1x": false, "archives": false, "public": false, "Archive": false,
	} {
		require.Equal(t, want, ownSchema(s), s)
	}
}

// TestArchiveVendorsIsCaptured: a user schema that merely starts like a
// version schema is captured; the version schema itself is not.
func TestArchiveVendorsIsCaptured(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE SCHEMA archive_vendors; CREATE TABLE archive_vendors.invoices (id int PRIMARY KEY, v text);
		ALTER TABLE archive_vendors.invoices REPLICA IDENTITY FULL;
		CREATE SCHEMA archive_v3; CREATE TABLE archive_v3.rows (id int PRIMARY KEY);
		INSERT INTO archive_vendors.invoices VALUES (1, 'one'); INSERT INTO archive_v3.rows VALUES (1)`)
	svc := e.start(t, nil)
	require.Equal(t, []string{"archive_vendors.invoices"}, svc.CurrentStatus().PublicationTables)
	e.exec(t, `DELETE FROM archive_v3.rows; DELETE FROM archive_vendors.invoices`)
	ms := e.deletes(t, "main", 1)
	require.Len(t, ms, 1)
	require.Equal(t, "archive_vendors.invoices", ms[0].ev.QualifiedTable())
	require.JSONEq(t, `{"id":1,"v":"one"}`, string(ms[0].ev.Row))

	// Named explicitly too.
	e2 := setup(t)
	e2.exec(t, `CREATE SCHEMA archive_vendors; CREATE TABLE archive_vendors.invoices (id int PRIMARY KEY)`)
	svc2 := e2.start(t, func(c *Config) { c.Tables = []string{"archive_vendors.invoices"} })
	require.Equal(t, []string{"archive_vendors.invoices"}, svc2.CurrentStatus().PublicationTables)
}

// TestMixedIdentityPartitions: the root is FULL, a leaf created later is
// not (new partitions do not inherit the replica identity). pgoutput labels
// every old tuple by the root's identity; the capture never labels full a
// row whose non-key values the WAL does not hold.
func TestMixedIdentityPartitions(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE m (id int PRIMARY KEY, v text, n int) PARTITION BY RANGE (id);
		CREATE TABLE m_full PARTITION OF m FOR VALUES FROM (0) TO (100);
		ALTER TABLE m REPLICA IDENTITY FULL; ALTER TABLE m_full REPLICA IDENTITY FULL;
		CREATE TABLE m_default PARTITION OF m FOR VALUES FROM (100) TO (200);
		INSERT INTO m VALUES (1, 'full leaf', 7), (2, NULL, 8), (101, 'default leaf', 9), (102, NULL, NULL)`)
	e.start(t, func(c *Config) { c.Tables = []string{"m"}; c.CatalogPoll = -1 })
	e.exec(t, `DELETE FROM m WHERE id = 1; DELETE FROM m WHERE id = 101; DELETE FROM m WHERE id = 2; DELETE FROM m WHERE id = 102`)
	ms := e.deletes(t, "main", 4)
	got := deletesOf(ms, "public.m")
	require.Len(t, got, 4)
	type row struct{ identity, key, row string }
	var rows []row
	for _, ev := range got {
		rows = append(rows, row{ev.Identity, string(ev.Key), string(ev.Row)})
	}
	require.Equal(t, []row{
		{"full", `{"id":1}`, `{"id":1,"v":"full leaf","n":7}`},
		{"key", `{"id":101}`, `{"id":101}`}, // the WAL holds the key only: never {"v":null,...} labelled full
		{"full", `{"id":2}`, `{"id":2,"v":null,"n":8}`},
		{"key", `{"id":102}`, `{"id":102}`}, // cannot be told from a key-only leaf's row: labelled key
	}, rows)
	for _, ev := range got {
		if ev.Identity == event.IdentityFull {
			continue
		}
		var r map[string]any
		require.NoError(t, json.Unmarshal(ev.Row, &r))
		require.NotContains(t, r, "v", "a key row carries no fabricated value")
	}
}

// TestNewTablesWhileStreaming: tables and partitions created while the
// capture streams are published at the next poll and every delete after
// that is captured; with --set-replica-identity-full they are set FULL.
func TestNewTablesWhileStreaming(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE base (id int PRIMARY KEY, v text);
		CREATE TABLE p (id int PRIMARY KEY, v text) PARTITION BY LIST (id);
		CREATE TABLE p1 PARTITION OF p FOR VALUES IN (1, 2)`)
	var logs lockedBuffer
	cfg := e.config()
	fastPoll(&cfg)
	cfg.SetReplicaIdentityFull = true
	svc, err := New(cfg, WithLogger(slog.New(slog.NewTextHandler(io.MultiWriter(&logs, testLogWriter{t}), nil))))
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, svc.Stop(context.Background())) })
	require.NoError(t, svc.Start(context.Background()))
	require.Equal(t, []string{"public.base", "public.p"}, svc.CurrentStatus().PublicationTables)
	require.Contains(t, logs.String(), `msg="set REPLICA IDENTITY FULL (--set-replica-identity-full)" tables="[\"public\".\"base\" \"public\".\"p\" \"public\".\"p1\"]"`)

	e.exec(t, `CREATE TABLE fresh (id int PRIMARY KEY, v text); INSERT INTO fresh VALUES (1, 'a'), (2, 'b'), (3, 'c');
		CREATE TABLE p2 PARTITION OF p FOR VALUES IN (3, 4); INSERT INTO p VALUES (3, 'three'), (4, 'four')`)
	e.waitPublication(t, e.slotPub(), "base", "fresh", "p")
	require.Eventually(t, func() bool { return metricValue(t, svc.m.tablesAdded) == 1 }, 60*time.Second, 50*time.Millisecond)
	require.Eventually(t, func() bool {
		return queryString(t, e.db, `SELECT string_agg(relname || '=' || relreplident::text, ',' ORDER BY relname) FROM pg_class WHERE relname IN ('fresh', 'p2')`) == "fresh=f,p2=f"
	}, 60*time.Second, 50*time.Millisecond, "new table and new leaf are set FULL")
	e.exec(t, `DELETE FROM fresh WHERE id = 1; DELETE FROM fresh WHERE id IN (2, 3); DELETE FROM p WHERE id IN (3, 4)`)
	ms := e.deletes(t, "main", 5)
	fresh := deletesOf(ms, "public.fresh")
	require.Len(t, fresh, 3, "every delete after the add is captured")
	for i, ev := range fresh {
		require.Equal(t, event.IdentityFull, ev.Identity)
		require.JSONEq(t, `{"id":`+itoa(i+1)+`}`, string(ev.Key))
		require.JSONEq(t, `{"id":`+itoa(i+1)+`,"v":"`+[]string{"a", "b", "c"}[i]+`"}`, string(ev.Row))
	}
	leaf := deletesOf(ms, "public.p")
	require.Len(t, leaf, 2)
	require.JSONEq(t, `{"id":3,"v":"three"}`, string(leaf[0].Row))
	require.JSONEq(t, `{"id":4,"v":"four"}`, string(leaf[1].Row))
	require.Equal(t, event.IdentityFull, leaf[1].Identity)
	require.Equal(t, 5.0, metricValue(t, svc.m.madeFull), "base, p and p1 at start, fresh and p2 later")
	require.Contains(t, logs.String(), `\"public\".\"fresh\"`)
	require.Contains(t, logs.String(), `\"public\".\"p2\"`)
	require.Contains(t, logs.String(), `msg="table added to the publication: its deletes are captured from now on" table=public.fresh`)
}

type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// slotPub is the publication the tests' captures use (the default).
func (e *env) slotPub() string { return "epitaph" }

// TestIdentityLostWhileStreaming: a published table that loses its usable
// identity is removed from the publication within a poll, so the
// application's DELETE succeeds; a gap naming the table is published; the
// table is added again once it has a key.
func TestIdentityLostWhileStreaming(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE keep (id int PRIMARY KEY); CREATE TABLE t (id int PRIMARY KEY, v text);
		CREATE TABLE nothing (id int PRIMARY KEY);
		CREATE TABLE r (id int, v text) PARTITION BY LIST (id); ALTER TABLE r REPLICA IDENTITY FULL;
		CREATE TABLE r1 PARTITION OF r FOR VALUES IN (1); ALTER TABLE r1 REPLICA IDENTITY FULL;
		INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, 4) g; INSERT INTO nothing VALUES (1); INSERT INTO r VALUES (1, 'one')`)
	svc := e.start(t, fastPoll)
	require.Equal(t, []string{"public.keep", "public.nothing", "public.r", "public.t"}, svc.CurrentStatus().PublicationTables)

	// A migration replacing the key in two steps; NOTHING; a new leaf
	// without identity under a root without a key.
	e.exec(t, `ALTER TABLE t DROP CONSTRAINT t_pkey; ALTER TABLE nothing REPLICA IDENTITY NOTHING;
		CREATE TABLE r2 PARTITION OF r FOR VALUES IN (2); INSERT INTO r VALUES (2, 'two')`)
	e.waitPublication(t, e.slotPub(), "keep")
	e.exec(t, `DELETE FROM t WHERE id = 1; DELETE FROM nothing; DELETE FROM r WHERE id = 2`) // would fail if still published
	ms := e.messages(t, "main", 3*4)
	gaps := gapsOf(ms)
	var named []string
	for _, g := range gaps {
		require.Equal(t, event.GapLostUpstream, g.GapKind())
		require.Contains(t, g.Reason, "replica identity")
		require.NotZero(t, g.FromLSN)
		if g.Partition == 0 {
			named = append(named, g.QualifiedTable())
		}
	}
	slices.Sort(named)
	require.Equal(t, []string{"public.nothing", "public.r", "public.t"}, named)
	require.Len(t, gaps, 3*4, "one copy per partition")
	require.Equal(t, 3.0, metricValue(t, svc.m.tablesRemoved))
	require.Equal(t, []string{"public.keep"}, svc.CurrentStatus().PublicationTables)

	// Safe again: added again, deletes captured again.
	e.exec(t, `ALTER TABLE t ADD PRIMARY KEY (id)`)
	e.waitPublication(t, e.slotPub(), "keep", "t")
	e.exec(t, `DELETE FROM t WHERE id = 2`)
	ds := e.deletes(t, "main", 1)
	require.Len(t, ds, 1)
	require.JSONEq(t, `{"id":2}`, string(ds[0].ev.Key))
	require.Equal(t, "public.t", ds[0].ev.QualifiedTable())
}

// TestDDLGuard: with the guard, the rule applies at the end of the DDL
// command itself: a DELETE right after a key is dropped never fails, even
// in the same transaction and with no poll at all, and a table created is
// published from its CREATE TABLE on.
func TestDDLGuard(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE t (id int PRIMARY KEY, v text); INSERT INTO t SELECT g, 'v' FROM generate_series(1, 3) g`)
	e.start(t, func(c *Config) { c.CatalogPoll = -1; c.InstallDDLGuard = true; c.DDLGuardMode = DDLGuardInline })
	e.exec(t, `BEGIN; ALTER TABLE t DROP CONSTRAINT t_pkey; DELETE FROM t WHERE id = 1; COMMIT`)
	e.waitPublication(t, e.slotPub()) // empty: removed by the guard, not by a poll
	ms := e.messages(t, "main", 4)
	gaps := gapsOf(ms)
	require.Len(t, gaps, 4)
	require.Equal(t, "public.t", gaps[0].QualifiedTable())

	// Created and deleted from at once: captured.
	e.exec(t, `CREATE TABLE fresh (id int PRIMARY KEY); INSERT INTO fresh VALUES (1), (2); DELETE FROM fresh WHERE id = 1`)
	e.exec(t, `DELETE FROM fresh WHERE id = 2`)
	ds := e.deletes(t, "main", 2)
	fresh := deletesOf(ds, "public.fresh")
	require.Len(t, fresh, 2)
	require.JSONEq(t, `{"id":1}`, string(fresh[0].Key))
	require.JSONEq(t, `{"id":2}`, string(fresh[1].Key))

	// The key back: added again by the guard.
	e.exec(t, `ALTER TABLE t ADD PRIMARY KEY (id)`)
	e.waitPublication(t, e.slotPub(), "fresh", "t")
}

// TestDDLGuardSetsFull: with --set-replica-identity-full the guard makes
// a new leaf FULL in the command that creates it.
func TestDDLGuardSetsFull(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE r (id int, v text) PARTITION BY LIST (id); CREATE TABLE r1 PARTITION OF r FOR VALUES IN (1)`)
	e.start(t, func(c *Config) {
		c.CatalogPoll = -1
		c.InstallDDLGuard = true
		c.DDLGuardMode = DDLGuardInline
		c.SetReplicaIdentityFull = true
	})
	e.exec(t, `CREATE TABLE r2 PARTITION OF r FOR VALUES IN (2); INSERT INTO r VALUES (2, 'two'); DELETE FROM r WHERE id = 2`)
	ms := e.deletes(t, "main", 1)
	require.Equal(t, event.IdentityFull, ms[0].ev.Identity)
	require.JSONEq(t, `{"id":2,"v":"two"}`, string(ms[0].ev.Row))
	// Every change recorded, with what it was, for capture uninstall: the
	// guard's (r2) as the start's (r, r1).
	require.Equal(t, `"public"."r"=d,"public"."r1"=d,public.r2=d`, queryString(t, e.db,
		`SELECT string_agg(relation || '=' || identity::text, ',' ORDER BY relation) FROM epitaph_capture.replica_identity`))
}

// TestDDLGuardRefusesKeyOnly: with RefuseKeyOnly the guard adds a new FULL
// table and leaves a key-only one out (no catalog poll here to do either).
func TestDDLGuardRefusesKeyOnly(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.start(t, func(c *Config) {
		c.CatalogPoll = -1
		c.InstallDDLGuard = true
		c.DDLGuardMode = DDLGuardInline
		c.RefuseKeyOnly = true
	})
	e.exec(t, `CREATE TABLE keyed (id int PRIMARY KEY); CREATE TABLE whole (id int PRIMARY KEY); ALTER TABLE whole REPLICA IDENTITY FULL`)
	e.waitPublication(t, e.slotPub(), "whole")
	e.exec(t, `INSERT INTO keyed VALUES (1); INSERT INTO whole VALUES (1); DELETE FROM keyed; DELETE FROM whole`)
	ms := e.deletes(t, "main", 1)
	require.Len(t, ms, 1)
	require.Equal(t, "public.whole", ms[0].ev.QualifiedTable())
}

// TestKeys: the key is the primary key when the tuple holds it, else the
// replica identity index's columns; a key column renamed with deletes
// still in the slot keeps its name as it was.
func TestKeys(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE ui (id int PRIMARY KEY, code text NOT NULL, v text);
		CREATE UNIQUE INDEX ui_code ON ui (code); ALTER TABLE ui REPLICA IDENTITY USING INDEX ui_code;
		CREATE TABLE ren (id int PRIMARY KEY, v text); ALTER TABLE ren REPLICA IDENTITY FULL;
		CREATE TABLE renk (id int PRIMARY KEY, v text);
		CREATE TABLE gone (id int PRIMARY KEY, v text);
		INSERT INTO ui VALUES (1, 'A-1', 'x'); INSERT INTO ren VALUES (1, 'r'); INSERT INTO renk VALUES (1, 'k'); INSERT INTO gone VALUES (1, 'g')`)
	svc := e.start(t, func(c *Config) { c.CatalogPoll = -1 })
	require.NoError(t, svc.Stop(context.Background()))
	require.NoError(t, svc.Wait())
	e.exec(t, `DELETE FROM ui; DELETE FROM ren; DELETE FROM renk; DELETE FROM gone;
		ALTER TABLE ren RENAME COLUMN id TO ident; ALTER TABLE renk RENAME COLUMN id TO ident; DROP TABLE gone`)
	e.start(t, func(c *Config) { c.CatalogPoll = -1; c.Tables = []string{"ui", "ren", "renk"} })
	ms := e.deletes(t, "main", 4)
	keys := map[string]string{}
	for _, m := range ms {
		keys[m.ev.Table] = string(m.ev.Key)
	}
	require.JSONEq(t, `{"code":"A-1"}`, keys["ui"], "USING INDEX: the index's columns, not the primary key the WAL lacks")
	require.JSONEq(t, `{"id":1}`, keys["ren"], "FULL, key column renamed since: found by position")
	require.JSONEq(t, `{"id":1}`, keys["renk"], "key identity, key column renamed since: the message's flags")
	require.JSONEq(t, `{"id":1}`, keys["gone"], "dropped since: the message's flags")
}

// TestKeysOfAFullTableDroppedWhileStopped: a FULL table's Relation
// message flags every column, so only the catalog says which is the key.
// The capture records what it read of each published relation on the
// source (epitaph_capture.relation_facts): a capture started after the
// table was dropped, its deletes still in the slot, still gives them the
// primary key and the foreign keys. Before the record they came without
// a key.
func TestKeysOfAFullTableDroppedWhileStopped(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE parent (id int PRIMARY KEY); INSERT INTO parent VALUES (7);
		CREATE TABLE gonefull (id int PRIMARY KEY, parent_id int REFERENCES parent, v text); ALTER TABLE gonefull REPLICA IDENTITY FULL;
		INSERT INTO gonefull VALUES (1, 7, 'a'), (2, 7, 'b')`)
	svc := e.start(t, func(c *Config) { c.CatalogPoll = -1 })
	require.NoError(t, svc.Stop(context.Background()))
	require.NoError(t, svc.Wait())
	require.Equal(t, `epitaph public.gonefull ["id"], epitaph public.parent ["id"]`, queryString(t, e.db,
		`SELECT string_agg(publication || ' ' || relation || ' ' || (facts->>'pk'), ', ' ORDER BY relation) FROM epitaph_capture.relation_facts`),
		"what the capture read of each published table, recorded on the source")
	e.exec(t, `DELETE FROM gonefull; DROP TABLE gonefull`)
	e.start(t, func(c *Config) { c.CatalogPoll = -1 })
	ms := e.deletes(t, "main", 2)
	for _, m := range ms {
		require.Equal(t, "gonefull", m.ev.Table)
		var row struct{ ID int }
		require.NoError(t, json.Unmarshal(m.ev.Row, &row))
		require.JSONEq(t, fmt.Sprintf(`{"id":%d}`, row.ID), string(m.ev.Key), "the primary key the capture recorded")
		require.Equal(t, []event.Ref{{Columns: []string{"parent_id"}, Schema: "public", Table: "parent", RefColumns: []string{"id"}}}, m.ev.Refs)
		require.Equal(t, []event.Column{{Name: "id", Type: "integer", PK: true}, {Name: "parent_id", Type: "integer"}, {Name: "v", Type: "text"}}, m.ev.Columns)
	}
}

// TestGeneratedColumns: a generated column is listed, marked, where the
// table has it; the row carries it on PostgreSQL 18 (publish_generated_columns)
// and not before; a restore leaves it to the server.
func TestGeneratedColumns(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE g (id int PRIMARY KEY, price numeric, total numeric GENERATED ALWAYS AS (price * 2) STORED, note text);
		ALTER TABLE g REPLICA IDENTITY FULL; INSERT INTO g (id, price, note) VALUES (1, 2.5, 'n')`)
	e.start(t, nil)
	e.exec(t, `DELETE FROM g`)
	ms := e.deletes(t, "main", 1)
	ev := ms[0].ev
	require.Equal(t, []event.Column{{Name: "id", Type: "integer", PK: true}, {Name: "price", Type: "numeric"},
		{Name: "total", Type: "numeric", Generated: true}, {Name: "note", Type: "text"}}, ev.Columns)
	if e.serverVersion(t) >= 180000 {
		// publish_generated_columns: the value as it was at the delete.
		require.JSONEq(t, `{"id":1,"price":"2.5","total":"5.0","note":"n"}`, string(ev.Row))
	} else {
		require.JSONEq(t, `{"id":1,"price":"2.5","note":"n"}`, string(ev.Row))
	}
	sql, args, err := RestoreSQL(ev)
	require.NoError(t, err)
	e.exec(t, sql, args...)
	require.Equal(t, "(1,2.5,5.0,n)", queryString(t, e.db, `SELECT g::text FROM g`))

	// A row that carries the generated column (PostgreSQL 18 can send it):
	// the restore still leaves it to the server.
	e.exec(t, `DELETE FROM g`)
	ev.Row = json.RawMessage(`{"id":1,"price":"2.5","total":"5.0","note":"n"}`)
	sql, args, err = RestoreSQL(ev)
	require.NoError(t, err)
	require.NotContains(t, sql, `"total"`)
	e.exec(t, sql, args...)
	require.Equal(t, "(1,2.5,5.0,n)", queryString(t, e.db, `SELECT g::text FROM g`))
}

// TestCaptureRoleRecipe is the README's recipe for the capture's role:
// REPLICATION, CREATE on the database, and membership in the role that owns
// the tables (not ownership: the application keeps owning them and its
// migrations keep working).
func TestCaptureRoleRecipe(t *testing.T) {
	t.Parallel()
	e := setup(t)
	db := dbName(t, e.db)
	pg := testenv.SharedPostgres(t)
	app, capRole := db+"_app", db+"_capture"
	e.exec(t, `CREATE ROLE `+app+` LOGIN;
		GRANT CREATE ON SCHEMA public TO `+app+`;
		CREATE ROLE `+capRole+` LOGIN REPLICATION;
		GRANT CREATE ON DATABASE `+db+` TO `+capRole+`;
		GRANT `+app+` TO `+capRole)
	t.Cleanup(func() {
		testenv.Exec(t, pg.URL("postgres"), `DROP OWNED BY `+app+`, `+capRole+` CASCADE`)
	})
	appURL := pg.UserURL(app, db)
	testenv.Exec(t, appURL, `CREATE TABLE orders (id int PRIMARY KEY, note text); INSERT INTO orders VALUES (1, 'one'), (2, 'two')`)
	e.start(t, func(c *Config) {
		c.SourceURL = pg.UserURL(capRole, db)
		c.SetReplicaIdentityFull = true
		fastPoll(c)
	})
	require.Equal(t, app, queryString(t, e.db, `SELECT relowner::regrole::text FROM pg_class WHERE relname = 'orders'`), "the application still owns its table")
	require.Equal(t, "f", queryString(t, e.db, `SELECT relreplident::text FROM pg_class WHERE relname = 'orders'`))

	// The application's migrations and deletes work; a new table is captured.
	testenv.Exec(t, appURL, `ALTER TABLE orders ADD COLUMN total numeric; DELETE FROM orders WHERE id = 1;
		CREATE TABLE lines (id int PRIMARY KEY, v text); INSERT INTO lines VALUES (7, 'seven')`)
	e.waitPublication(t, e.slotPub(), "lines", "orders")
	testenv.Exec(t, appURL, `DELETE FROM lines; DELETE FROM orders`)
	ms := e.deletes(t, "main", 3)
	require.JSONEq(t, `{"id":1,"note":"one","total":null}`, string(ms[0].ev.Row))
	require.JSONEq(t, `{"id":7,"v":"seven"}`, string(ms[1].ev.Row))
	require.Equal(t, event.IdentityFull, ms[1].ev.Identity)
	require.JSONEq(t, `{"id":2,"note":"two","total":null}`, string(ms[2].ev.Row))

	// What removing a table that lost its identity takes (without
	// --set-replica-identity-full, which makes it FULL instead): dropping it
	// from the publication and writing the gap message in one transaction.
	capURL := pg.UserURL(capRole, db)
	testenv.Exec(t, appURL, `ALTER TABLE lines DROP CONSTRAINT lines_pkey, REPLICA IDENTITY DEFAULT`)
	testenv.Exec(t, capURL, `BEGIN; ALTER PUBLICATION epitaph DROP TABLE public.lines;
		SELECT pg_logical_emit_message(true, 'epitaph.test', 'x'); COMMIT`)
}

// TestEncodeRowIdentityAndKeys: the pure rules of encodeRow, from
// hand-built tuples.
func TestEncodeRowIdentityAndKeys(t *testing.T) {
	t.Parallel()
	text := func(s string) *pglogrepl.TupleDataColumn {
		return &pglogrepl.TupleDataColumn{DataType: pglogrepl.TupleDataTypeText, Data: []byte(s)}
	}
	null := &pglogrepl.TupleDataColumn{DataType: pglogrepl.TupleDataTypeNull}
	rel := func(names []string, keys ...int) *relation {
		r := &relation{name: "public.t"}
		for i, n := range names {
			label, _ := json.Marshal(n)
			r.cols = append(r.cols, relColumn{name: n, typeOID: 25, key: slices.Contains(keys, i), label: append(label, ':')})
		}
		r.keyIdx = keys
		return r
	}
	type out struct{ identity, key, row string }
	encode := func(r *relation, tt uint8, cols ...*pglogrepl.TupleDataColumn) out {
		var img rowImage
		require.NoError(t, r.encodeRow(&img, tt, &pglogrepl.TupleData{Columns: cols}))
		return out{img.identity, string(img.key), string(img.row)}
	}
	O, K := uint8(pglogrepl.DeleteMessageTupleTypeOld), uint8(pglogrepl.DeleteMessageTupleTypeKey)

	// A partitioned FULL root: a tuple NULL outside the key is a key-only
	// leaf's; one with a value is whole.
	p := rel([]string{"id", "v", "w"}, 0, 1, 2)
	p.pkIdx, p.partitioned = []int{0}, true
	require.Equal(t, out{"key", `{"id":"1"}`, `{"id":"1"}`}, encode(p, O, text("1"), null, null))
	require.Equal(t, out{"full", `{"id":"2"}`, `{"id":"2","v":null,"w":"x"}`}, encode(p, O, text("2"), null, text("x")))
	// Not partitioned: the tuple type is exact.
	p.partitioned = false
	require.Equal(t, out{"full", `{"id":"1"}`, `{"id":"1","v":null,"w":null}`}, encode(p, O, text("1"), null, null))
	// Partitioned without a primary key and a weak leaf: any NULL is doubt.
	np := rel([]string{"a", "b"}, 0, 1)
	np.partitioned, np.weakLeaves = true, true
	require.Equal(t, out{"key", ``, `{"a":"1"}`}, encode(np, O, text("1"), null))
	require.Equal(t, out{"full", ``, `{"a":"1","b":"2"}`}, encode(np, O, text("1"), text("2")))

	// USING INDEX on code, primary key id: a key tuple lacks id.
	ui := rel([]string{"id", "code", "v"}, 1)
	ui.pkIdx, ui.identIdx = []int{0}, []int{1}
	require.Equal(t, out{"key", `{"code":"A"}`, `{"code":"A"}`}, encode(ui, K, null, text("A"), null))
	// The same table FULL: the primary key.
	require.Equal(t, out{"full", `{"id":"1"}`, `{"id":"1","code":"A","v":"x"}`}, encode(ui, O, text("1"), text("A"), text("x")))
	// Default identity: the primary key is the identity.
	d := rel([]string{"id", "v"}, 0)
	d.pkIdx, d.identIdx = []int{0}, []int{0}
	require.Equal(t, out{"key", `{"id":"9"}`, `{"id":"9"}`}, encode(d, K, text("9"), null))
}

// TestWindowBeforeThePoll is the window the README names: a delete
// committed after CREATE TABLE but before the table is added to the
// publication is not captured; one committed after the add is, although
// the slot decodes both after the add (pgoutput decides by the publication
// as of each change's WAL position).
func TestWindowBeforeThePoll(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE base (id int PRIMARY KEY)`)
	svc := e.start(t, func(c *Config) { c.CatalogPoll = -1 })
	e.exec(t, `CREATE TABLE fresh (id int PRIMARY KEY); INSERT INTO fresh VALUES (1), (2)`)
	e.exec(t, `DELETE FROM fresh WHERE id = 1`)
	require.NoError(t, svc.reconcile(context.Background())) // what the next poll does
	e.exec(t, `DELETE FROM fresh WHERE id = 2; INSERT INTO base VALUES (1); DELETE FROM base`)
	ms := e.deletes(t, "main", 2)
	require.Equal(t, []string{"delete public.fresh", "delete public.base"}, ops(deletesOnly(ms)))
	require.JSONEq(t, `{"id":2}`, string(ms[0].ev.Key), "the delete before the add is not captured")
}

func deletesOnly(ms []msg) []msg {
	var out []msg
	for _, m := range ms {
		if m.ev.Op == event.OpDelete {
			out = append(out, m)
		}
	}
	return out
}

// TestDDLGuardForAnApplicationRole: the guard acts for the application's
// own (non-superuser) role, which owns neither the publication nor the
// guard: its migration creates a table (published at once) and drops a key
// (removed at once), and its DDL and DELETEs succeed.
func TestDDLGuardForAnApplicationRole(t *testing.T) {
	t.Parallel()
	e := setup(t)
	db := dbName(t, e.db)
	pg := testenv.SharedPostgres(t)
	app := db + "_guarded"
	e.exec(t, `CREATE ROLE `+app+` LOGIN; GRANT CREATE ON SCHEMA public TO `+app)
	t.Cleanup(func() { testenv.Exec(t, pg.URL("postgres"), `DROP OWNED BY `+app+` CASCADE`) })
	appURL := pg.UserURL(app, db)
	testenv.Exec(t, appURL, `CREATE TABLE t (id int PRIMARY KEY); INSERT INTO t VALUES (1), (2)`)
	e.start(t, func(c *Config) { c.CatalogPoll = -1; c.InstallDDLGuard = true; c.DDLGuardMode = DDLGuardInline })
	testenv.Exec(t, appURL, `CREATE TABLE fresh (id int PRIMARY KEY); INSERT INTO fresh VALUES (1); DELETE FROM fresh`)
	testenv.Exec(t, appURL, `ALTER TABLE t DROP CONSTRAINT t_pkey; DELETE FROM t WHERE id = 1`)
	e.waitPublication(t, e.slotPub(), "fresh")
	ms := e.messages(t, "main", 2+4) // fresh's delete and commit, t's gap
	require.Len(t, deletesOf(ms, "public.fresh"), 1)
	gaps := gapsOf(ms)
	require.Len(t, gaps, 4)
	require.Equal(t, "public.t", gaps[0].QualifiedTable())
}

// TestRefuseKeyOnlyWhileStreaming: with RefuseKeyOnly, a key-only table
// created while streaming stays out of the publication (warned about
// once), while a FULL one created beside it is added and captured.
func TestRefuseKeyOnlyWhileStreaming(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE base (id int PRIMARY KEY, v text); ALTER TABLE base REPLICA IDENTITY FULL`)
	var logs lockedBuffer
	cfg := e.config()
	fastPoll(&cfg)
	cfg.RefuseKeyOnly = true
	svc, err := New(cfg, WithLogger(slog.New(slog.NewTextHandler(io.MultiWriter(&logs, testLogWriter{t}), nil))))
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, svc.Stop(context.Background())) })
	require.NoError(t, svc.Start(context.Background()))

	e.exec(t, `CREATE TABLE keyed (id int PRIMARY KEY, v text); INSERT INTO keyed VALUES (1, 'k');
		CREATE TABLE whole (id int PRIMARY KEY, v text); ALTER TABLE whole REPLICA IDENTITY FULL; INSERT INTO whole VALUES (1, 'w')`)
	e.waitPublication(t, e.slotPub(), "base", "whole")
	require.Eventually(t, func() bool {
		return strings.Contains(logs.String(), `msg="new table not captured: it is not REPLICA IDENTITY FULL, its deletes would carry only the key" table=public.keyed`)
	}, 60*time.Second, 50*time.Millisecond)
	e.exec(t, `DELETE FROM keyed WHERE id = 1; DELETE FROM whole WHERE id = 1`)
	ms := e.deletes(t, "main", 1)
	require.Len(t, deletesOf(ms, "public.whole"), 1)
	require.Empty(t, deletesOf(ms, "public.keyed"))
	require.Equal(t, []string{"public.base", "public.whole"}, svc.CurrentStatus().PublicationTables)
	require.Equal(t, 1, strings.Count(logs.String(), "table=public.keyed"), "warned once")
}
