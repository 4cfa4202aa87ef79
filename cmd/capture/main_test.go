package main

import (
	"bytes"
	"context"
	"strings"
	"testing"

	"github.com/spf13/pflag"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/cmd/internal/cli"
)

// exec runs the capture's command line with exactly vars as environment.
func exec(vars map[string]string, args ...string) (stdout, stderr string, code int) {
	var out, errOut bytes.Buffer
	lookup := func(k string) (string, bool) { v, ok := vars[k]; return v, ok }
	err := execute(context.Background(), args, lookup, &out, &errOut)
	code = cli.Report(&errOut, "capture", err)
	return out.String(), errOut.String(), code
}

func TestMissingSourceURL(t *testing.T) {
	_, stderr, code := exec(map[string]string{"EPITAPH_SOURCE_URL": ""}, "--metrics-addr", "")
	require.Equal(t, 2, code)
	require.Contains(t, stderr, "EPITAPH_SOURCE_URL")
}

func TestFlagsFromEnv(t *testing.T) {
	_, stderr, code := exec(map[string]string{"EPITAPH_PARTITIONS": "-1", "EPITAPH_SOURCE_URL": "postgres://u:secret@127.0.0.1:1/db",
		"EPITAPH_NATS_URL": "nats://127.0.0.1:1"})
	require.Equal(t, 2, code, stderr)
	require.Equal(t, "capture: bad environment: EPITAPH_PARTITIONS=\"-1\": must be at least 1\n", stderr)
	require.NotContains(t, stderr, "secret")
}

func TestStandbyNeedsExternalBroker(t *testing.T) {
	_, stderr, code := exec(map[string]string{"EPITAPH_SOURCE_URL": "postgres://u:secret@127.0.0.1:1/db", "EPITAPH_NATS_URL": "",
		"EPITAPH_STANDBY": "true"}, "--metrics-addr", "")
	require.Equal(t, 2, code)
	require.Contains(t, stderr, "standby needs an external JetStream server (EPITAPH_NATS_URL)")
}

// A malformed or out-of-range setting is refused, naming it, on one line,
// never replaced by the default.
func TestBadEnvironmentIsRefused(t *testing.T) {
	vars := map[string]string{
		"EPITAPH_SOURCE_URL":         "postgres://u:secret@127.0.0.1:1/db",
		"EPITAPH_PARTITIONS":         "eight",
		"EPITAPH_HEARTBEAT_INTERVAL": "10",
		"EPITAPH_STANDBY":            "yes please",
		"EPITAPH_LOG_LEVEL":          "loud",
		"EPITAPH_LOG_FORMAT":         "xml",
		"EPITAPH_MAX_IN_FLIGHT":      "0",
		"EPITAPH_STANDBY_POLL":       "0s",
		"EPITAPH_STREAM_PERSIST":     "sometimes",
		"EPITAPH_RETENTION":          "max-bytes=lots",
		"EPITAPH_SOURCE_TCP_TIMEOUT": "-5s",
	}
	_, stderr, code := exec(vars, "--metrics-addr", "")
	require.Equal(t, 2, code)
	require.Equal(t, 1, strings.Count(stderr, "\n"), "one line: %s", stderr)
	for _, want := range []string{
		`EPITAPH_PARTITIONS="eight": not an integer`,
		`EPITAPH_HEARTBEAT_INTERVAL="10": not a duration`,
		`EPITAPH_STANDBY="yes please": not a boolean`,
		`EPITAPH_LOG_LEVEL="loud": want one of debug, info, warn, error`,
		`EPITAPH_LOG_FORMAT="xml": want one of text, json`,
		`EPITAPH_MAX_IN_FLIGHT="0": must be positive`,
		`EPITAPH_STANDBY_POLL="0s": must be positive`,
		`EPITAPH_STREAM_PERSIST="sometimes": want one of auto, async, default`,
		`EPITAPH_RETENTION="max-bytes=lots"`,
		`EPITAPH_SOURCE_TCP_TIMEOUT="-5s": must not be negative`,
	} {
		require.Contains(t, stderr, want)
	}
	require.NotContains(t, stderr, "secret")

	// The command line overrides the environment, and is checked the same way.
	_, stderr, code = exec(map[string]string{"EPITAPH_SOURCE_URL": "postgres://u@127.0.0.1:1/db", "EPITAPH_PARTITIONS": "3",
		"EPITAPH_RETENTION": "max-age=720h,max-bytes=50G"},
		"--metrics-addr", "", "--partitions", "0", "--nats-url", "nats://127.0.0.1:1")
	require.Equal(t, 2, code)
	require.Contains(t, stderr, `invalid argument "0" for "--partitions" flag: must be at least 1`)
}

// --source-tcp-timeout takes 0 (the system's default) or 1s to 24h; a
// value outside is refused with the range, never rounded or replaced.
func TestSourceTCPTimeoutRange(t *testing.T) {
	vars := map[string]string{"EPITAPH_SOURCE_URL": "postgres://u:secret@127.0.0.1:1/db", "EPITAPH_NATS_URL": "nats://127.0.0.1:1"}
	for _, v := range []string{"500ms", "25h"} {
		_, stderr, code := exec(vars, "--metrics-addr", "", "--source-tcp-timeout", v)
		require.Equal(t, 2, code, stderr)
		require.Contains(t, stderr, "use 1s to 24h (--source-tcp-timeout 0: the system's default)")
		require.NotContains(t, stderr, "secret")
	}
	_, stderr, code := exec(vars, "--metrics-addr", "", "--source-tcp-timeout", "-1s")
	require.Equal(t, 2, code, stderr)
	require.Contains(t, stderr, `invalid argument "-1s" for "--source-tcp-timeout" flag: must not be negative`)
}

// Every flag has its EPITAPH_ variable, named in its help, and the help
// never shows a value from the environment (a URL with a password).
func TestEveryFlagHasItsVariable(t *testing.T) {
	vars := map[string]string{"EPITAPH_SOURCE_URL": "postgres://u:hunter2@db/app", "EPITAPH_NATS_URL": "nats://u:hunter2@nats:4222"}
	stdout, _, code := exec(vars, "--help")
	require.Equal(t, 0, code)
	require.NotContains(t, stdout, "hunter2")
	root := newCommand(nil, nil, nil)
	n := 0
	root.Flags().VisitAll(func(f *pflag.Flag) {
		if f.Name == "help" {
			return
		}
		env := cli.EnvOf(f)
		require.NotEmpty(t, env, "--%s has no variable", f.Name)
		require.Equal(t, "EPITAPH_"+strings.ToUpper(strings.ReplaceAll(f.Name, "-", "_")), env, "--%s", f.Name)
		require.Contains(t, stdout, "("+env+")")
		n++
	})
	require.Greater(t, n, 20)
}

func TestConventions(t *testing.T) {
	stdout, stderr, code := exec(nil, "--help")
	require.Equal(t, 0, code, stderr)
	require.Contains(t, stdout, "Usage:\n  capture [flags]")
	require.Contains(t, stdout, "Examples:")

	stdout, _, code = exec(nil, "--version")
	require.Equal(t, 0, code)
	require.Regexp(t, `^capture \S+ \(commit \S+, built \S+, go1\.`, stdout)

	_, stderr, code = exec(nil, "extra")
	require.Equal(t, 2, code)
	require.Equal(t, "capture: unknown command \"extra\" for \"capture\" (see 'capture --help')\n", stderr)

	_, stderr, code = exec(nil, "--no-such-flag")
	require.Equal(t, 2, code)
	require.Contains(t, stderr, "unknown flag: --no-such-flag")

	stdout, _, code = exec(nil, "completion", "bash")
	require.Equal(t, 0, code)
	require.Contains(t, stdout, "__start_capture")
}

// NATS credentials go with an external server only; contradictory ones
// are refused in one line.
func TestNATSAuthFlagsAreChecked(t *testing.T) {
	t.Setenv("EPITAPH_SOURCE_URL", "postgres://u:secret@127.0.0.1:1/db")
	t.Setenv("EPITAPH_NATS_URL", "")
	err := run([]string{"--metrics-addr", "", "--nats-creds", "/x/projector.creds"})
	require.ErrorContains(t, err, "are for an external JetStream server (EPITAPH_NATS_URL): the embedded one makes its own credentials under <data-dir>/nats")

	t.Setenv("EPITAPH_NATS_URL", "nats://127.0.0.1:1")
	t.Setenv("EPITAPH_NATS_USER", "capture")
	err = run([]string{"--metrics-addr", ""})
	require.ErrorContains(t, err, "--nats-user needs --nats-password-file (EPITAPH_NATS_PASSWORD_FILE)")
	err = run([]string{"--metrics-addr", "", "--nats-password-file", "/x/pw", "--nats-creds", "/x/c.creds"})
	require.ErrorContains(t, err, "NATS credentials given twice (--nats-creds, --nats-user)")
	require.NotContains(t, err.Error(), "\n")
	require.NotContains(t, err.Error(), "secret")
}
