package e2e_test

import (
	"context"
	"fmt"
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

// TestManyWorkersShareEightPartitions: four projector processes share the
// eight partitions of one target while a cascading-delete workload runs;
// one is SIGKILLed (and stays dead) and a fifth joins mid-run. The dead
// worker's partitions are taken over, the newcomer gets its share, every
// partition ends owned by a live worker within the fair share, and the
// archive holds exactly the deleted rows.
func TestManyWorkersShareEightPartitions(t *testing.T) {
	t.Parallel()
	bins := binaries(t)
	seed := testSeed(t)
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 11))

	url := testenv.NewDatabase(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	require.NoError(t, workload.Setup(ctx, url))
	_, err := workload.Seed(ctx, url, workload.SeedConfig{Customers: 400, OrdersPerCustomer: 10})
	require.NoError(t, err)

	listen, err := bench.LocalAddr()
	require.NoError(t, err)
	natsURL := "nats://" + listen
	metrics, err := bench.LocalAddr()
	require.NoError(t, err)
	dataDir := t.TempDir()
	capture := supervise(t, "capture", bins["capture"],
		joinEnv(bench.CaptureEnv(url, "", listen, dataDir, metrics, "main", "epitaph_e2e_workers"), "EPITAPH_HEARTBEAT_INTERVAL=1s"), seed)
	projectorCreds := broker.ProjectorCreds(capturepkg.EmbeddedCredsDir(dataDir))
	creds, err := bench.WaitCreds(ctx, projectorCreds, time.Minute)
	require.NoError(t, err)
	watch, err := bench.WatchStream(natsURL, "main", creds)
	require.NoError(t, err)
	defer watch.Close()
	require.NoError(t, bench.WaitCaptureReady(ctx, watch, url, "epitaph_e2e_workers", captureReadyTimeout, nil))

	logs := t.TempDir()
	startWorker := func(i int) *bench.Proc {
		m, err := bench.LocalAddr()
		require.NoError(t, err)
		env := joinEnv(bench.ProjectorEnv(url, natsURL, m, "main", fmt.Sprintf("worker-%d", i)), "EPITAPH_LEASE_TTL=3s",
			"EPITAPH_NATS_CREDS="+projectorCreds)
		p, err := bench.StartProc(fmt.Sprintf("projector-%d", i), bins["projector"], env, logs, "run")
		require.NoError(t, err)
		t.Cleanup(func() {
			if t.Failed() {
				t.Logf("---- projector-%d ----\n%s", i, p.LogTail(2000))
			}
			_ = p.Stop(20 * time.Second)
		})
		return p
	}
	workers := map[int]*bench.Proc{}
	for i := range 4 {
		workers[i] = startWorker(i)
	}
	owners := func() map[string]int {
		out := map[string]int{}
		c, err := bench.Count(ctx, url, `SELECT count(*) FROM epitaph.progress WHERE owner IS NOT NULL AND lease_expires_at > now()`)
		if err != nil || c == 0 {
			return out
		}
		for i := range 6 {
			n, err := bench.Count(ctx, url, `SELECT count(*) FROM epitaph.progress WHERE owner = $1 AND lease_expires_at > now()`, fmt.Sprintf("worker-%d", i))
			if err == nil && n > 0 {
				out[fmt.Sprintf("worker-%d", i)] = int(n)
			}
		}
		return out
	}
	require.NoError(t, workload.WaitFor(ctx, time.Minute, 200*time.Millisecond, func(context.Context) (bool, error) {
		o := owners()
		return len(o) == 4 && o["worker-0"] == 2 && o["worker-1"] == 2 && o["worker-2"] == 2 && o["worker-3"] == 2, nil
	}), "four workers share eight partitions two each: %v", owners())

	type outcome struct {
		res workload.Result
		err error
	}
	done := make(chan outcome, 1)
	go func() {
		res, err := workload.Run(ctx, url, workload.Plan{Seed: seed, Transactions: 400, MaxOrdersPerTx: 20, Reinserts: 3,
			Pause: 15 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))})
		done <- outcome{res, err}
	}()
	wait := func() {
		select {
		case <-ctx.Done():
		case <-time.After(time.Duration(1000+rng.IntN(2000)) * time.Millisecond):
		}
	}
	wait()
	victim := rng.IntN(4)
	workers[victim].Kill()
	t.Logf("SIGKILLed worker-%d", victim)
	wait()
	workers[4] = startWorker(4)
	t.Logf("started worker-4")
	out := <-done
	require.NoError(t, out.err)
	t.Logf("workload: %+v", out.res)

	// The dead worker's partitions are taken over, the newcomer has its
	// share: eight partitions, each owned by a live worker, at most two each.
	require.NoError(t, workload.WaitFor(ctx, time.Minute, 200*time.Millisecond, func(context.Context) (bool, error) {
		o := owners()
		total := 0
		for _, n := range o {
			if n > 2 {
				return false, nil
			}
			total += n
		}
		return total == 8 && len(o) == 4 && o[fmt.Sprintf("worker-%d", victim)] == 0 && o["worker-4"] > 0, nil
	}), "eight partitions among the four live workers: %v", owners())

	expected, err := workload.Expected(ctx, url)
	require.NoError(t, err)
	require.Equal(t, out.res.Deleted, int64(len(expected)))
	if _, err := watch.WaitDeletes(ctx, int64(len(expected)), 2*time.Minute, nil); err != nil {
		t.Fatalf("%v\n%s", err, pipelineState(ctx, url, watch))
	}
	var archived int64
	if err := workload.WaitFor(ctx, 2*time.Minute, 250*time.Millisecond, func(ctx context.Context) (bool, error) {
		n, err := bench.Count(ctx, url, "SELECT count(*) FROM archive.rows WHERE source = 'main'")
		archived = n
		return n >= int64(len(expected)), err
	}); err != nil {
		t.Fatalf("archive has %d of %d rows: %v\n%s", archived, len(expected), err, pipelineState(ctx, url, watch))
	}
	rep, err := workload.VerifyArchive(ctx, url, expected)
	require.NoError(t, err)
	t.Logf("archive verification: %s", rep.String())
	require.True(t, rep.OK(), rep.String())
	t.Logf("%s", capture.Stats())
}
