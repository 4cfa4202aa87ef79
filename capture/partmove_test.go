package capture

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
)

// TestPartitionMoveNotADelete: a row an UPDATE moves to another partition
// (pgoutput: a delete from the old leaf, an insert into the new one) is not
// published as a delete; a real delete on a partition is, under the root's
// name; a row moved and then deleted in one transaction is published once,
// as it was when deleted.
func TestPartitionMoveNotADelete(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE m (id int, region text, v text, vlen int GENERATED ALWAYS AS (length(v)) STORED, PRIMARY KEY (id, region)) PARTITION BY LIST (region);
		CREATE TABLE m_eu PARTITION OF m FOR VALUES IN ('eu');
		CREATE TABLE m_us PARTITION OF m FOR VALUES IN ('us');
		ALTER TABLE m REPLICA IDENTITY FULL; ALTER TABLE m_eu REPLICA IDENTITY FULL; ALTER TABLE m_us REPLICA IDENTITY FULL;
		CREATE TABLE sentinel (id int PRIMARY KEY);
		INSERT INTO sentinel VALUES (1);
		INSERT INTO m VALUES (1, 'eu', 'one'), (2, 'eu', 'two'), (3, 'eu', 'three'), (4, 'us', 'four'), (5, 'eu', 'five')`)
	svc := e.start(t, func(c *Config) { c.Tables = []string{"m", "sentinel"}; c.CatalogPoll = -1 })

	e.exec(t, `UPDATE m SET region = 'us' WHERE id = 1`)
	e.exec(t, `UPDATE m SET region = 'us', v = v || ' moved' WHERE id IN (2, 3)`)
	e.exec(t, `DELETE FROM m WHERE id = 4`)
	e.exec(t, `BEGIN; UPDATE m SET region = 'eu' WHERE id = 2; DELETE FROM m WHERE id = 2; COMMIT`)
	e.exec(t, `DELETE FROM m_us WHERE id = 3`)
	// A delete and an insert of another key in one transaction: both real.
	e.exec(t, `BEGIN; DELETE FROM m WHERE id = 5; INSERT INTO m VALUES (6, 'us', 'six'); COMMIT`)
	e.exec(t, `DELETE FROM sentinel`)

	ms := e.deletes(t, "main", 1)
	for len(deletesOf(ms, "public.sentinel")) == 0 {
		ms = e.deletes(t, "main", len(ms)+1)
	}
	var rows []string
	for _, ev := range deletesOf(ms, "public.m") {
		var row map[string]any
		require.NoError(t, json.Unmarshal(ev.Row, &row))
		delete(row, "vlen") // sent on PostgreSQL 18 only (publish_generated_columns)
		b, err := json.Marshal(map[string]any{"id": row["id"], "region": row["region"], "v": row["v"]})
		require.NoError(t, err)
		require.Len(t, row, 3)
		rows = append(rows, string(b))
	}
	require.Equal(t, []string{
		`{"id":4,"region":"us","v":"four"}`,
		`{"id":2,"region":"eu","v":"two moved"}`,
		`{"id":3,"region":"us","v":"three moved"}`,
		`{"id":5,"region":"eu","v":"five"}`,
	}, rows, "moved rows are not deletes; deleted ones are, once each")
	require.Equal(t, 4.0, metricValue(t, svc.m.partitionMoves), "ids 1, 2, 3, then 2 back")
	var n int
	require.NoError(t, queryRow(t, e.db, `SELECT count(*) FROM m WHERE id = 1 AND region = 'us'`, nil, &n))
	require.Equal(t, 1, n, "the moved row lives on")
}

// TestInheritanceTreePublishedWhateverTheOrder: an inheritance parent whose
// child sorts first by name is published too (adding it used to recurse
// into the child, already a member, and fail), at start and while
// streaming, and each table's deletes name it.
func TestInheritanceTreePublishedWhateverTheOrder(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE zparent (id int PRIMARY KEY, v text);
		CREATE TABLE achild (extra text) INHERITS (zparent); ALTER TABLE achild ADD PRIMARY KEY (id)`)
	e.start(t, func(c *Config) { fastPoll(c); c.SetReplicaIdentityFull = true })
	e.waitPublication(t, e.slotPub(), "achild", "zparent")

	e.exec(t, `CREATE TABLE ynew (id int PRIMARY KEY, v text);
		CREATE TABLE bnew () INHERITS (ynew); ALTER TABLE bnew ADD PRIMARY KEY (id)`)
	e.waitPublication(t, e.slotPub(), "achild", "bnew", "ynew", "zparent")
	e.exec(t, `INSERT INTO zparent VALUES (1, 'parent'); INSERT INTO achild VALUES (2, 'child', 'x');
		INSERT INTO ynew VALUES (3, 'new parent'); INSERT INTO bnew VALUES (4, 'new child')`)
	e.exec(t, `DELETE FROM zparent; DELETE FROM ynew`) // the parents' DELETEs reach the children
	ms := e.deletes(t, "main", 4)
	got := map[string]string{}
	for _, m := range ms {
		got[m.ev.QualifiedTable()] = string(m.ev.Row)
	}
	require.Equal(t, map[string]string{
		"public.zparent": `{"id":1,"v":"parent"}`,
		"public.achild":  `{"id":2,"v":"child","extra":"x"}`,
		"public.ynew":    `{"id":3,"v":"new parent"}`,
		"public.bnew":    `{"id":4,"v":"new child"}`,
	}, got)
}

// TestSetFullRefusesATableWithAColumnList: --set-replica-identity-full on
// a table another publication publishes with a column list would make the
// application's DELETEs fail: the start is refused with one line naming
// both, the table is left as it was and its DELETEs work. A column list
// with every column is no obstacle; a table in that case created while
// streaming is left key-only, its DELETEs working.
func TestSetFullRefusesATableWithAColumnList(t *testing.T) {
	t.Parallel()
	e := setup(t)
	if queryString(t, e.db, `SELECT (current_setting('server_version_num')::int >= 150000)::text`) != "true" {
		t.Skip("column lists are PostgreSQL 15+")
	}
	e.exec(t, `CREATE TABLE narrow (id int PRIMARY KEY, a text, b text); INSERT INTO narrow VALUES (1, 'a', 'b'), (2, 'a', 'b');
		CREATE TABLE wide (id int PRIMARY KEY, a text); INSERT INTO wide VALUES (1, 'a');
		CREATE PUBLICATION other FOR TABLE narrow (id, a), wide (id, a)`)
	err := e.startErr(t, func(c *Config) { c.SetReplicaIdentityFull = true })
	require.Contains(t, err.Error(), `cannot set REPLICA IDENTITY FULL on public.narrow (--set-replica-identity-full): publication other publishes public.narrow with a column list`)
	require.Equal(t, "d", queryString(t, e.db, `SELECT relreplident::text FROM pg_class WHERE relname = 'narrow'`))
	e.exec(t, `DELETE FROM narrow WHERE id = 1`)

	e.exec(t, `ALTER PUBLICATION other DROP TABLE narrow`)
	e.start(t, func(c *Config) { c.SetReplicaIdentityFull = true; fastPoll(c) })
	require.Equal(t, "f", queryString(t, e.db, `SELECT string_agg(DISTINCT relreplident::text, ',') FROM pg_class WHERE relname IN ('narrow', 'wide')`))
	e.exec(t, `BEGIN; CREATE TABLE later (id int PRIMARY KEY, a text, b text); INSERT INTO later VALUES (1, 'a', 'b');
		CREATE PUBLICATION other2 FOR TABLE later (id, a); COMMIT`)
	e.waitPublication(t, e.slotPub(), "later", "narrow", "wide")
	require.Equal(t, "d", queryString(t, e.db, `SELECT relreplident::text FROM pg_class WHERE relname = 'later'`))
	e.exec(t, `DELETE FROM later`)
	ms := e.deletes(t, "main", 1)
	require.JSONEq(t, `{"id":1}`, string(deletesOf(ms, "public.later")[0].Row), "captured by its key")
}

// TestNewTableDeletesBeforePublishedRecordAGap: rows deleted from a new
// table before the catalog poll publishes it cannot be captured; the add
// records a gap naming the table instead of losing them silently. A new
// table without deletes before its add records none.
func TestNewTableDeletesBeforePublishedRecordAGap(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE base (id int PRIMARY KEY)`)
	svc := e.start(t, func(c *Config) { c.SetReplicaIdentityFull = true; c.CatalogPoll = time.Hour })
	// The statistics (which tell the capture about the deletes) reach the
	// server seconds after the deleting session's transaction: wait.
	e.exec(t, `CREATE TABLE fresh (id int PRIMARY KEY, v text); INSERT INTO fresh SELECT g, 'x' FROM generate_series(1, 5) g;
		DELETE FROM fresh WHERE id <= 3; CREATE TABLE quiet (id int PRIMARY KEY)`)
	deadline := time.Now().Add(30 * time.Second)
	for queryString(t, e.db, `SELECT pg_stat_get_tuples_deleted('fresh'::regclass)::text`) != "3" {
		if time.Now().After(deadline) {
			t.Fatal("the deletes never reached the statistics")
		}
		time.Sleep(50 * time.Millisecond)
	}
	svc.kickCatalog() // the poll, now that the statistics have the deletes
	e.waitPublication(t, e.slotPub(), "base", "fresh", "quiet")
	e.exec(t, `DELETE FROM fresh`)
	ms := e.deletes(t, "main", 2)
	var rows []string
	for _, ev := range deletesOf(ms, "public.fresh") {
		rows = append(rows, string(ev.Row))
	}
	require.Equal(t, []string{`{"id":4,"v":"x"}`, `{"id":5,"v":"x"}`}, rows, "captured from the add on")
	gaps := gapsOf(e.messages(t, "main", 0))
	require.Len(t, gaps, 4, "one gap, on every partition")
	for _, g := range gaps {
		require.Equal(t, "public.fresh", g.QualifiedTable())
		require.Equal(t, event.GapLostUpstream, g.Kind)
		require.Contains(t, g.Reason, "deleted before it was published")
	}
}

// TestDDLGuardPublishesInheritanceTrees: the DDL guard adds an inheritance
// parent whose child is already published ONLY (without, the add recursed
// into the child, failed as "already member", and left the parent out).
func TestDDLGuardPublishesInheritanceTrees(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE base (id int PRIMARY KEY)`)
	e.start(t, func(c *Config) { c.CatalogPoll = -1; c.InstallDDLGuard = true; c.DDLGuardMode = DDLGuardInline })
	e.exec(t, `CREATE TABLE zparent (id int, v text); CREATE TABLE achild () INHERITS (zparent); ALTER TABLE achild ADD PRIMARY KEY (id)`)
	e.waitPublication(t, e.slotPub(), "achild", "base") // the parent has no key yet
	e.exec(t, `ALTER TABLE zparent ADD PRIMARY KEY (id)`)
	e.waitPublication(t, e.slotPub(), "achild", "base", "zparent")
}
