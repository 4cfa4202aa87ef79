package e2e_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/bench"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// A partition's unapplied tail deleted from the stream is a gap readers
// see, never silent loss, through the real binaries: while a target lags
// (its projector stopped), a transaction of 10 deletes is captured; the
// capture stops; a holder of a credential allowed to delete messages
// removes everything after what the target applied (the transaction's
// rows, its commit, the heartbeats after it); the capture restarts and
// captures another transaction. Its partition sequences continue above the
// deleted ones (the capture kept them outside the stream), so the lagging
// target records a removed_from_stream gap: not ready, `projector wait
// --lsn` inside the deleted transaction exits 3; the next transaction is
// archived.
//
// Not parallel: it stops and starts the capture itself, like
// TestRecreatedSlotIsAGapReadersSee.
func TestDeletedTailIsAGapReadersSee(t *testing.T) {
	bins := binaries(t)
	url := testenv.NewDatabase(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer conn.Close(ctx)
	_, err = conn.Exec(ctx, `CREATE TABLE public.items (id int PRIMARY KEY, v text);
		ALTER TABLE public.items REPLICA IDENTITY FULL;
		INSERT INTO public.items SELECT g, 'item ' || g FROM generate_series(1, 300) g`)
	require.NoError(t, err)

	const slot = "epitaph_e2e_tail"
	broker := testenv.NewNATS(t) // outlives the capture, as an external broker does
	_, js := broker.Connect(t)
	cmetrics, err := bench.LocalAddr()
	require.NoError(t, err)
	dataDir := t.TempDir()
	cenv := joinEnv(bench.CaptureEnv(url, broker.URL, "", dataDir, cmetrics, "main", slot),
		"EPITAPH_TABLES=public.items", "EPITAPH_PARTITIONS=1", "EPITAPH_HEARTBEAT_INTERVAL=300ms",
		// Confirmations do not trail the acknowledgements: the deleted
		// transaction is confirmed (not replayed) within the test.
		"EPITAPH_BROKER_SYNC_INTERVAL=-1s")
	logDir := t.TempDir()
	startCapture := func() *bench.Proc {
		p, err := bench.StartProc("capture", bins["capture"], cenv, logDir)
		require.NoError(t, err)
		t.Cleanup(p.Kill)
		return p
	}
	capture := startCapture()
	watch, err := bench.WatchStream(broker.URL, "main")
	require.NoError(t, err)
	defer watch.Close()
	require.NoError(t, bench.WaitCaptureReady(ctx, watch, url, slot, captureReadyTimeout, nil), "capture ready")

	pmetrics, err := bench.LocalAddr()
	require.NoError(t, err)
	penv := joinEnv(bench.ProjectorEnv(url, broker.URL, pmetrics, "main", "worker-0"), "EPITAPH_LEASE_TTL=3s")
	startProjector := func() *bench.Proc {
		p, err := bench.StartProc("projector", bins["projector"], penv, logDir, "run")
		require.NoError(t, err)
		t.Cleanup(p.Kill)
		waitHealthy(t, "http://"+pmetrics+"/healthz", p)
		return p
	}
	proj := startProjector()
	projector := func(args ...string) (string, int) {
		cmd := exec.Command(bins["projector"], args...)
		cmd.Env = append(os.Environ(), penv...)
		out, err := cmd.CombinedOutput()
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return string(out), ee.ExitCode()
		}
		require.NoError(t, err, string(out))
		return string(out), 0
	}
	lsnNow := func() event.LSN {
		var s string
		require.NoError(t, conn.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn()::text`).Scan(&s))
		l, err := event.ParseLSN(s)
		require.NoError(t, err)
		return l
	}
	archivedIDs := func() []int {
		rows, err := conn.Query(ctx, `SELECT (row->>'id')::int FROM archive.rows ORDER BY 1`)
		require.NoError(t, err)
		ids, err := pgx.CollectRows(rows, pgx.RowTo[int])
		require.NoError(t, err)
		return ids
	}
	poll := func(what string, cond func() bool) {
		t.Helper()
		deadline := time.Now().Add(120 * time.Second)
		for !cond() {
			if time.Now().After(deadline) {
				t.Fatalf("%s: not within 120s\n%s\n%s", what, capture.LogTail(4000), proj.LogTail(4000))
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	stream, err := js.Stream(ctx, event.StreamName("main"))
	require.NoError(t, err)
	partSeq := func(seq uint64) uint64 {
		m, err := stream.GetMsg(ctx, seq)
		require.NoError(t, err)
		n, err := strconv.ParseUint(m.Header.Get(event.HeaderPartitionSeq), 10, 64)
		require.NoError(t, err)
		return n
	}

	// Applied: the first transaction.
	_, err = conn.Exec(ctx, `DELETE FROM public.items WHERE id <= 100`)
	require.NoError(t, err)
	out, code := projector("wait", "--lsn", lsnNow().String(), "--timeout", "120s")
	require.Equal(t, 0, code, out)

	// The target lags; a transaction is captured meanwhile.
	require.NoError(t, proj.Stop(30*time.Second))
	applied, err := watch.LastSeq(ctx)
	require.NoError(t, err)
	_, err = conn.Exec(ctx, `DELETE FROM public.items WHERE id > 100 AND id <= 110`)
	require.NoError(t, err)
	inside := lsnNow()
	_, err = watch.WaitDeletes(ctx, 110, time.Minute, nil)
	require.NoError(t, err)
	// Confirmed to the slot (not replayed at the restart: the stream is
	// the only copy of it).
	poll("the transaction confirmed", func() bool {
		var s string
		if err := conn.QueryRow(ctx, `SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1`, slot).Scan(&s); err != nil {
			return false
		}
		l, err := event.ParseLSN(s)
		return err == nil && l >= inside
	})
	require.NoError(t, capture.Stop(30*time.Second))

	// Everything after what the target applied is deleted.
	last, err := watch.LastSeq(ctx)
	require.NoError(t, err)
	var deletedTop uint64 // of the transaction's messages
	for seq := applied + 1; seq <= last; seq++ {
		m, err := stream.GetMsg(ctx, seq)
		require.NoError(t, err)
		if !strings.HasSuffix(m.Subject, ".mark") {
			deletedTop = max(deletedTop, partSeq(seq))
		}
		require.NoError(t, stream.DeleteMsg(ctx, seq))
	}
	require.Positive(t, deletedTop)
	require.Greater(t, last-applied, uint64(10), "the ten rows and their commit at least")

	// The capture restarts and captures another transaction: its partition
	// sequences continue above the deleted ones.
	capture = startCapture()
	require.NoError(t, watch.WaitProgress(ctx, last, time.Minute))
	_, err = conn.Exec(ctx, `DELETE FROM public.items WHERE id > 110 AND id <= 120`)
	require.NoError(t, err)
	poll("the next transaction in the stream", func() bool {
		n, err := watch.Deletes(ctx)
		return err == nil && n == 110
	})
	after, err := watch.LastSeq(ctx)
	require.NoError(t, err)
	for seq := last + 1; seq <= after; seq++ {
		m, err := stream.GetMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		require.NoError(t, err)
		n, err := strconv.ParseUint(m.Header.Get(event.HeaderPartitionSeq), 10, 64)
		require.NoError(t, err)
		require.Greater(t, n, deletedTop, "message %d (%s) numbered over the deleted transaction", seq, m.Subject)
	}

	// The lagging target: the next transaction archived, the deleted one
	// inside a recorded gap, not ready, wait exits 3.
	proj = startProjector()
	poll("the next transaction archived", func() bool { return len(archivedIDs()) == 110 })
	ids := archivedIDs()
	for i, id := range ids {
		if i < 100 {
			require.Equal(t, i+1, id)
		} else {
			require.Equal(t, i+11, id, "rows 101-110 were deleted from the stream")
		}
	}
	poll("the gap row", func() bool {
		n, err := bench.Count(ctx, url, `SELECT count(*) FROM archive.gaps WHERE kind = 'removed_from_stream' AND acknowledged_at IS NULL`)
		return err == nil && n >= 1
	})
	var ready bool
	require.NoError(t, conn.QueryRow(ctx, `SELECT ready FROM archive.status WHERE state = 'live'`).Scan(&ready))
	require.False(t, ready)
	out, code = projector("wait", "--lsn", inside.String(), "--timeout", "30s")
	require.Equal(t, 3, code, out)
	require.Contains(t, out, "removed_from_stream")
}
