package capture

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// waitSyncedSlot waits until the standby holds a synced, kept copy of the
// capture's slot (see TestFailoverSlotSurvivesPromotion).
func waitSyncedSlot(t *testing.T, e *env, sb *testenv.Postgres) {
	t.Helper()
	sbURL := sb.URL(e.slot)
	deadline := time.Now().Add(90 * time.Second)
	for queryString(t, sbURL, `SELECT count(*)::text FROM pg_replication_slots WHERE slot_name = $1 AND synced AND failover AND NOT temporary`, e.slot) != "1" {
		if time.Now().After(deadline) {
			t.Fatal("the standby has no synced copy of the capture's slot after 90s")
		}
		e.exec(t, `SELECT pg_log_standby_snapshot()`)
		time.Sleep(200 * time.Millisecond)
	}
}

// requirePromotionDeletes: ids 1-11 deleted once each, in order, no gap.
func requirePromotionDeletes(t *testing.T, e *env) {
	t.Helper()
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

// TestSameCaptureFollowsPromotion: the capture that streamed the primary
// is not restarted: after the primary's SIGKILL and the standby's
// promotion (with a synced FAILOVER slot), the same Service reconnects
// through the multi-host URL to the new primary and resumes from the
// synced slot, every delete once and no gap.
func TestSameCaptureFollowsPromotion(t *testing.T) {
	t.Parallel()
	e, pg, sb, svc := promotionEnv(t, false)
	waitSyncedSlot(t, e, sb)
	require.NoError(t, pg.Kill())
	require.NoError(t, sb.Promote())
	e.exec(t, `DELETE FROM items WHERE id > 5`)
	e.exec(t, `INSERT INTO items VALUES (11, 'v11'); DELETE FROM items WHERE id = 11`)
	requirePromotionDeletes(t, e)
	require.True(t, svc.CurrentStatus().Active, "the same capture streams the new primary")
}

// TestCaptureProcessFollowsPromotion is the same with the real binary: one
// process, never restarted (its supervisor counts no exit), streams the
// new primary after the old one's SIGKILL and the standby's promotion.
func TestCaptureProcessFollowsPromotion(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs a capture process")
	}
	t.Parallel()
	e, pg, sb := promotionSource(t)
	bin := buildCapture(t)
	p := startCapProc(t, "capture", bin, map[string]string{
		"EPITAPH_SOURCE_URL":         e.db,
		"EPITAPH_NATS_URL":           e.nats.URL,
		"EPITAPH_SOURCE_NAME":        "main",
		"EPITAPH_SLOT":               e.slot,
		"EPITAPH_PARTITIONS":         "4",
		"EPITAPH_HEARTBEAT_INTERVAL": "100ms",
		"EPITAPH_DATA_DIR":           t.TempDir(),
		// The test broker does not sync on a timer: confirm on acks, so
		// the slot (and its synced copy) moves.
		"EPITAPH_BROKER_SYNC_INTERVAL": "-1s",
	})
	require.Eventually(t, func() bool { v, ok := p.active(); return ok && v == 1 }, 60*time.Second, 100*time.Millisecond)
	pid := p.pid()
	e.exec(t, `DELETE FROM items WHERE id <= 3`)
	e.exec(t, `DELETE FROM items WHERE id IN (4, 5)`)
	require.Len(t, e.deletes(t, "main", 5), 5)
	waitSyncedSlot(t, e, sb)

	require.NoError(t, pg.Kill())
	require.NoError(t, sb.Promote())
	e.exec(t, `DELETE FROM items WHERE id > 5`)
	e.exec(t, `INSERT INTO items VALUES (11, 'v11'); DELETE FROM items WHERE id = 11`)
	requirePromotionDeletes(t, e)
	require.Eventually(t, func() bool { v, ok := p.active(); return ok && v == 1 }, 30*time.Second, 100*time.Millisecond)
	require.Equal(t, pid, p.pid(), "the same process")
	p.mu.Lock()
	selfExit := p.selfExit
	p.mu.Unlock()
	require.Zero(t, selfExit, "the process never exited")
}

// TestIdleTimeoutInvalidationReported: PostgreSQL 18 invalidates a slot
// left inactive longer than idle_replication_slot_timeout (at a
// checkpoint). The capture refuses to start on it as on a slot
// max_slot_wal_keep_size invalidated, naming the cause, and with
// --recreate-slot records a gap.
func TestIdleTimeoutInvalidationReported(t *testing.T) {
	t.Parallel()
	if !testenv.HasMajor(18) {
		t.Skip("PostgreSQL 18 server binaries are missing (make test-deps installs them)")
	}
	pg := testenv.NewPostgresMajor(t, 18)
	e := &env{db: pg.NewDatabase(t), nats: testenv.NewNATS(t), dir: t.TempDir()}
	e.slot = dbName(t, e.db)
	_, e.js = e.nats.Connect(t)
	e.exec(t, `CREATE TABLE items (id int PRIMARY KEY, v text); ALTER TABLE items REPLICA IDENTITY FULL;
		INSERT INTO items VALUES (1, 'a'), (2, 'b')`)
	svc := e.start(t, nil)
	e.exec(t, `DELETE FROM items WHERE id = 1`)
	e.deletes(t, "main", 1)
	require.NoError(t, svc.Stop(context.Background()))

	e.exec(t, `ALTER SYSTEM SET idle_replication_slot_timeout = '1s'`)
	e.exec(t, `SELECT pg_reload_conf()`)
	deadline := time.Now().Add(60 * time.Second)
	for queryString(t, e.db, `SELECT coalesce(invalidation_reason, '') FROM pg_replication_slots WHERE slot_name = $1`, e.slot) != "idle_timeout" {
		if time.Now().After(deadline) {
			t.Fatal("the slot was not invalidated by idle_replication_slot_timeout after 60s")
		}
		e.exec(t, `CHECKPOINT`)
		time.Sleep(200 * time.Millisecond)
	}
	e.exec(t, `ALTER SYSTEM RESET idle_replication_slot_timeout`)
	e.exec(t, `SELECT pg_reload_conf()`)
	requireFix(t, e.startErr(t, nil), "invalidated (idle_timeout: inactive longer than idle_replication_slot_timeout)", "--recreate-slot")

	e.exec(t, `DELETE FROM items WHERE id = 2`) // lost: the slot cannot read it
	e.start(t, func(c *Config) { c.RecreateSlot = true })
	var gaps int
	for _, m := range e.messages(t, "main", 0) {
		if m.ev.Op == event.OpGap {
			gaps++
			require.Contains(t, m.ev.Reason, "idle_replication_slot_timeout")
		}
	}
	require.Equal(t, 4, gaps, "a gap on every partition")
}
