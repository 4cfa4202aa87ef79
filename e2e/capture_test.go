package e2e_test

import (
	"context"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/bench"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/internal/workload"
)

// TestCaptureExactlyOnceUnderKills runs the delete workload while the real
// capture binary is SIGKILLed and restarted at random points, Postgres is
// restarted and the JetStream server is restarted, and checks that at the
// end the stream holds every deleted row exactly once, every value equal.
func TestCaptureExactlyOnceUnderKills(t *testing.T) {
	t.Parallel()
	bins := binaries(t)
	seed := testSeed(t)
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 2))

	pg := testenv.NewPostgres(t)
	url := pg.NewDatabase(t)
	nats := testenv.NewNATS(t)
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	require.NoError(t, workload.Setup(ctx, url))
	_, err := workload.Seed(ctx, url, workload.SeedConfig{Customers: 300, OrdersPerCustomer: 10})
	require.NoError(t, err)

	metrics, err := bench.LocalAddr()
	require.NoError(t, err)
	dataDir := t.TempDir() // the signing key, kept across the kills
	env := bench.CaptureEnv(url, nats.URL, "", dataDir, metrics, "main", "epitaph_e2e_capture")
	// A Postgres fast shutdown waits for every logical walsender's client to
	// confirm all sent WAL; a capture trailing its confirmations by the
	// external server's default sync interval (2m) would hold the shutdown
	// past pg_ctl's timeout. 2s keeps the trailing (and the replay after
	// each kill) without that.
	capture := supervise(t, "capture", bins["capture"], joinEnv(env, "EPITAPH_HEARTBEAT_INTERVAL=1s", "EPITAPH_BROKER_SYNC_INTERVAL=2s"), seed)
	watch, err := bench.WatchStream(nats.URL, "main")
	require.NoError(t, err)
	defer watch.Close()
	require.NoError(t, bench.WaitCaptureReady(ctx, watch, url, "epitaph_e2e_capture", captureReadyTimeout, nil),
		"the capture makes its stream and slot before the first delete")

	// A workload of a fixed size runs while the faults happen (those after
	// its end test recovery with nothing new to read).
	type outcome struct {
		res workload.Result
		err error
	}
	done := make(chan outcome, 1)
	go func() {
		res, err := workload.Run(ctx, url, workload.Plan{Seed: seed, Transactions: 350, MaxOrdersPerTx: 10, BigTxRows: 5000, BigTxAt: 30 + int(seed%60), Reinserts: 4,
			Pause: 15 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))})
		done <- outcome{res, err}
	}()
	faults := chaos(ctx, rng, 500*time.Millisecond, 2*time.Second, map[string]func(){
		"kill-capture-1": capture.Kill,
		"kill-capture-2": capture.Kill,
		"kill-capture-3": capture.Kill,
		"kill-capture-4": capture.Kill,
		"restart-postgres": func() {
			require.NoError(t, pg.Restart())
		},
		"restart-jetstream": nats.Restart,
	})
	out := <-done
	require.NoError(t, out.err)
	t.Logf("faults: %s", summary(faults))
	t.Logf("workload: %+v", out.res)
	t.Logf("%s", capture.Stats())

	expected, err := workload.Expected(ctx, url)
	require.NoError(t, err)
	require.Equal(t, out.res.Deleted, int64(len(expected)))
	require.Greater(t, len(expected), 5000, "the big transaction alone deletes 5,000 rows")

	// Wait for the stream to hold as many deletes as were made, then give a
	// restarted capture the chance to add any duplicate before checking.
	if _, err = watch.WaitDeletes(ctx, int64(len(expected)), 3*time.Minute, nil); err != nil {
		// Say which rows, and keep the stream for diagnosis.
		report := "(no report)"
		if events, serr := workload.StreamDeletes(ctx, nats.URL, "main"); serr == nil {
			if rep, verr := workload.VerifyStream(ctx, url, expected, events); verr == nil {
				report = rep.String()
			}
		}
		t.Fatalf("%v\nstream verification: %s\nstream dump: %s", err, report, keepStreamDump(t, nats.URL, "main"))
	}
	// One more SIGKILL at the very end: the restarted capture must not
	// republish what the stream has. Its next heartbeat shows it streaming
	// again past the point where a re-send would have appeared.
	capture.Kill()
	last, err := watch.LastSeq(ctx)
	require.NoError(t, err)
	require.NoError(t, watch.WaitProgress(ctx, last, time.Minute))
	last, err = watch.LastSeq(ctx)
	require.NoError(t, err)
	require.NoError(t, watch.WaitProgress(ctx, last, time.Minute))

	events, err := workload.StreamDeletes(ctx, nats.URL, "main")
	require.NoError(t, err)
	rep, err := workload.VerifyStream(ctx, url, expected, events)
	require.NoError(t, err)
	t.Logf("stream verification: %s", rep.String())
	require.True(t, rep.OK(), rep.String())
	require.Equal(t, len(expected), len(events))

	// And as a projector checks it: every delete is a member of a
	// transaction signed with the capture's key, its rows matching the
	// signed digest.
	pubPEM, err := os.ReadFile(filepath.Join(dataDir, "signing.pub"))
	require.NoError(t, err)
	pub, err := event.ParsePublicKey(pubPEM)
	require.NoError(t, err)
	verified, err := workload.VerifiedDeletes(ctx, nats.URL, "main", pub)
	require.NoError(t, err)
	rep, err = workload.VerifyStream(ctx, url, expected, verified)
	require.NoError(t, err)
	require.True(t, rep.OK(), "verified deletes: %s", rep.String())
	require.Equal(t, len(expected), len(verified))
}
