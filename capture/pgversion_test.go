package capture

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// serverVersion is the server_version_num of the test's source.
func (e *env) serverVersion(t *testing.T) int {
	t.Helper()
	v, err := strconv.Atoi(queryString(t, e.db, `SELECT current_setting('server_version_num')`))
	require.NoError(t, err)
	return v
}

// A publication made beforehand (by a DBA, or an older tool) with a row
// filter would silently drop the deletes of the rows it leaves out, and a
// column list narrower than a FULL identity makes the application's
// DELETEs fail: the capture's start replaces both with the plain table.
func TestPublicationRowFilterAndColumnListAreRemoved(t *testing.T) {
	t.Parallel()
	e := setup(t)
	if v := e.serverVersion(t); v < 150000 {
		t.Skipf("PostgreSQL %d has no row filters or column lists (15+)", v/10000)
	}
	e.exec(t, `CREATE TABLE shown (id int PRIMARY KEY, v text);
		ALTER TABLE shown REPLICA IDENTITY FULL;
		CREATE TABLE narrow (id int PRIMARY KEY, v text, w text);
		ALTER TABLE narrow REPLICA IDENTITY FULL;
		INSERT INTO shown VALUES (1, 'hidden'), (2, 'shown');
		INSERT INTO narrow VALUES (1, 'a', 'b');
		CREATE PUBLICATION epitaph FOR TABLE shown WHERE (v <> 'hidden'), narrow (id, v)
		  WITH (publish = 'delete, truncate', publish_via_partition_root = true)`)
	svc := e.start(t, nil)
	require.Equal(t, []string{"public.narrow", "public.shown"}, svc.CurrentStatus().PublicationTables)
	require.Equal(t, "0", queryString(t, e.db, `SELECT count(*)::text FROM pg_publication_rel pr JOIN pg_publication p ON p.oid = pr.prpubid
		WHERE p.pubname = 'epitaph' AND (pr.prqual IS NOT NULL OR pr.prattrs IS NOT NULL)`))

	e.exec(t, `DELETE FROM shown WHERE id = 1`)
	e.exec(t, `DELETE FROM narrow`)
	ms := e.deletes(t, "main", 2)
	require.Equal(t, "shown", ms[0].ev.Table)
	require.JSONEq(t, `{"id":1,"v":"hidden"}`, string(ms[0].ev.Row), "the row the filter left out")
	require.Equal(t, "narrow", ms[1].ev.Table)
	require.JSONEq(t, `{"id":1,"v":"a","w":"b"}`, string(ms[1].ev.Row), "every column, not the list's")
}

// slotFailover is the failover column of the test's slot (PostgreSQL 17+).
func (e *env) slotFailover(t *testing.T) string {
	t.Helper()
	return queryString(t, e.db, `SELECT failover::text FROM pg_replication_slots WHERE slot_name = $1`, e.slot)
}

// waitStatusFailover polls /status until its slot_stats say failover want.
func waitStatusFailover(t *testing.T, svc *Service, want bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for svc.CurrentStatus().SlotStats.Failover != want || svc.CurrentStatus().SlotStats.At.IsZero() {
		if time.Now().After(deadline) {
			t.Fatalf("status slot_stats.failover is %t after 30s, want %t", svc.CurrentStatus().SlotStats.Failover, want)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// On PostgreSQL 17+ the slot is made with FAILOVER, so a standby with
// sync_replication_slots keeps a copy that survives its promotion;
// --failover-slot=false (NoFailoverSlot) turns it off on the existing slot
// at the next start, and the default turns it on again. /status and the
// metric report it.
func TestSlotFailoverOn17(t *testing.T) {
	t.Parallel()
	if !testenv.HasMajor(17) {
		if os.Getenv("CI") != "" {
			t.Fatal("PostgreSQL 17 server binaries are missing: run make test-deps")
		}
		t.Skip("PostgreSQL 17 server binaries are missing (make test-deps installs them)")
	}
	pg := testenv.NewPostgresMajor(t, 17)
	e := &env{db: pg.NewDatabase(t), nats: testenv.NewNATS(t), dir: t.TempDir()}
	e.slot = dbName(t, e.db)
	_, e.js = e.nats.Connect(t)
	e.exec(t, `CREATE TABLE items (id int PRIMARY KEY, v text);
		ALTER TABLE items REPLICA IDENTITY FULL;
		INSERT INTO items VALUES (1, 'a'), (2, 'b'), (3, 'c')`)

	svc := e.start(t, nil)
	require.Equal(t, "true", e.slotFailover(t), "a new slot has FAILOVER")
	waitStatusFailover(t, svc, true)
	require.Equal(t, 1.0, metricValue(t, svc.m.slotFailover))
	e.exec(t, `DELETE FROM items WHERE id = 1`)
	ms := e.deletes(t, "main", 1)
	require.JSONEq(t, `{"id":1,"v":"a"}`, string(ms[0].ev.Row), "a failover slot streams as any other")
	require.NoError(t, svc.Stop(context.Background()))
	require.NoError(t, svc.Wait())

	svc = e.start(t, func(c *Config) { c.NoFailoverSlot = true })
	require.Equal(t, "false", e.slotFailover(t), "--failover-slot=false alters the existing slot")
	waitStatusFailover(t, svc, false)
	require.Equal(t, 0.0, metricValue(t, svc.m.slotFailover))
	e.exec(t, `DELETE FROM items WHERE id = 2`)
	ms = e.deletes(t, "main", 2)
	require.JSONEq(t, `{"id":2,"v":"b"}`, string(ms[1].ev.Row))
	require.NoError(t, svc.Stop(context.Background()))
	require.NoError(t, svc.Wait())

	svc = e.start(t, nil)
	require.Equal(t, "true", e.slotFailover(t), "the default turns FAILOVER on again")
	waitStatusFailover(t, svc, true)
	e.exec(t, `DELETE FROM items WHERE id = 3`)
	ms = e.deletes(t, "main", 3)
	require.JSONEq(t, `{"id":3,"v":"c"}`, string(ms[2].ev.Row))
}

// Before PostgreSQL 17 the slot is made as before (no FAILOVER, no
// error), and /status says it has none.
func TestSlotWithoutFailoverBefore17(t *testing.T) {
	t.Parallel()
	e := setup(t)
	if v := e.serverVersion(t); v >= 170000 {
		t.Skipf("PostgreSQL %d has failover slots (TestSlotFailoverOn17)", v/10000)
	}
	e.exec(t, `CREATE TABLE items (id int PRIMARY KEY)`)
	svc := e.start(t, nil)
	waitStatusFailover(t, svc, false)
	require.Equal(t, 0.0, metricValue(t, svc.m.slotFailover))
}

// promotionEnv is a PostgreSQL 17 primary with a physical standby, table
// items (ids 1-10) and a capture streaming the primary (with FAILOVER
// unless noFailover) that has published the deletes of ids 1-5. e.db is a
// multi-host URL of both servers.
func promotionEnv(t *testing.T, noFailover bool) (e *env, pg, sb *testenv.Postgres, svc *Service) {
	t.Helper()
	e, pg, sb = promotionSource(t)
	// Heartbeats keep the slot's confirmed position moving, so the
	// standby's sync worker keeps its short interval.
	svc = e.start(t, func(c *Config) {
		c.HeartbeatInterval = 100 * time.Millisecond
		c.NoFailoverSlot = noFailover
	})
	e.exec(t, `DELETE FROM items WHERE id <= 3`)
	e.exec(t, `DELETE FROM items WHERE id IN (4, 5)`)
	require.Len(t, e.deletes(t, "main", 5), 5)
	return e, pg, sb, svc
}

// promotionSource is promotionEnv's servers and table, no capture yet.
func promotionSource(t *testing.T) (e *env, pg, sb *testenv.Postgres) {
	t.Helper()
	if !testenv.HasMajor(17) {
		if os.Getenv("CI") != "" {
			t.Fatal("PostgreSQL 17 server binaries are missing: run make test-deps")
		}
		t.Skip("PostgreSQL 17 server binaries are missing (make test-deps installs them)")
	}
	pg = testenv.NewPostgresMajor(t, 17)
	e = &env{db: pg.NewDatabase(t), nats: testenv.NewNATS(t), dir: t.TempDir()}
	e.slot = dbName(t, e.db)
	_, e.js = e.nats.Connect(t)
	e.exec(t, `CREATE TABLE items (id int PRIMARY KEY, v text);
		ALTER TABLE items REPLICA IDENTITY FULL;
		INSERT INTO items SELECT g, 'v' || g FROM generate_series(1, 10) g`)
	sb = pg.NewStandby(t)
	// One URL for both servers, as a failover setup names them:
	// target_session_attrs picks the one that takes writes.
	e.db = fmt.Sprintf("postgres://postgres@%s:%d,%s:%d/%s?sslmode=disable&target_session_attrs=read-write",
		pg.Host, pg.Port, sb.Host, sb.Port, e.slot)
	return e, pg, sb
}

// A failover slot is what lets the capture survive a promotion: on
// PostgreSQL 17 a standby with sync_replication_slots holds a copy of the
// capture's slot; the primary is killed while the capture streams, the
// standby promoted, and a capture started on it resumes from the synced
// slot: every delete of before and after the promotion is in the stream
// exactly once, no gap.
func TestFailoverSlotSurvivesPromotion(t *testing.T) {
	t.Parallel()
	e, pg, sb, svc := promotionEnv(t, false)
	sbURL := sb.URL(e.slot) // the database is named like the slot
	// The standby's copy of the slot, synced from the primary; it is kept
	// at a promotion once it is no longer temporary (the primary's slot
	// has moved past where the copy started). A running-transactions record
	// lets the slot's restart_lsn move now rather than at the next one
	// PostgreSQL writes on its own (every 15s).
	deadline := time.Now().Add(90 * time.Second)
	for queryString(t, sbURL, `SELECT count(*)::text FROM pg_replication_slots WHERE slot_name = $1 AND synced AND failover AND NOT temporary`, e.slot) != "1" {
		if time.Now().After(deadline) {
			t.Fatal("the standby has no synced copy of the capture's slot after 90s")
		}
		e.exec(t, `SELECT pg_log_standby_snapshot()`)
		time.Sleep(200 * time.Millisecond)
	}

	require.NoError(t, pg.Kill())
	_ = svc.Stop(context.Background()) // its source is gone: it may report that
	require.NoError(t, sb.Promote())
	e.exec(t, `DELETE FROM items WHERE id > 5`)

	e.start(t, nil) // the same multi-host URL: the new primary
	// A sentinel deleted last: a re-sent delete would come before it.
	e.exec(t, `INSERT INTO items VALUES (11, 'v11'); DELETE FROM items WHERE id = 11`)
	ms := e.deletes(t, "main", 11)
	require.Len(t, ms, 11, "every delete once")
	for i, m := range ms {
		require.Equal(t, "items", m.ev.Table)
		require.JSONEq(t, fmt.Sprintf(`{"id":%d,"v":"v%d"}`, i+1, i+1), string(m.ev.Row), "delete %d", i)
	}
	for _, m := range e.messages(t, "main", 0) {
		require.NotEqual(t, event.OpGap, m.ev.Op, "no gap: the slot survived the promotion")
	}
}

// Without FAILOVER (before PostgreSQL 17, or --failover-slot=false) the
// promoted standby has no copy of the slot: the capture refuses to start
// on it, and with --recreate-slot records a gap over the deletes it could
// not read, then captures again.
func TestPromotionWithoutFailoverSlotRecordsAGap(t *testing.T) {
	t.Parallel()
	e, pg, sb, svc := promotionEnv(t, true)
	sbURL := sb.URL(e.slot)
	// The standby has replayed everything the capture read, and has no
	// copy of the slot.
	var lsn string
	require.NoError(t, queryRow(t, e.db, `SELECT pg_current_wal_lsn()::text`, nil, &lsn))
	deadline := time.Now().Add(60 * time.Second)
	for queryString(t, sbURL, `SELECT (pg_last_wal_replay_lsn() >= $1::pg_lsn)::text`, lsn) != "true" {
		if time.Now().After(deadline) {
			t.Fatal("the standby has not replayed the primary's WAL after 60s")
		}
		time.Sleep(50 * time.Millisecond)
	}
	require.Equal(t, "0", queryString(t, sbURL, `SELECT count(*)::text FROM pg_replication_slots WHERE slot_name = $1`, e.slot))

	require.NoError(t, pg.Kill())
	_ = svc.Stop(context.Background())
	require.NoError(t, sb.Promote())
	e.exec(t, `DELETE FROM items WHERE id > 5`)
	var lostText string
	require.NoError(t, queryRow(t, e.db, `SELECT pg_current_wal_lsn()::text`, nil, &lostText))
	lost, err := event.ParseLSN(lostText)
	require.NoError(t, err)
	requireFix(t, e.startErr(t, nil), "is missing", "--recreate-slot")

	e.start(t, func(c *Config) { c.RecreateSlot = true })
	e.exec(t, `INSERT INTO items VALUES (11, 'v11'); DELETE FROM items WHERE id = 11`)
	ms := e.deletes(t, "main", 6)
	require.Len(t, ms, 6)
	require.JSONEq(t, `{"id":11,"v":"v11"}`, string(ms[5].ev.Row), "ids 6-10 were deleted before the new slot: lost")
	var gaps int
	for _, m := range e.messages(t, "main", 0) {
		if m.ev.Op == event.OpGap {
			gaps++
			require.Contains(t, m.ev.Reason, "missing")
			require.Less(t, m.ev.FromLSN, m.ev.ToLSN)
			require.GreaterOrEqual(t, m.ev.ToLSN, lost, "the gap covers the deletes it could not read")
		}
	}
	require.Equal(t, 4, gaps, "a gap on every partition")
}
