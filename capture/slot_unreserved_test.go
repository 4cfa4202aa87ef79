package capture

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// A slot past max_slot_wal_keep_size (wal_status "unreserved": its WAL is
// removed at the next checkpoint) has no WAL left before invalidation.
// PostgreSQL reports a negative safe_wal_size then; the alert
// EpitaphSlotWALNearLimit keeps only samples >= 0 of
// epitaph_capture_slot_safe_wal_bytes (-1 means unlimited), so a negative
// gauge would silence (and resolve) it exactly when the slot is lost next.
func TestSlotPastItsWALLimitShowsNoSafeWALLeft(t *testing.T) {
	pg := testenv.NewPostgres(t)
	admin := pg.URL("postgres")
	testenv.Exec(t, admin, `ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'`)
	testenv.Exec(t, admin, `SELECT pg_reload_conf()`)
	e := &env{db: pg.NewDatabase(t), nats: testenv.NewNATS(t), dir: t.TempDir()}
	e.slot = dbName(t, e.db)
	_, e.js = e.nats.Connect(t)
	testenv.Exec(t, e.db, `CREATE TABLE t (id int PRIMARY KEY); ALTER TABLE t REPLICA IDENTITY FULL; CREATE TABLE filler (x text)`)
	svc := e.start(t, nil)
	require.Eventually(t, func() bool { return svc.activeState.Load() }, 60*time.Second, 20*time.Millisecond)

	ctx := context.Background()
	// An open transaction that wrote keeps the slot's restart_lsn behind.
	hold, err := pgx.Connect(ctx, e.db)
	require.NoError(t, err)
	defer hold.Close(ctx)
	tx, err := hold.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // test cleanup
	_, err = tx.Exec(ctx, `INSERT INTO t VALUES (1)`)
	require.NoError(t, err)

	var status string
	var safe *int64
	require.Eventually(t, func() bool {
		testenv.Exec(t, e.db, `INSERT INTO filler SELECT repeat('x', 1000) FROM generate_series(1, 100)`)
		testenv.Exec(t, e.db, `SELECT pg_switch_wal()`)
		require.NoError(t, queryRow(t, e.db, `SELECT wal_status, safe_wal_size FROM pg_replication_slots WHERE slot_name = $1`,
			[]any{e.slot}, &status, &safe))
		return status == "unreserved" && safe != nil && *safe < 0
	}, 60*time.Second, 200*time.Millisecond, "the slot passes max_slot_wal_keep_size")
	t.Logf("wal_status %s, safe_wal_size %d", status, *safe)

	// The capture polls the slot every 5 s.
	time.Sleep(2 * slotPollInterval)
	require.NoError(t, queryRow(t, e.db, `SELECT wal_status FROM pg_replication_slots WHERE slot_name = $1`, []any{e.slot}, &status))
	require.Equal(t, "unreserved", status, "no checkpoint invalidated the slot meanwhile")
	var m dto.Metric
	require.NoError(t, svc.m.safeWAL.Write(&m))
	got := m.GetGauge().GetValue()
	require.GreaterOrEqual(t, got, 0.0, "epitaph_capture_slot_safe_wal_bytes of a slot past its limit: no WAL left, never a value the alert skips")
	require.GreaterOrEqual(t, svc.CurrentStatus().SlotStats.SafeBytes, int64(0), "/status slot_stats.safe_wal_bytes")
}
