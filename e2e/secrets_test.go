package e2e_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/bench"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/internal/workload"
)

// Planted secrets: they must appear in no output of either binary.
const (
	plantedPassword = "PlantedPw7731"
	plantedToken    = "PlantedTok4419"
)

// withPassword puts the planted password into a postgres:// URL.
func withPassword(url string) string {
	return strings.Replace(url, "postgres://postgres@", "postgres://postgres:"+plantedPassword+"@", 1)
}

// tokenServer is a real JetStream server that requires the planted token.
func tokenServer(t *testing.T) (listen string) {
	t.Helper()
	port, err := testenv.FreePort()
	require.NoError(t, err)
	s, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: port, JetStream: true, StoreDir: t.TempDir(),
		Authorization: plantedToken, NoLog: true, NoSigs: true})
	require.NoError(t, err)
	go s.Start()
	t.Cleanup(s.Shutdown)
	require.True(t, s.ReadyForConnections(20*time.Second))
	return fmt.Sprintf("127.0.0.1:%d", port)
}

// TestSecretsAppearInNoOutput runs both real binaries with a password in
// EPITAPH_SOURCE_URL and EPITAPH_TARGET_URL and a token in EPITAPH_NATS_URL
// and reads every output: -h, --help, a flag typo, startup logs, connection
// errors, /status, /metrics, /healthz and the projector's status page. The
// planted strings are nowhere; each output is checked to be the real one
// (so an empty output cannot pass).
func TestSecretsAppearInNoOutput(t *testing.T) {
	t.Parallel()
	bins := binaries(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	url := testenv.NewDatabase(t)
	testenv.Exec(t, url, `CREATE TABLE items (id int PRIMARY KEY); ALTER TABLE items REPLICA IDENTITY FULL; INSERT INTO items VALUES (1), (2)`)
	listen := tokenServer(t)
	natsURL := "nats://" + plantedToken + "@" + listen
	secretEnv := []string{"EPITAPH_SOURCE_URL=" + withPassword(url), "EPITAPH_TARGET_URL=" + withPassword(url), "EPITAPH_NATS_URL=" + natsURL,
		"EPITAPH_DATA_DIR=" + t.TempDir()}

	outputs := map[string]string{} // what -> text
	var runFor func(bin string, env []string, d time.Duration, args ...string) string
	check := func(what, text, mustContain string) {
		t.Helper()
		outputs[what] = text
		require.Contains(t, text, mustContain, "%s is the real output:\n%s", what, text)
	}
	run := func(bin string, env []string, args ...string) string {
		t.Helper()
		return runFor(bin, env, time.Minute, args...)
	}
	runFor = func(bin string, env []string, d time.Duration, args ...string) string {
		t.Helper()
		cctx, ccancel := context.WithTimeout(ctx, d)
		defer ccancel()
		cmd := exec.CommandContext(cctx, bin, args...)
		cmd.Env = append(append(os.Environ(), secretEnv...), env...)
		out, _ := cmd.CombinedOutput() // help and typos exit non-zero for some commands; the text is what counts
		return string(out)
	}

	// Usage texts.
	check("capture -h", run(bins["capture"], nil, "-h"), "-nats-creds")
	check("capture --help", run(bins["capture"], nil, "--help"), "-source-url")
	check("capture typo", run(bins["capture"], nil, "--nats-ulr", "x"), "unknown flag: --nats-ulr")
	check("projector -h", run(bins["projector"], nil, "-h"), "Usage:")
	check("projector run -h", run(bins["projector"], nil, "run", "-h"), "-nats-creds")
	check("projector run --help", run(bins["projector"], nil, "run", "--help"), "(EPITAPH_TARGET_URL)") // defaults never come from the environment
	check("projector run typo", run(bins["projector"], nil, "run", "--target-ulr", "x"), "unknown flag: --target-ulr")
	check("projector status typo", run(bins["projector"], nil, "status", "--jsno"), "unknown flag: --jsno")
	check("projector wait typo", run(bins["projector"], nil, "wait", "--lns", "0/1"), "unknown flag: --lns")

	// Connection errors.
	closed, err := testenv.FreePort()
	require.NoError(t, err)
	deadNATS := fmt.Sprintf("EPITAPH_NATS_URL=nats://%s@127.0.0.1:%d", plantedToken, closed)
	deadPG := fmt.Sprintf("postgres://postgres:%s@127.0.0.1:%d/none?sslmode=disable", plantedPassword, closed)
	// The capture waits for an unreachable source or broker (logging the
	// error once): a few seconds of it are its output.
	check("capture NATS down", runFor(bins["capture"], []string{deadNATS, "EPITAPH_METRICS_ADDR=", "EPITAPH_SLOT=epitaph_sec_dead",
		"EPITAPH_PUBLICATION=epitaph_sec_dead", "EPITAPH_TABLES=public.items"}, 5*time.Second), "the broker is unreachable")
	check("capture source down", runFor(bins["capture"], []string{"EPITAPH_SOURCE_URL=" + deadPG, "EPITAPH_METRICS_ADDR="}, 5*time.Second), "the source is unreachable")
	check("projector migrate target down", run(bins["projector"], []string{"EPITAPH_TARGET_URL=" + deadPG}, "migrate"), "projector:")
	check("projector status NATS down", run(bins["projector"], []string{deadNATS}, "status"), "unreachable")
	check("projector run bad URL", run(bins["projector"], []string{"EPITAPH_TARGET_URL=postgres://postgres:" + plantedPassword + "@127.0.0.1:" +
		fmt.Sprint(closed) + "/x?sslmode=bogus"}, "run", "--metrics-addr", ""), "projector:")

	// Running processes: logs and endpoints.
	logs := t.TempDir()
	cm, err := bench.LocalAddr()
	require.NoError(t, err)
	cp, err := bench.StartProc("capture", bins["capture"], append(append([]string(nil), secretEnv...), "EPITAPH_METRICS_ADDR="+cm,
		"EPITAPH_SLOT=epitaph_sec", "EPITAPH_PUBLICATION=epitaph_sec", "EPITAPH_TABLES=public.items", "EPITAPH_PARTITIONS=2",
		"EPITAPH_BROKER_SYNC_INTERVAL=-1s"), logs)
	require.NoError(t, err)
	defer cp.Kill()
	waitHealthy(t, "http://"+cm+"/healthz", cp)
	pm, err := bench.LocalAddr()
	require.NoError(t, err)
	pp, err := bench.StartProc("projector", bins["projector"], append(append([]string(nil), secretEnv...), "EPITAPH_METRICS_ADDR="+pm,
		"EPITAPH_WORKER_ID=sec-1", "EPITAPH_CAPTURE_STATUS_URL=http://"+cm+"/status"), logs, "run")
	require.NoError(t, err)
	defer pp.Kill()
	waitHealthy(t, "http://"+pm+"/healthz", pp)
	testenv.Exec(t, url, `DELETE FROM items`)
	require.NoError(t, waitArchived(ctx, url, 2))

	_, body := httpBody(t, "http://"+cm+"/status")
	check("capture /status", body, `"nats_url"`)
	require.Contains(t, body, "xxxxx", "the NATS URL is shown redacted")
	_, body = httpBody(t, "http://"+cm+"/metrics")
	check("capture /metrics", body, "epitaph_capture_")
	_, body = httpBody(t, "http://"+pm+"/status")
	check("projector /status", body, "archive")
	_, body = httpBody(t, "http://"+pm+"/metrics")
	check("projector /metrics", body, "epitaph_projector_")
	_, body = httpBody(t, "http://"+pm+"/")
	check("projector status page", body, "<html")
	check("projector status", run(bins["projector"], nil, "status"), "archive")
	check("projector status --json", run(bins["projector"], nil, "status", "--json"), "archive")

	pp.Quit()
	cp.Quit()
	select {
	case <-pp.Done():
	case <-time.After(time.Minute):
	}
	select {
	case <-cp.Done():
	case <-time.After(time.Minute):
	}
	clog, err := os.ReadFile(cp.LogPath)
	require.NoError(t, err)
	check("capture log", string(clog), "capture starting")
	plog, err := os.ReadFile(pp.LogPath)
	require.NoError(t, err)
	check("projector log", string(plog), "projector running")

	for what, text := range outputs {
		require.NotContains(t, text, plantedPassword, "%s shows the password:\n%s", what, text)
		require.NotContains(t, text, plantedToken, "%s shows the NATS token:\n%s", what, text)
	}
}

func waitArchived(ctx context.Context, url string, n int64) error {
	return workload.WaitFor(ctx, 2*time.Minute, 100*time.Millisecond, func(ctx context.Context) (bool, error) {
		got, err := bench.Count(ctx, url, `SELECT count(*) FROM archive.rows`)
		return got >= n, err
	})
}
