package e2e_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/bench"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/internal/workload"
)

// TestMarkInsideADeletingTransactionKeepsItsRows: an application marks a
// point inside the transaction that deletes (a batch job's
// pg_logical_emit_message(true, 'epitaph.mark', ...) between its
// DELETEs). The real capture publishes the mark between the
// transaction's rows, on every partition; the real projector archives
// every row of it, quarantines nothing and records no gap.
func TestMarkInsideADeletingTransactionKeepsItsRows(t *testing.T) {
	t.Parallel()
	bins := binaries(t)
	seed := testSeed(t)
	url := testenv.NewDatabase(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	require.NoError(t, workload.Setup(ctx, url))
	_, err := workload.Seed(ctx, url, workload.SeedConfig{Customers: 20, OrdersPerCustomer: 4})
	require.NoError(t, err)

	broker := testenv.NewNATS(t)
	metrics, err := bench.LocalAddr()
	require.NoError(t, err)
	const slot = "epitaph_e2e_marks"
	cenv := bench.CaptureEnv(url, broker.URL, "", t.TempDir(), metrics, "main", slot)
	supervise(t, "capture", bins["capture"], cenv, seed)
	watch, err := bench.WatchStream(broker.URL, "main")
	require.NoError(t, err)
	defer watch.Close()
	require.NoError(t, bench.WaitCaptureReady(ctx, watch, url, slot, captureReadyTimeout, nil))
	superviseProjectors(t, bins["projector"], url, broker.URL, 1, seed)

	testenv.Exec(t, url, `BEGIN;
		DELETE FROM public.orders WHERE id <= 10;
		SELECT pg_logical_emit_message(true, 'epitaph.mark', 'halfway');
		DELETE FROM public.orders WHERE id BETWEEN 11 AND 20;
		COMMIT`)
	expected, err := workload.Expected(ctx, url)
	require.NoError(t, err)
	require.Greater(t, len(expected), 20, "twenty orders with their children")
	err = workload.WaitFor(ctx, 2*time.Minute, 250*time.Millisecond, func(ctx context.Context) (bool, error) {
		n, err := bench.Count(ctx, url, "SELECT count(*) FROM archive.rows WHERE source = 'main'")
		return n >= int64(len(expected)), err
	})
	require.NoError(t, err, "%d rows archived\n%s", len(expected), pipelineState(ctx, url, watch))
	rep, err := workload.VerifyArchive(ctx, url, expected)
	require.NoError(t, err)
	require.True(t, rep.OK(), rep.String())
	for _, q := range []string{`SELECT count(*) FROM epitaph.quarantine`, `SELECT count(*) FROM archive.gaps`} {
		n, err := bench.Count(ctx, url, q)
		require.NoError(t, err)
		require.Zero(t, n, q)
	}
}
