package e2e_test

import (
	"context"
	"log/slog"
	"math/rand/v2"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	capturepkg "github.com/epitaph-dev/epitaph/capture"
	"github.com/epitaph-dev/epitaph/internal/bench"
	"github.com/epitaph-dev/epitaph/internal/broker"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/internal/workload"
)

// TestPipelineArchivesExactlyTheDeletedRows is the proof of the spine: the
// randomized workload (cascades, single-row deletes, a 50,000-row
// transaction, re-inserting a deleted key and deleting it again) runs while
// the capture (with its embedded JetStream, the single-machine default) and
// two projector workers are each SIGKILLed and restarted several times at
// random points. At the end the archive holds exactly the deleted rows: none
// missing, none twice, every value equal.
func TestPipelineArchivesExactlyTheDeletedRows(t *testing.T) {
	t.Parallel()
	bins := binaries(t)
	seed := testSeed(t)
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 3))

	url := testenv.NewDatabase(t) // source and target: the default setup
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	require.NoError(t, workload.Setup(ctx, url))
	_, err := workload.Seed(ctx, url, workload.SeedConfig{Customers: 1300, OrdersPerCustomer: 10})
	require.NoError(t, err)

	listen, err := bench.LocalAddr()
	require.NoError(t, err)
	natsURL := "nats://" + listen
	metrics, err := bench.LocalAddr()
	require.NoError(t, err)
	dataDir := t.TempDir()
	cenv := bench.CaptureEnv(url, "", listen, dataDir, metrics, "main", "epitaph_e2e_pipeline")
	capture := supervise(t, "capture", bins["capture"], joinEnv(cenv, "EPITAPH_HEARTBEAT_INTERVAL=1s"), seed)
	// The embedded broker requires credentials: everything else connects
	// as the projector role the capture made.
	projectorCreds := broker.ProjectorCreds(capturepkg.EmbeddedCredsDir(dataDir))
	creds, err := bench.WaitCreds(ctx, projectorCreds, time.Minute)
	require.NoError(t, err)
	watch, err := bench.WatchStream(natsURL, "main", creds)
	require.NoError(t, err)
	defer watch.Close()
	require.NoError(t, bench.WaitCaptureReady(ctx, watch, url, "epitaph_e2e_pipeline", captureReadyTimeout, nil),
		"the capture makes its stream and slot before the first delete")

	workers := superviseProjectors(t, bins["projector"], url, natsURL, 2, seed, "EPITAPH_NATS_CREDS="+projectorCreds)

	type outcome struct {
		res workload.Result
		err error
	}
	// A workload of a fixed size runs while the faults happen.
	done := make(chan outcome, 1)
	go func() {
		res, err := workload.Run(ctx, url, workload.Plan{Seed: seed, Transactions: 800, MaxOrdersPerTx: 20, BigTxRows: 50_000, BigTxAt: 40 + int(seed%40), Reinserts: 5,
			Pause: 10 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))})
		done <- outcome{res, err}
	}()
	faults := chaos(ctx, rng, 500*time.Millisecond, 2500*time.Millisecond, map[string]func(){
		"kill-capture-1":    capture.Kill,
		"kill-capture-2":    capture.Kill,
		"kill-capture-3":    capture.Kill,
		"kill-projector0-1": workers[0].Kill,
		"kill-projector0-2": workers[0].Kill,
		"kill-projector0-3": workers[0].Kill,
		"kill-projector1-1": workers[1].Kill,
		"kill-projector1-2": workers[1].Kill,
		"kill-projector1-3": workers[1].Kill,
	})
	out := <-done
	require.NoError(t, out.err)
	t.Logf("faults: %s", summary(faults))
	t.Logf("workload: %+v", out.res)
	all := append([]*supervised{capture}, workers...)
	for _, s := range all {
		t.Logf("%s", s.Stats())
	}
	defer func() {
		// The embedded server writes acknowledged messages a few
		// milliseconds later (persist mode async): a kill of the capture
		// can lose the stream's tail, which the source sends again and the
		// workers rewind over.
		for _, w := range workers {
			t.Logf("%s: stream tail lost and rewound %d times", w.name, w.LogCount("stream lost its tail"))
		}
	}()

	expected, err := workload.Expected(ctx, url)
	require.NoError(t, err)
	require.Equal(t, out.res.Deleted, int64(len(expected)))
	require.Greater(t, len(expected), 50_000, "the big transaction alone deletes 50,000 rows")
	reinserted := 0
	for _, r := range expected {
		if r.Gen > 0 {
			reinserted++
		}
	}
	require.Positive(t, reinserted, "re-inserted rows were deleted again")

	// First the stream, then the archive: a shortfall says which side lost
	// rows. A slow catch-up is logged with the pipeline's state.
	ended := time.Now()
	if _, err := watch.WaitDeletes(ctx, int64(len(expected)), 3*time.Minute, nil); err != nil {
		t.Fatalf("%v\n%s", err, pipelineState(ctx, url, watch))
	}
	t.Logf("stream complete %.1fs after the workload ended", time.Since(ended).Seconds())
	var archived int64
	slowLogged := false
	err = workload.WaitFor(ctx, 5*time.Minute, 250*time.Millisecond, func(ctx context.Context) (bool, error) {
		n, err := bench.Count(ctx, url, "SELECT count(*) FROM archive.rows WHERE source = 'main'")
		archived = n
		if n < int64(len(expected)) && !slowLogged && time.Since(ended) > 45*time.Second {
			slowLogged = true
			t.Logf("archive slow to catch up (%d of %d):\n%s", n, len(expected), pipelineState(ctx, url, watch))
		}
		return n >= int64(len(expected)), err
	})
	t.Logf("archive complete %.1fs after the workload ended", time.Since(ended).Seconds())
	if err != nil {
		for _, w := range workers {
			w.Quit()
		}
		t.Fatalf("archive has %d of %d rows: %v\n%s", archived, len(expected), err, pipelineState(ctx, url, watch))
	}

	// The embedded JetStream died with every capture kill: the stream, too,
	// holds each deleted row exactly once.
	events, err := workload.StreamDeletes(ctx, natsURL, "main", creds)
	require.NoError(t, err)
	srep, err := workload.VerifyStream(ctx, url, expected, events)
	require.NoError(t, err)
	t.Logf("stream verification: %s", srep.String())
	require.True(t, srep.OK(), srep.String())

	rep, err := workload.VerifyArchive(ctx, url, expected)
	require.NoError(t, err)
	t.Logf("archive verification: %s", rep.String())
	require.True(t, rep.OK(), rep.String())
}
