package main

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/broker"
	"github.com/epitaph-dev/epitaph/internal/natsconn"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// statusRun runs the real binary and returns its exit code, stdout and
// stderr.
func statusRun(t *testing.T, bin string, env []string, args ...string) (int, string, string) {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Env = env
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	return exitCode(err), out.String(), errOut.String()
}

// TestStatusCheckWhenItCannotMeasure runs the real projector against a
// broker that requires credentials: with the projector's credentials
// `status --check` passes; without them, with another broker's
// credentials, with NATS unreachable or the target unreachable it exits 1
// and says why; the lag it could not measure is "unknown" (null in JSON),
// never 0; once the worker stopped, everything is measured and --check
// exits 3.
func TestStatusCheckWhenItCannotMeasure(t *testing.T) {
	t.Parallel()
	bin := build(t)
	url := testenv.NewDatabase(t)
	authDir := filepath.Join(t.TempDir(), "nats")
	n := testenv.NewNATSWith(t, broker.Config{Auth: &broker.Auth{Dir: authDir, Source: "main"}})
	// A second broker with its own keys: its credentials are valid
	// credentials the first broker refuses.
	otherDir := filepath.Join(t.TempDir(), "nats")
	testenv.NewNATSWith(t, broker.Config{Auth: &broker.Auth{Dir: otherDir, Source: "main"}})

	nc, err := nats.Connect(n.URL, natsconn.UserCredentials(broker.CaptureCreds(authDir)))
	require.NoError(t, err)
	defer nc.Close()
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	createMainStream(t, js, 2)

	port, err := testenv.FreePort()
	require.NoError(t, err)
	base := append(os.Environ(), "EPITAPH_TARGET_URL="+url, "EPITAPH_SOURCE_URL=", "EPITAPH_NATS_URL="+n.URL,
		"EPITAPH_WORKER_ID=status-1", "EPITAPH_LEASE_TTL=2s", "EPITAPH_METRICS_ADDR=127.0.0.1:"+strconv.Itoa(port),
		"EPITAPH_NATS_CREDS=")
	good := append(base[:len(base):len(base)], "EPITAPH_NATS_CREDS="+broker.ProjectorCreds(authDir))
	run := exec.Command(bin, "run")
	run.Env = good
	var logs syncBuffer
	run.Stdout, run.Stderr = &logs, &logs
	require.NoError(t, run.Start())
	t.Cleanup(func() { _ = run.Process.Kill(); _ = run.Wait() })

	deadline := time.Now().Add(time.Minute)
	for {
		code, out, errOut := statusRun(t, bin, good, "status", "--check")
		if code == 0 {
			require.Contains(t, out, "archive_v1")
			break
		}
		require.True(t, time.Now().Before(deadline), "status --check never passed: %d\n%s%s\nprojector:\n%s", code, out, errOut, logs.String())
		time.Sleep(200 * time.Millisecond)
	}

	type lagDoc struct {
		StreamError string `json:"stream_error"`
		Versions    []struct {
			State      string   `json:"state"`
			LagEvents  *uint64  `json:"lag_events"`
			Oldest     *float64 `json:"oldest_pending_age_seconds"`
			LagUnknown string   `json:"lag_unknown"`
			Partitions []struct {
				LagEvents  *uint64  `json:"lag_events"`
				LagSeconds *float64 `json:"lag_seconds"`
				LagUnknown string   `json:"lag_unknown"`
			} `json:"partitions"`
		} `json:"versions"`
	}
	decode := func(out string) lagDoc {
		t.Helper()
		var d lagDoc
		require.NoError(t, json.Unmarshal([]byte(out), &d), out)
		require.NotEmpty(t, d.Versions, out)
		return d
	}
	code, out, errOut := statusRun(t, bin, good, "status", "--json")
	require.Equal(t, 0, code, errOut)
	d := decode(out)
	require.NotNil(t, d.Versions[0].LagEvents, "a measured lag is a number: %s", out)
	require.Empty(t, d.Versions[0].LagUnknown, out)

	noCreds := base
	wrongCreds := append(base[:len(base):len(base)], "EPITAPH_NATS_CREDS="+broker.ProjectorCreds(otherDir))
	unreachable := append(good[:len(good):len(good)], "EPITAPH_NATS_URL=nats://127.0.0.1:1")
	for _, tc := range []struct {
		name string
		env  []string
		why  string
	}{
		{"no credentials", noCreds, "refused the credentials"},
		{"another broker's credentials", wrongCreds, "refused the credentials"},
		{"NATS unreachable", unreachable, "unreachable"},
	} {
		code, out, errOut := statusRun(t, bin, tc.env, "status", "--check")
		require.Equal(t, 1, code, "%s: status --check\n%s%s", tc.name, out, errOut)
		require.Contains(t, errOut, tc.why, tc.name)
		require.Contains(t, errOut, "status check cannot tell: archive v1 lag unknown", tc.name)
		require.Contains(t, out, "lag unknown: NATS", tc.name)
		row := ""
		for _, line := range strings.Split(out, "\n") {
			if strings.HasPrefix(line, "archive ") {
				row = line
				break
			}
		}
		require.Contains(t, row, "unknown", "%s: the version's lag column:\n%s", tc.name, out)

		code, out, errOut = statusRun(t, bin, tc.env, "status", "--json")
		require.Equal(t, 0, code, "%s: status --json without --check prints\n%s", tc.name, errOut)
		d := decode(out)
		require.Contains(t, d.StreamError, tc.why, tc.name)
		for _, v := range d.Versions {
			require.Nil(t, v.LagEvents, "%s: an unmeasured lag is null: %s", tc.name, out)
			require.Nil(t, v.Oldest, tc.name)
			require.Contains(t, v.LagUnknown, tc.why, tc.name)
			for _, p := range v.Partitions {
				require.Nil(t, p.LagEvents, tc.name)
				require.Nil(t, p.LagSeconds, tc.name)
				require.Contains(t, p.LagUnknown, tc.why, tc.name)
			}
		}
		require.NotContains(t, out+errOut, "SUAC", "%s: a seed in the output", tc.name)
	}

	deadTarget := append(good[:len(good):len(good)], "EPITAPH_TARGET_URL=postgres://epitaph:secret@127.0.0.1:1/none")
	code, out, errOut = statusRun(t, bin, deadTarget, "status", "--check")
	require.Equal(t, 1, code, "target unreachable\n%s%s", out, errOut)
	require.Contains(t, errOut, "target database postgres://epitaph:xxxxx@127.0.0.1:1/none cannot be read")
	require.NotContains(t, errOut, "secret")

	// A stopped worker releases its leases: measured, unhealthy, exit 3.
	require.NoError(t, run.Process.Signal(syscall.SIGTERM))
	require.NoError(t, run.Wait())
	code, out, errOut = statusRun(t, bin, good, "status", "--check")
	require.Equal(t, 3, code, "%s%s", out, errOut)
	require.Contains(t, errOut, "status check failed: archive v1 is unavailable")
}
