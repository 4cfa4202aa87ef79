package main

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// SIGTERM while a webhook attempt hangs is still the soft stop the guides
// describe (docs/operator.md, "Signals and stops"; docs/upgrade.md: "a
// worker stopped with SIGTERM finishes its pages and hands its partitions
// over"): the attempt in flight does not hold the partitions until the
// stop's bound turns it hard; the leases are released, the worker
// deregisters and the process exits 0, well within the bound.
func TestSIGTERMWithAHangingWebhookStillStopsSoftly(t *testing.T) {
	t.Parallel()
	bin, url, n, js := startTarget(t, 1)
	ctx := context.Background()
	port, err := testenv.FreePort()
	require.NoError(t, err)

	arrived := make(chan struct{}, 16)
	release := make(chan struct{})
	hook := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		arrived <- struct{}{}
		select { // hangs until the test ends or the client gives up
		case <-release:
		case <-r.Context().Done():
		}
	}))
	t.Cleanup(func() { close(release); hook.Close() })

	env := append(os.Environ(), "EPITAPH_TARGET_URL="+url, "EPITAPH_SOURCE_URL=", "EPITAPH_NATS_URL="+n.URL,
		"EPITAPH_WORKER_ID=w1", "EPITAPH_LEASE_TTL=15s", fmt.Sprintf("EPITAPH_METRICS_ADDR=127.0.0.1:%d", port),
		"EPITAPH_ARCHIVE_TTL=")
	out, err := runBin(bin, env, "migrate")
	require.NoError(t, err, out)
	out, err = runBin(bin, env, "handlers", "add", "--table", "public.orders", "--kind", "webhook",
		"--target", hook.URL+"/hook", "--no-revalidate")
	require.NoError(t, err, out)

	logs := &syncBuffer{}
	cmd := exec.Command(bin, "run")
	cmd.Env = env
	cmd.Stdout, cmd.Stderr = logs, logs
	require.NoError(t, cmd.Start())
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() { _ = cmd.Process.Kill() })

	publishTx(t, js, 0, event.LSN(0x6000000), 1)
	select {
	case <-arrived:
	case <-time.After(60 * time.Second):
		t.Fatalf("the webhook was never called:\n%s", logs.String())
	}

	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	signalled := time.Now()
	select {
	case err := <-exited:
		require.NoError(t, err, "exit status after SIGTERM:\n%s", logs.String())
	case <-time.After(90 * time.Second):
		t.Fatalf("the projector did not stop:\n%s", logs.String())
	}
	took := time.Since(signalled)
	require.NotContains(t, logs.String(), "stopped hard", "the partitions' stop stayed soft")
	require.Less(t, took, 40*time.Second, "stopped within the bound with room to spare (the stop took %s)", took)

	conn, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer conn.Close(ctx)
	var owned, workers int
	require.NoError(t, conn.QueryRow(ctx, `SELECT count(*) FROM epitaph.progress WHERE owner IS NOT NULL`).Scan(&owned))
	require.Zero(t, owned, "the leases were released")
	require.NoError(t, conn.QueryRow(ctx, `SELECT count(*) FROM epitaph.workers WHERE worker_id = 'w1'`).Scan(&workers))
	require.Zero(t, workers, "the worker deregistered")
	var rows int
	require.NoError(t, conn.QueryRow(ctx, `SELECT count(*) FROM archive.rows`).Scan(&rows))
	require.Equal(t, 1, rows)
	var state string
	require.NoError(t, conn.QueryRow(ctx, `SELECT state FROM epitaph.deliveries`).Scan(&state))
	require.Contains(t, []string{"pending", "in_flight"}, state, "the cancelled attempt's delivery is attempted again")
	require.False(t, strings.Contains(logs.String(), "panic"), logs.String())
}
