package e2e_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	capturepkg "github.com/epitaph-dev/epitaph/capture"
	"github.com/epitaph-dev/epitaph/internal/bench"
	"github.com/epitaph-dev/epitaph/internal/broker"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/internal/workload"
)

// LargeRowOverhead is the memory a process may use beyond twice the largest
// row it carries: a row of S bytes costs the capture and the projector at
// most 2*S + LargeRowOverhead of peak RSS (the README and docs/operator.md
// state the rule).
const LargeRowOverhead = 64 << 20

// TestLargeRowPeakRSS deletes one row of 100 MiB (a text column) and
// follows it through the real capture (with its embedded broker, which
// keeps the row in its object store) and a projector into the archive. The
// row is archived byte for byte, and each process's peak RSS (VmHWM) stays
// within 2*S + LargeRowOverhead, S the size of the row's JSON image.
func TestLargeRowPeakRSS(t *testing.T) {
	if testing.Short() {
		t.Skip("a 100 MiB row through two processes")
	}
	t.Parallel()
	bins := binaries(t)
	url := testenv.NewDatabase(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	const bodyLen = 100 << 20
	testenv.Exec(t, url, `CREATE TABLE public.docs (id int PRIMARY KEY, body text);
		ALTER TABLE public.docs REPLICA IDENTITY FULL`)
	testenv.Exec(t, url, `INSERT INTO public.docs SELECT 1, string_agg(md5(i::text), '') FROM generate_series(1, $1) i`, bodyLen/32)
	want := queryText(ctx, t, url, `SELECT md5(body) || ':' || length(body) FROM public.docs WHERE id = 1`)
	// S: the row's JSON image as the capture encodes it.
	size := int64(bodyLen + len(`{"id":1,"body":""}`))
	bound := 2*size + LargeRowOverhead
	// Deployed as the manifests do: the Go runtime's soft memory limit at
	// ~90% of the container's limit, here the bound (the rest is memory
	// the runtime does not count: the binary's pages).
	memLimit := fmt.Sprintf("GOMEMLIMIT=%d", bound-bound/10)

	listen, err := bench.LocalAddr()
	require.NoError(t, err)
	metrics, err := bench.LocalAddr()
	require.NoError(t, err)
	dataDir := t.TempDir()
	cenv := joinEnv(bench.CaptureEnv(url, "", listen, dataDir, metrics, "main", "epitaph_e2e_bigrow"),
		"EPITAPH_TABLES=public.docs", "EPITAPH_HEARTBEAT_INTERVAL=1s", memLimit)
	capture := supervise(t, "capture", bins["capture"], cenv, 1)
	projectorCreds := broker.ProjectorCreds(capturepkg.EmbeddedCredsDir(dataDir))
	creds, err := bench.WaitCreds(ctx, projectorCreds, time.Minute)
	require.NoError(t, err)
	watch, err := bench.WatchStream("nats://"+listen, "main", creds)
	require.NoError(t, err)
	defer watch.Close()
	require.NoError(t, bench.WaitCaptureReady(ctx, watch, url, "epitaph_e2e_bigrow", captureReadyTimeout, nil))
	pm, err := bench.LocalAddr()
	require.NoError(t, err)
	projector := supervise(t, "projector", bins["projector"], joinEnv(bench.ProjectorEnv(url, "nats://"+listen, pm, "main", "worker-0"),
		"EPITAPH_NATS_CREDS="+projectorCreds, memLimit), 2, "run")
	require.NoError(t, workload.WaitFor(ctx, time.Minute, 100*time.Millisecond, func(ctx context.Context) (bool, error) {
		n, err := bench.Count(ctx, url, `SELECT count(*) FROM epitaph.projection_versions`)
		return n > 0, err
	}), "the projector set up its read model")

	idle := map[string]int64{}
	for name, s := range map[string]*supervised{"capture": capture, "projector": projector} {
		idle[name], err = s.current().PeakRSS()
		require.NoError(t, err)
	}
	testenv.Exec(t, url, `DELETE FROM public.docs`)
	require.NoError(t, workload.WaitFor(ctx, 5*time.Minute, 250*time.Millisecond, func(ctx context.Context) (bool, error) {
		n, err := bench.Count(ctx, url, `SELECT count(*) FROM archive.rows WHERE source = 'main' AND table_name = 'docs'`)
		return n == 1, err
	}), "the row is archived")
	got := queryText(ctx, t, url, `SELECT md5(row->>'body') || ':' || length(row->>'body') FROM archive.rows WHERE table_name = 'docs' AND (row->>'id')::int = 1`)
	require.Equal(t, want, got, "the archived body is the deleted one")

	peaks := map[string]int64{}
	for name, s := range map[string]*supervised{"capture": capture, "projector": projector} {
		peaks[name], err = s.current().PeakRSS()
		require.NoError(t, err)
		t.Logf("%s: VmHWM idle %.1f MiB, after the row %.1f MiB; the row is %.1f MiB, the bound 2*S + 64 MiB = %.1f MiB (%d starts)",
			name, float64(idle[name])/(1<<20), float64(peaks[name])/(1<<20), float64(size)/(1<<20), float64(bound)/(1<<20), s.starts)
	}
	for name, peak := range peaks {
		require.LessOrEqual(t, peak, bound, "%s peak RSS", name)
	}
	for name, s := range map[string]*supervised{"capture": capture, "projector": projector} {
		require.Equal(t, 1, s.starts, "%s never restarted", name)
	}
}

func queryText(ctx context.Context, t *testing.T, url, sql string) string {
	t.Helper()
	conn, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer conn.Close(ctx)
	var v string
	require.NoError(t, conn.QueryRow(ctx, sql).Scan(&v))
	return v
}
