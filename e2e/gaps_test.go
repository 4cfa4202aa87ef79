package e2e_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/bench"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// Readers are told about a recreated slot, through the real binaries: the
// capture is stopped, its slot dropped, rows deleted meanwhile (lost: no slot
// kept their WAL), and the capture restarted with --recreate-slot. The
// archive then has one lost_upstream row in archive.gaps, archive.status is
// not ready, `projector wait --lsn` for an LSN inside the gap exits 3 naming
// the gap, a far LSN exits 2 naming where the archive is; `projector gaps
// ack` makes it ready again and the same wait exits 0.
//
// Not parallel: it stops and starts the capture itself (no supervisor), and
// TestCaptureExactlyOnceUnderKills restarts the shared Postgres, which would
// end a capture no one restarts (seen under `go test ./e2e`).
func TestRecreatedSlotIsAGapReadersSee(t *testing.T) {
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

	const slot = "epitaph_e2e_gaps"
	listen, err := bench.LocalAddr()
	require.NoError(t, err)
	natsURL := "nats://" + listen
	cmetrics, err := bench.LocalAddr()
	require.NoError(t, err)
	dataDir := t.TempDir()
	cenv := joinEnv(bench.CaptureEnv(url, "", listen, dataDir, cmetrics, "main", slot),
		"EPITAPH_TABLES=public.items", "EPITAPH_PARTITIONS=2", "EPITAPH_HEARTBEAT_INTERVAL=300ms")
	logDir := t.TempDir()
	startCapture := func(extra ...string) *bench.Proc {
		p, err := bench.StartProc("capture", bins["capture"], joinEnv(cenv, extra...), logDir)
		require.NoError(t, err)
		t.Cleanup(p.Kill)
		return p
	}
	capture := startCapture()
	// The embedded broker requires credentials: the test and the projector
	// connect as the projector role the capture made.
	watch, err := bench.WatchStream(natsURL, "main", bench.EmbeddedCreds(dataDir))
	require.NoError(t, err)
	defer watch.Close()
	require.NoError(t, bench.WaitCaptureReady(ctx, watch, url, slot, captureReadyTimeout, nil), "capture ready")

	pmetrics, err := bench.LocalAddr()
	require.NoError(t, err)
	penv := joinEnv(bench.ProjectorEnv(url, natsURL, pmetrics, "main", "worker-0"), "EPITAPH_LEASE_TTL=3s",
		"EPITAPH_NATS_CREDS="+filepath.Join(dataDir, "nats", "projector.creds"))
	proj, err := bench.StartProc("projector", bins["projector"], penv, logDir, "run")
	require.NoError(t, err)
	t.Cleanup(proj.Kill)
	// Its control schema exists once it is healthy (wait reads it).
	waitHealthy(t, "http://"+pmetrics+"/healthz", proj)

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
	archived := func() int {
		n, err := bench.Count(ctx, url, `SELECT count(*) FROM archive.rows`)
		if err != nil {
			return -1
		}
		return int(n)
	}
	type status struct {
		ready    bool
		complete *string
		gaps     int
		reasons  []string
	}
	readStatus := func() (status, error) {
		var s status
		err := conn.QueryRow(ctx, `SELECT ready, complete_up_to_lsn::text, gaps_unacknowledged, not_ready_reasons
			FROM archive.status WHERE state = 'live'`).Scan(&s.ready, &s.complete, &s.gaps, &s.reasons)
		return s, err
	}
	poll := func(what string, cond func() bool) {
		t.Helper()
		deadline := time.Now().Add(120 * time.Second)
		for !cond() {
			if time.Now().After(deadline) {
				st, err := readStatus()
				inStream, serr := watch.Deletes(ctx)
				t.Fatalf("%s: not within 120s (archive.status %+v, %v; %d rows archived, %d deletes in the stream (%v))\n%s\n%s\n%s",
					what, st, err, archived(), inStream, serr, pipelineState(ctx, url, watch), capture.LogTail(4000), proj.LogTail(4000))
			}
			time.Sleep(100 * time.Millisecond)
		}
	}

	// Before: deletes archived, ready, wait exits 0.
	_, err = conn.Exec(ctx, `DELETE FROM public.items WHERE id <= 100`)
	require.NoError(t, err)
	first := lsnNow()
	out, code := projector("wait", "--lsn", first.String(), "--timeout", "120s")
	require.Equal(t, 0, code, out)
	require.Contains(t, out, "is complete up to")
	require.Equal(t, 100, archived())
	poll("ready before the gap", func() bool { s, err := readStatus(); return err == nil && s.ready })

	// The capture stops, its slot is dropped, deletes meanwhile are lost.
	require.NoError(t, capture.Stop(30*time.Second))
	testenv.DropSlot(t, url, slot) // once its walsender has exited
	_, err = conn.Exec(ctx, `DELETE FROM public.items WHERE id > 100 AND id <= 200`)
	require.NoError(t, err)
	inside := lsnNow()

	// Without --recreate-slot it refuses, naming the fix.
	refused := startCapture()
	select {
	case <-refused.Done():
	case <-time.After(60 * time.Second):
		t.Fatalf("the capture did not refuse a missing slot\n%s", refused.LogTail(2000))
	}
	require.Contains(t, refused.LogTail(4000), "--recreate-slot")
	capture = startCapture("EPITAPH_RECREATE_SLOT=true")
	poll("slot recreated", func() bool {
		n, err := bench.Count(ctx, url, `SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1`, slot)
		return err == nil && n == 1
	})
	_, err = conn.Exec(ctx, `DELETE FROM public.items WHERE id > 200`)
	require.NoError(t, err)
	last := lsnNow()
	poll("deletes after the gap archived", func() bool { return archived() == 200 })

	// One lost_upstream row: every table, every partition, from the last
	// position the stream had to where the new slot starts.
	var id int64
	var kind, from, to string
	var schema, table *string
	var partition *int
	poll("the gap row", func() bool {
		err := conn.QueryRow(ctx, `SELECT id, kind, schema_name, table_name, partition, from_lsn::text, to_lsn::text
			FROM archive.gaps`).Scan(&id, &kind, &schema, &table, &partition, &from, &to)
		return err == nil
	})
	require.Equal(t, 1, int(must(bench.Count(ctx, url, `SELECT count(*) FROM archive.gaps`))))
	require.Equal(t, "lost_upstream", kind)
	require.Nil(t, schema)
	require.Nil(t, table)
	require.Nil(t, partition)
	fromLSN, err := event.ParseLSN(from)
	require.NoError(t, err)
	toLSN, err := event.ParseLSN(to)
	require.NoError(t, err)
	require.Less(t, fromLSN, inside, "the gap starts before the lost deletes")
	require.GreaterOrEqual(t, toLSN, inside, "and ends after them")

	// Readers are told: not ready, complete only up to the gap's start.
	poll("complete up to the gap", func() bool {
		s, err := readStatus()
		return err == nil && s.complete != nil && *s.complete == from
	})
	st, err := readStatus()
	require.NoError(t, err)
	require.False(t, st.ready)
	require.Equal(t, 1, st.gaps)
	require.Contains(t, st.reasons, "1 unacknowledged gaps")

	// wait: inside the gap exits 3 naming it; before it, 0; far ahead, 2.
	out, code = projector("wait", "--lsn", inside.String(), "--timeout", "30s")
	require.Equal(t, 3, code, out)
	require.Contains(t, out, fmt.Sprintf("gap %d (lost_upstream)", id))
	out, code = projector("wait", "--lsn", first.String(), "--timeout", "30s")
	require.Equal(t, 0, code, out)
	out, code = projector("wait", "--lsn", (last + 0x10000000).String(), "--timeout", "1s")
	require.Equal(t, 3, code, out, "a far LSN is past the gap too")
	out, code = projector("wait", "--lsn", "nonsense")
	require.Equal(t, 1, code, out)

	// gaps lists it; ack needs a reason, then the archive is ready again.
	out, code = projector("gaps", "--json")
	require.Equal(t, 0, code, out)
	var listed []struct {
		Version int `json:"version"`
		Gaps    []struct {
			ID      int64  `json:"id"`
			Kind    string `json:"kind"`
			FromLSN string `json:"from_lsn"`
		} `json:"gaps"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &listed), out)
	require.Len(t, listed, 1)
	require.Len(t, listed[0].Gaps, 1)
	require.Equal(t, id, listed[0].Gaps[0].ID)
	require.Equal(t, from, listed[0].Gaps[0].FromLSN)
	out, code = projector("gaps")
	require.Equal(t, 0, code, out)
	require.Contains(t, out, "lost_upstream")
	// status --check: the live version misses deletes nobody accepted.
	out, code = projector("status", "--check")
	require.Equal(t, 3, code, out)
	require.Contains(t, out, "archive v1 misses deletes: 1 unacknowledged gaps (lost_upstream; projector gaps)")
	out, code = projector("gaps", "ack", strconv.FormatInt(id, 10))
	require.Equal(t, 2, code, out, "a usage error")
	require.Contains(t, out, "--reason")
	out, code = projector("gaps", "ack", strconv.FormatInt(id, 10), "--reason", "slot dropped in the test; rows 101-200 are known lost")
	require.Equal(t, 0, code, out)
	require.Contains(t, out, "acknowledged")
	var reason string
	require.NoError(t, conn.QueryRow(ctx, `SELECT ack_reason FROM archive.gaps WHERE id = $1 AND acknowledged_at IS NOT NULL`, id).Scan(&reason))
	require.Equal(t, "slot dropped in the test; rows 101-200 are known lost", reason)

	poll("ready after the ack", func() bool { s, err := readStatus(); return err == nil && s.ready })
	out, code = projector("wait", "--lsn", last.String(), "--timeout", "120s")
	require.Equal(t, 0, code, out)
	out, code = projector("wait", "--lsn", (last + 0x10000000).String(), "--timeout", "1s")
	require.Equal(t, 2, code, out)
	require.Contains(t, out, "timed out")
	require.Contains(t, out, "complete up to ")
	require.NotContains(t, out, "complete up to 0/0")

	// The status command shows the gap; once accepted, --check passes.
	out, code = projector("status", "--check")
	require.Equal(t, 0, code, out)
	out, code = projector("status")
	require.Equal(t, 0, code, out)
	require.Contains(t, out, "archive v1 gaps")
	require.Contains(t, out, "slot dropped in the test")
	require.True(t, strings.Contains(out, "lost_upstream"), out)
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}
