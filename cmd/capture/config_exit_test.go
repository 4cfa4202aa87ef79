package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// A setting the operator got wrong (a malformed or invalid value in the
// configuration file, the environment or on the command line, a missing
// or contradictory one) is a usage error: exit 2, as docs/cli promises for
// "a bad value (flag or environment)", one line naming it, nothing started.
func TestCaptureConfigurationErrorsExitTwo(t *testing.T) {
	dir := t.TempDir()
	file := func(name, body string) string {
		p := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(p, []byte(body), 0o600))
		return p
	}
	src := "postgres://u:secret@127.0.0.1:1/db"
	for _, tc := range []struct {
		name string
		vars map[string]string
		args []string
		want string
	}{
		{"malformed config file", nil,
			[]string{"--metrics-addr", "", "--config", file("bad.yaml", "source-url: [unclosed\n")}, "not YAML"},
		{"invalid value in the config file", nil,
			[]string{"--metrics-addr", "", "--config", file("quiet.yaml", "source-url: "+src+"\nnats-url: nats://127.0.0.1:1\nheartbeat-quiet: 10ms\n")},
			"heartbeat quiet time must be at least"},
		{"catch-up bytes below the minimum", map[string]string{"EPITAPH_SOURCE_URL": src, "EPITAPH_NATS_URL": "nats://127.0.0.1:1"},
			[]string{"--metrics-addr", "", "--catch-up-bytes", "100"}, "catch-up bytes 100"},
		{"standby without an external broker", map[string]string{"EPITAPH_SOURCE_URL": src, "EPITAPH_NATS_URL": "", "EPITAPH_STANDBY": "true"},
			[]string{"--metrics-addr", ""}, "standby needs an external JetStream server"},
		{"missing source URL", map[string]string{"EPITAPH_SOURCE_URL": ""}, []string{"--metrics-addr", ""}, "EPITAPH_SOURCE_URL"},
		{"uninstall without a source URL", map[string]string{"EPITAPH_SOURCE_URL": ""}, []string{"uninstall"}, "EPITAPH_SOURCE_URL"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, stderr, code := exec(tc.vars, tc.args...)
			require.Equal(t, 2, code, stderr)
			require.Contains(t, stderr, tc.want)
			require.Equal(t, 1, strings.Count(stderr, "\n"), "one line: %s", stderr)
			require.NotContains(t, stderr, "secret")
		})
	}
}
