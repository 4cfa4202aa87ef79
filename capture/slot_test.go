package capture

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// TestSlotRecreatedWhileStoppedIsNotResumedSilently drops the capture's
// slot while the capture is stopped, deletes a row (lost: no slot), and
// has someone else create a slot of the same name again before the capture
// starts (an HA tool recreating "its" slots on a promoted server does the
// same). The new slot starts past the delete: resuming from it as the
// capture's own would lose the delete without a word. The capture refuses,
// as for a missing slot, and with --recreate-slot records a gap covering
// the lost delete.
func TestSlotRecreatedWhileStoppedIsNotResumedSilently(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE g (id int PRIMARY KEY); ALTER TABLE g REPLICA IDENTITY FULL; INSERT INTO g VALUES (1), (2), (3)`)
	svc := e.start(t, nil)
	e.exec(t, `DELETE FROM g WHERE id = 1`)
	e.messages(t, "main", 2)
	require.NoError(t, svc.Stop(context.Background()))
	require.NoError(t, svc.Wait())
	testenv.DropSlot(t, e.db, e.slot)
	e.exec(t, `DELETE FROM g WHERE id = 2`) // lost: no slot
	lost, err := event.ParseLSN(queryString(t, e.db, `SELECT pg_current_wal_lsn()::text`))
	require.NoError(t, err)
	e.exec(t, `SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, e.slot)

	svc2, err := New(e.config(), WithLogger(testLogger(t)))
	require.NoError(t, err)
	t.Cleanup(func() { _ = svc2.Stop(context.Background()) })
	err = svc2.Start(context.Background())
	require.Error(t, err, "the capture resumed on a slot someone else created after its own was dropped: the delete of id 2 is lost without a gap")
	requireFix(t, err, "past", "--recreate-slot", "may have been lost")

	e.start(t, func(c *Config) { c.RecreateSlot = true })
	e.exec(t, `DELETE FROM g WHERE id = 3`)
	ms := e.messages(t, "main", 2+4+2)
	require.Equal(t, []string{"delete public.g", "commit", "gap", "gap", "gap", "gap", "delete public.g", "commit"}, ops(ms))
	for _, m := range ms[2:6] {
		require.LessOrEqual(t, m.ev.FromLSN, ms[1].ev.CommitLSN)
		require.GreaterOrEqual(t, m.ev.ToLSN, lost, "the gap covers the lost delete")
	}
	require.JSONEq(t, `{"id":3}`, string(ms[6].ev.Row))
}

// TestSlotPastRecordOnlyWhenPastBothRecords: a slot is taken for someone
// else's only when it starts past both the recorded confirmed position and
// the stream's tail, with a record, and not as a promoted standby's copy.
func TestSlotPastRecordOnlyWhenPastBothRecords(t *testing.T) {
	t.Parallel()
	s := func(v string) *string { return &v }
	slot := slotState{exists: true, slotType: "logical", plugin: "pgoutput", database: "db", confirmed: s("0/300")}
	synced := slot
	synced.synced = true
	for _, c := range []struct {
		name string
		slot slotState
		tail tail
		past bool
	}{
		{"past the record and the tail", slot, tail{has: true, pos: position{lsn: 0x100}, recorded: 0x200}, true},
		{"at the record", slot, tail{has: true, pos: position{lsn: 0x100}, recorded: 0x300}, false},
		{"at the tail", slot, tail{has: true, pos: position{lsn: 0x300}, recorded: 0x200}, false},
		{"no record", slot, tail{has: true, pos: position{lsn: 0x100}}, false},
		{"no stream", slot, tail{recorded: 0x200}, false},
		{"a promoted standby's synced copy", synced, tail{has: true, pos: position{lsn: 0x100}, recorded: 0x200}, false},
	} {
		_, past := slotPastRecord(c.slot, c.tail)
		require.Equal(t, c.past, past, c.name)
		p, err := planSlot(c.slot, "epitaph", "db", c.tail, "EPITAPH_MAIN", false)
		if c.past {
			requireFix(t, err, "past", "--recreate-slot")
			p, err = planSlot(c.slot, "epitaph", "db", c.tail, "EPITAPH_MAIN", true)
			require.NoError(t, err)
			require.Equal(t, slotPlan{gap: p.gap}, p, "a healthy slot is kept; the gap is recorded")
			require.NotEmpty(t, p.gap)
			continue
		}
		require.NoError(t, err, c.name)
		require.Equal(t, slotPlan{}, p, c.name)
	}
}
