package e2e_test

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	capturepkg "github.com/epitaph-dev/epitaph/capture"
	"github.com/epitaph-dev/epitaph/internal/bench"
	"github.com/epitaph-dev/epitaph/internal/broker"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// TestEveryPartitionPassesABurstWithoutTheInterval runs the real capture,
// its heartbeat interval an hour, and a projector worker: right after a
// burst of one-row delete transactions (8 partitions), every partition's
// watermark (epitaph.progress.source_lsn) passes the source's WAL position
// at the burst's end within seconds, carried by the heartbeat the capture
// emits once the source is quiet (--heartbeat-quiet), and the archive holds
// every deleted row. EPITAPH_E2E_HEARTBEAT_QUIET sets the capture's
// --heartbeat-quiet (-1s: none, and the test fails).
func TestEveryPartitionPassesABurstWithoutTheInterval(t *testing.T) {
	t.Parallel()
	bins := binaries(t)
	url := testenv.NewDatabase(t) // source and target
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	const rows, partitions = 80, 8
	testenv.Exec(t, url, fmt.Sprintf(`CREATE TABLE public.burst (id int PRIMARY KEY, v text);
		ALTER TABLE public.burst REPLICA IDENTITY FULL;
		INSERT INTO public.burst SELECT g, 'row ' || g FROM generate_series(0, %d) g`, rows))

	listen, err := bench.LocalAddr()
	require.NoError(t, err)
	metrics, err := bench.LocalAddr()
	require.NoError(t, err)
	dataDir := t.TempDir()
	const slot = "epitaph_e2e_horizon"
	cenv := joinEnv(bench.CaptureEnv(url, "", listen, dataDir, metrics, "main", slot),
		"EPITAPH_TABLES=public.burst", "EPITAPH_HEARTBEAT_INTERVAL=1h")
	if q := os.Getenv("EPITAPH_E2E_HEARTBEAT_QUIET"); q != "" {
		cenv = joinEnv(cenv, "EPITAPH_HEARTBEAT_QUIET="+q)
	}
	capture := supervise(t, "capture", bins["capture"], cenv, 1)
	projectorCreds := broker.ProjectorCreds(capturepkg.EmbeddedCredsDir(dataDir))
	creds, err := bench.WaitCreds(ctx, projectorCreds, time.Minute)
	require.NoError(t, err)
	watch, err := bench.WatchStream("nats://"+listen, "main", creds)
	require.NoError(t, err)
	defer watch.Close()
	require.NoError(t, bench.WaitCaptureReady(ctx, watch, url, slot, captureReadyTimeout, nil))
	superviseProjectors(t, bins["projector"], url, "nats://"+listen, 1, 1, "EPITAPH_NATS_CREDS="+projectorCreds)

	conn, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer conn.Close(ctx)
	walEnd := func() string {
		var lsn string
		require.NoError(t, conn.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn()::text`).Scan(&lsn))
		return lsn
	}
	// count runs a count query; -1 when it fails (logged: the conditions
	// below run on require.Eventually's goroutines).
	count := func(query string, args ...any) int64 {
		n, err := bench.Count(ctx, url, query, args...)
		if err != nil {
			t.Logf("%s: %v", query, err)
			return -1
		}
		return n
	}
	// passed is how many partitions of the live archive version have their
	// watermark at or past lsn.
	passed := func(lsn string) int64 {
		return count(`SELECT count(*) FROM epitaph.progress p JOIN epitaph.projection_versions v USING (projection, version)
			WHERE p.projection = 'archive' AND v.state = 'live' AND p.source_lsn >= $1::pg_lsn`, lsn)
	}
	archived := func() int64 { return count(`SELECT count(*) FROM archive.rows WHERE table_name = 'burst'`) }

	// A first delete: once the worker archived it, every partition passes
	// it with no other transaction after it.
	_, err = conn.Exec(ctx, `DELETE FROM public.burst WHERE id = 0`)
	require.NoError(t, err)
	first := walEnd()
	require.Eventually(t, func() bool { return archived() == 1 }, 2*time.Minute, 50*time.Millisecond,
		"the worker archives the first delete\n%s", capture.logTail(2000))
	require.Eventually(t, func() bool { return passed(first) == partitions }, 5*time.Second, 20*time.Millisecond,
		"every partition past the first delete %s within 5 s of its archiving", first)

	for id := 1; id <= rows; id++ {
		_, err := conn.Exec(ctx, `DELETE FROM public.burst WHERE id = $1`, id)
		require.NoError(t, err)
	}
	end, burstEnd := walEnd(), time.Now()
	for passed(end) < partitions {
		if time.Since(burstEnd) > 5*time.Second {
			t.Fatalf("%d of %d partitions past the burst's end %s after 5 s\n%s", passed(end), partitions, end, pipelineState(ctx, url, watch))
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("every partition past the burst's end %s %s after it", end, time.Since(burstEnd).Round(time.Millisecond))
	require.Equal(t, int64(rows+1), archived(), "every deleted row archived")
}
