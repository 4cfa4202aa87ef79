package capture

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// TestStreamExistsOnlyOnceTheSlotDoes: on a first start the stream is
// created after the replication slot, so anyone who sees the stream (a
// projector, a script waiting for it before deleting) can rely on every
// delete from then on being captured. Creating a logical slot waits for the
// transactions running on the server to end; the test holds one open, so
// the capture is stopped inside slot creation, and the stream must not
// exist yet.
func TestStreamExistsOnlyOnceTheSlotDoes(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	e.exec(t, `CREATE TABLE items (id int PRIMARY KEY, v text);
		ALTER TABLE items REPLICA IDENTITY FULL;
		INSERT INTO items SELECT g, 'item ' || g FROM generate_series(1, 3) g`)

	holder, err := pgx.Connect(ctx, e.db)
	require.NoError(t, err)
	defer holder.Close(context.Background())
	tx, err := holder.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.Background()) }()
	_, err = tx.Exec(ctx, `SELECT pg_current_xact_id()`) // takes an xid: slot creation waits for it
	require.NoError(t, err)

	svc := newService(t, e.config())
	started := make(chan error, 1)
	go func() { started <- svc.Start(ctx) }()

	// The capture is inside CREATE_REPLICATION_SLOT once the slot shows.
	require.Eventually(t, func() bool {
		var n int
		err := holder.QueryRow(ctx, `SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1`, e.slot).Scan(&n)
		return err == nil && n == 1
	}, time.Minute, 20*time.Millisecond, "the capture starts creating its slot")
	_, err = e.js.Stream(ctx, event.StreamName("main"))
	require.True(t, errors.Is(err, jetstream.ErrStreamNotFound), "the stream exists before the slot is made: %v", err)
	select {
	case err := <-started:
		t.Fatalf("capture started while slot creation had to wait: %v", err)
	default:
	}

	require.NoError(t, tx.Rollback(ctx))
	require.NoError(t, <-started)
	_, err = e.js.Stream(ctx, event.StreamName("main"))
	require.NoError(t, err, "the stream exists once the capture has started")
	e.exec(t, `DELETE FROM items WHERE id = 2`)
	ms := e.deletes(t, "main", 1)
	require.Len(t, ms, 1)
	require.JSONEq(t, `{"id":2}`, string(ms[0].ev.Key))
}

// TestFailedFirstStartLeavesNoSlot: when the stream cannot be created on a
// first start (here: another stream already takes its subjects), the
// capture fails with an error naming the stream and drops the slot it had
// just created, so a misconfigured first start leaves nothing holding WAL
// on the source.
func TestFailedFirstStartLeavesNoSlot(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx := context.Background()
	e.exec(t, `CREATE TABLE items (id int PRIMARY KEY, v text); ALTER TABLE items REPLICA IDENTITY FULL`)
	_, err := e.js.CreateStream(ctx, jetstream.StreamConfig{Name: "SQUATTER", Subjects: []string{event.StreamSubjects("main")}})
	require.NoError(t, err)
	err = e.startErr(t, nil)
	require.Contains(t, err.Error(), "create stream EPITAPH_MAIN")
	require.Contains(t, err.Error(), "overlap")
	require.Equal(t, "0", queryString(t, e.db, `SELECT count(*)::text FROM pg_replication_slots WHERE slot_name = $1`, e.slot),
		"a failed first start leaves no slot")
	_, err = e.js.Stream(ctx, event.StreamName("main"))
	require.True(t, errors.Is(err, jetstream.ErrStreamNotFound), "no stream either: %v", err)

	// Once the other stream is gone, the next start makes both and captures.
	require.NoError(t, e.js.DeleteStream(ctx, "SQUATTER"))
	e.start(t, nil)
	e.exec(t, `INSERT INTO items VALUES (1, 'a'); DELETE FROM items`)
	require.Len(t, e.deletes(t, "main", 1), 1)
}

// Creating the slot waits for every transaction holding an xid in the
// cluster, another database's too: while it waits, the capture says so and
// names the blocker (its pid, database, how long its transaction has been
// open), and keeps waiting; once the blocker commits, the capture starts.
// Not parallel: the open transaction would hold up every other test's slot.
func TestSlotCreationSaysWhatItWaitsFor(t *testing.T) {
	e := setup(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	blocker, err := pgx.Connect(ctx, testenv.NewDatabase(t))
	require.NoError(t, err)
	defer blocker.Close(context.WithoutCancel(ctx))
	tx, err := blocker.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(context.WithoutCancel(ctx))
	var xid int64
	require.NoError(t, tx.QueryRow(ctx, "SELECT txid_current()").Scan(&xid))
	var pid int
	require.NoError(t, tx.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid))

	var logs lockedBuffer
	svc, err := New(e.config(), WithLogger(slog.New(slog.NewTextHandler(io.MultiWriter(&logs, testLogWriter{t}), nil))))
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, svc.Stop(context.Background())) })
	started := make(chan error, 1)
	go func() { started <- svc.Start(ctx) }()
	want := fmt.Sprintf(`wait_event=Lock/transactionid blockers="[pid %d (database `, pid)
	require.Eventually(t, func() bool { return strings.Contains(logs.String(), want) }, 2*time.Minute, 50*time.Millisecond,
		"the capture names the blocker while it waits")
	require.Contains(t, logs.String(), `msg="creating the replication slot waits for transactions running in the cluster to end (in any database); still waiting" slot=`+e.slot)
	require.Contains(t, logs.String(), "idle in transaction, transaction open ")
	select {
	case err := <-started:
		require.Fail(t, "started while the slot could not be created", "err %v", err)
	default:
	}
	require.NoError(t, tx.Commit(ctx))
	select {
	case err := <-started:
		require.NoError(t, err)
	case <-time.After(2 * time.Minute):
		require.Fail(t, "the capture did not start once the blocker committed")
	}
	require.Equal(t, "1", queryString(t, e.db, `SELECT count(*)::text FROM pg_replication_slots WHERE slot_name = $1`, e.slot))
}
