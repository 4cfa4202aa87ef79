package main

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/cmd/internal/cli"
)

// A malformed or out-of-range setting is refused with one line naming it,
// never replaced by a default (which would hide the misconfiguration).
func TestBadEnvironmentIsRefused(t *testing.T) {
	t.Parallel()
	vars := map[string]string{
		"EPITAPH_TARGET_URL":    "postgres://nobody:secret@127.0.0.1:1/none",
		"EPITAPH_LEASE_TTL":     "fifteen seconds",
		"EPITAPH_BATCH_SIZE":    "lots",
		"EPITAPH_REBUILD_SHARE": "half",

		"EPITAPH_HOLD_ON_QUARANTINE": "sometimes",
		"EPITAPH_MAX_ROW_BYTES":      "1GB",
		"EPITAPH_LOG_LEVEL":          "loud",
	}
	code, _, stderr := projector(t, vars, "run")
	require.Equal(t, 2, code)
	require.Equal(t, 1, strings.Count(stderr, "\n"), stderr)
	require.Contains(t, stderr, `EPITAPH_LEASE_TTL="fifteen seconds": not a duration`)
	require.Contains(t, stderr, `EPITAPH_BATCH_SIZE="lots": not an integer`)
	require.Contains(t, stderr, `EPITAPH_REBUILD_SHARE="half": not a number`)
	require.Contains(t, stderr, `EPITAPH_HOLD_ON_QUARANTINE="sometimes": not a boolean (true or false)`)
	require.Contains(t, stderr, `EPITAPH_MAX_ROW_BYTES="1GB": not an integer`)
	require.Contains(t, stderr, `EPITAPH_LOG_LEVEL="loud": want one of debug, info, warn, error`)

	// Values that used to become defaults silently are refused.
	code, _, stderr = projector(t, map[string]string{"EPITAPH_TARGET_URL": vars["EPITAPH_TARGET_URL"],
		"EPITAPH_BATCH_SIZE": "0", "EPITAPH_LEASE_TTL": "0s", "EPITAPH_REBUILD_SHARE": "1.5"}, "run")
	require.Equal(t, 2, code)
	require.Contains(t, stderr, `EPITAPH_BATCH_SIZE="0": must be at least 1`)
	require.Contains(t, stderr, `EPITAPH_LEASE_TTL="0s": must be positive`)
	require.Contains(t, stderr, `EPITAPH_REBUILD_SHARE="1.5": must be at most 1`)
	require.NotContains(t, stderr, "secret")

	code, _, stderr = projector(t, map[string]string{"EPITAPH_SNAPSHOT_MAX_ATTEMPTS": "8x"}, "snapshots", "batch")
	require.Equal(t, 2, code)
	require.Contains(t, stderr, `EPITAPH_SNAPSHOT_MAX_ATTEMPTS="8x": not an integer`)

	// The command line is checked the same way.
	code, _, stderr = projector(t, nil, "run", "--batch-size", "501")
	require.Equal(t, 2, code)
	require.Contains(t, stderr, `invalid argument "501" for "--batch-size" flag: must be at most 500`)
}

// projector runs the command line in process with exactly vars as the
// environment; it returns the exit code, stdout and stderr.
func projector(t *testing.T, vars map[string]string, args ...string) (int, string, string) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	env := &Env{LookupEnv: func(k string) (string, bool) { v, ok := vars[k]; return v, ok },
		Stdin: strings.NewReader(""), Stdout: &stdout, Stderr: &stderr, Logger: slog.New(slog.DiscardHandler)}
	err := dispatch(context.Background(), args, env)
	code := cli.Report(&stderr, "projector", err)
	return code, stdout.String(), stderr.String()
}

// Contradictory NATS credentials are refused before anything connects.
func TestNATSAuthFlagsAreChecked(t *testing.T) {
	t.Parallel()
	vars := map[string]string{"EPITAPH_TARGET_URL": "postgres://nobody@127.0.0.1:1/none", "EPITAPH_NATS_NKEY": "/x/seed"}
	env := &Env{Getenv: func(k string) string { return vars[k] }, Stdout: io.Discard, Stderr: io.Discard, Logger: slog.New(slog.DiscardHandler)}
	for _, cmd := range [][]string{{"run", "--nats-creds", "/x/c.creds"}, {"status", "--nats-creds", "/x/c.creds"}, {"quarantine", "list", "--nats-creds", "/x/c.creds"}} {
		err := dispatch(context.Background(), cmd, env)
		require.ErrorContains(t, err, "NATS credentials given twice (--nats-creds, --nats-nkey)", "%v", cmd)
	}
}

// A setting the projector refuses before it connects is a usage error
// (exit 2), as docs/cli gives a bad value, wherever it came from.
func TestRunSettingsRefusedBeforeConnectingExitTwo(t *testing.T) {
	t.Parallel()
	vars := map[string]string{"EPITAPH_TARGET_URL": "postgres://nobody:secret@127.0.0.1:1/none", "EPITAPH_NATS_URL": "nats://127.0.0.1:1"}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"run", "--metrics-addr", "127.0.0.1:0", "--archive-partition", "year"}, `archive partition "year"`},
		{[]string{"run", "--metrics-addr", "127.0.0.1:0", "--source", "no spaces allowed"}, "source"},
	} {
		code, _, stderr := projector(t, vars, tc.args...)
		require.Equal(t, 2, code, "%v: %s", tc.args, stderr)
		require.Contains(t, stderr, tc.want)
		require.NotContains(t, stderr, "secret")
	}
}
