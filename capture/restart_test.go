package capture

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// requireOnce checks that no message id appears twice and that the stream
// holds each deleted id exactly once.
func requireOnce(t *testing.T, ms []msg, wantDeletes int) {
	t.Helper()
	ids := map[string]uint64{}
	keys := map[string]int{}
	for _, m := range ms {
		if prev, dup := ids[m.msgID]; dup {
			t.Fatalf("message id %s stored twice (sequences %d and %d)", m.msgID, prev, m.seq)
		}
		ids[m.msgID] = m.seq
		if m.ev.Op == event.OpDelete {
			keys[m.ev.QualifiedTable()+string(m.ev.Key)]++
		}
	}
	require.Len(t, keys, wantDeletes)
	for k, n := range keys {
		require.Equal(t, 1, n, "row %s", k)
	}
}

// TestRestartNeverDuplicates stops the capture in the middle of a large
// transaction, with nothing confirmed to the slot (a long broker sync
// interval), and restarts it after the dedupe window has passed: Postgres
// re-sends everything, and only the messages after the stream's last
// position are published.
func TestRestartNeverDuplicates(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE items (id int PRIMARY KEY, pad text); ALTER TABLE items REPLICA IDENTITY FULL;
		INSERT INTO items SELECT i, repeat('p', 100) FROM generate_series(1, 30000) i`)
	cfg := func(c *Config) {
		c.BrokerSyncInterval = time.Hour // nothing is ever confirmed
		c.DuplicateWindow = time.Second
		c.MaxInFlight = 64
	}
	svc := e.start(t, cfg)
	e.exec(t, `DELETE FROM items WHERE id <= 10`)
	e.exec(t, `SELECT pg_logical_emit_message(false, 'epitaph.mark', 'between')`)
	e.exec(t, `DELETE FROM items WHERE id > 10`) // one big transaction
	// Stop once part of the big transaction is in the stream.
	ctx := context.Background()
	st, err := e.js.Stream(ctx, event.StreamName("main"))
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		info, err := st.Info(ctx)
		return err == nil && info.State.Msgs > 1000
	}, 60*time.Second, 5*time.Millisecond)
	require.NoError(t, svc.Stop(context.Background()))
	require.NoError(t, svc.Wait())
	info, err := st.Info(ctx)
	require.NoError(t, err)
	require.Less(t, info.State.Msgs, uint64(30000+2+4), "stopped inside the big transaction")
	var confirmed *string
	require.NoError(t, queryRow(t, e.db, `SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1`, []any{e.slot}, &confirmed))

	time.Sleep(1500 * time.Millisecond) // let the dedupe window pass: only positions protect now
	svc = e.start(t, cfg)
	ms := e.messages(t, "main", 30000+2+4)
	require.NoError(t, svc.Stop(context.Background()))
	require.NoError(t, svc.Wait())
	require.Len(t, ms, 30000+2+4)
	requireOnce(t, ms, 30000)
	require.NotNil(t, confirmed)
	c, err := event.ParseLSN(*confirmed)
	require.NoError(t, err)
	require.Less(t, c, ms[0].ev.CommitLSN, "nothing was confirmed: the restart re-read everything")

	// A third run with more deletes after the stream's tail.
	e.start(t, cfg)
	e.exec(t, `INSERT INTO items VALUES (1, 'again'); DELETE FROM items`)
	ms = e.messages(t, "main", 30000+2+4+2)
	require.Len(t, ms, 30000+2+4+2)
	last := ms[len(ms)-2].ev
	require.JSONEq(t, `{"id":1,"pad":"again"}`, string(last.Row))
	ids := map[string]bool{}
	for _, m := range ms {
		require.False(t, ids[m.msgID], "duplicate %s", m.msgID)
		ids[m.msgID] = true
	}
}

// TestGapFailsClosed drops the slot under a stream that already holds
// events: capture refuses, and with RecreateSlot records a gap on every
// partition and carries on.
func TestGapFailsClosed(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE g (id int PRIMARY KEY); INSERT INTO g VALUES (1), (2), (3)`)
	svc := e.start(t, nil)
	e.exec(t, `DELETE FROM g WHERE id = 1`)
	before := e.messages(t, "main", 2)
	require.NoError(t, svc.Stop(context.Background()))
	require.NoError(t, svc.Wait())
	testenv.DropSlot(t, e.db, e.slot)       // once its walsender has exited
	e.exec(t, `DELETE FROM g WHERE id = 2`) // lost: no slot

	err := e.startErr(t, nil)
	requireFix(t, err, "is missing", "--recreate-slot", "may have been lost")

	e.start(t, func(c *Config) { c.RecreateSlot = true })
	e.exec(t, `DELETE FROM g WHERE id = 3`)
	ms := e.messages(t, "main", 2+4+2)
	require.Equal(t, []string{"delete public.g", "commit", "gap", "gap", "gap", "gap", "delete public.g", "commit"}, ops(ms))
	parts := map[int]bool{}
	for _, m := range ms[2:6] {
		require.Equal(t, before[0].ev.CommitLSN, m.ev.FromLSN)
		require.Greater(t, m.ev.ToLSN, m.ev.FromLSN)
		require.Contains(t, m.ev.Reason, "missing")
		require.Equal(t, event.GapSubject("main", m.ev.Partition), m.subject)
		parts[m.ev.Partition] = true
	}
	require.Len(t, parts, 4)
	require.JSONEq(t, `{"id":3}`, string(ms[6].ev.Row))
}
