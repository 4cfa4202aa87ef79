package e2e_test

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// TestConfigFileForBothBinaries: the real binaries read --config (or
// EPITAPH_CONFIG), a YAML file whose keys are the flags' names; an
// EPITAPH_* variable overrides the file and a flag overrides both. The
// capture's uninstall plans for the slot the winning setting names, on the
// source only the file names; the projector's admin commands read and
// write the target the winning setting names.
func TestConfigFileForBothBinaries(t *testing.T) {
	t.Parallel()
	bins := binaries(t)
	dir := t.TempDir()
	source := testenv.NewDatabase(t)
	capCfg := filepath.Join(dir, "capture.yaml")
	require.NoError(t, os.WriteFile(capCfg, []byte("source-url: "+source+"\nslot: slot_file\npublication: pub_file\n"), 0o600))
	for _, tc := range []struct {
		name string
		env  []string
		args []string
		slot string
	}{
		{"file", []string{"EPITAPH_CONFIG=" + capCfg}, nil, "slot_file"},
		{"variable over file", []string{"EPITAPH_CONFIG=" + capCfg, "EPITAPH_SLOT=slot_env"}, nil, "slot_env"},
		{"flag over both", []string{"EPITAPH_SLOT=slot_env"}, []string{"--config", capCfg, "--slot", "slot_flag"}, "slot_flag"},
	} {
		stdout, stderr, code := runCapture(t, bins["capture"], tc.env, append([]string{"uninstall"}, tc.args...)...)
		require.Equal(t, 2, code, "%s: %s", tc.name, stderr)
		require.Contains(t, stdout, `note: no replication slot "`+tc.slot+`"`, tc.name)
		require.Contains(t, stdout, `note: no publication "pub_file"`, tc.name)
	}

	// A file cannot say yes for the operator.
	yesCfg := filepath.Join(dir, "yes.yaml")
	require.NoError(t, os.WriteFile(yesCfg, []byte("source-url: "+source+"\nyes: true\n"), 0o600))
	_, stderr, code := runCapture(t, bins["capture"], nil, "uninstall", "--config", yesCfg)
	require.Equal(t, 2, code, stderr)
	require.Contains(t, stderr, "run again with --yes")

	// The projector: two targets, each with its own handler.
	a, b := testenv.NewDatabase(t), testenv.NewDatabase(t)
	projCfg := filepath.Join(dir, "projector.yaml")
	require.NoError(t, os.WriteFile(projCfg, []byte("target-url: "+a+"\nnats-url: nats://127.0.0.1:1\n"), 0o600))
	projector := func(env []string, args ...string) string {
		t.Helper()
		stdout, stderr, code := runCapture(t, bins["projector"], env, args...)
		require.Equal(t, 0, code, "projector %v: %s", args, stderr)
		return stdout
	}
	add := []string{"handlers", "add", "--table", "public.orders", "--kind", "nats", "--json", "--target"}
	projector([]string{"EPITAPH_CONFIG=" + projCfg}, append(add, "in.a")...)
	projector([]string{"EPITAPH_CONFIG=" + projCfg, "EPITAPH_TARGET_URL=" + b}, append(add, "in.b")...)
	targets := func(env []string, args ...string) []string {
		var hs []struct {
			Target string `json:"target"`
		}
		require.NoError(t, json.Unmarshal([]byte(projector(env, append([]string{"handlers", "list", "--json"}, args...)...)), &hs))
		var out []string
		for _, h := range hs {
			out = append(out, h.Target)
		}
		return out
	}
	require.Equal(t, []string{"in.a"}, targets([]string{"EPITAPH_CONFIG=" + projCfg}), "the file's target")
	require.Equal(t, []string{"in.b"}, targets([]string{"EPITAPH_CONFIG=" + projCfg, "EPITAPH_TARGET_URL=" + b}), "the variable over the file")
	require.Equal(t, []string{"in.a"}, targets([]string{"EPITAPH_TARGET_URL=" + b}, "--config", projCfg, "--target-url", a), "the flag over both")

	_, stderr, code = runCapture(t, bins["projector"], []string{"EPITAPH_CONFIG=" + capCfg}, "handlers", "list")
	require.Equal(t, 2, code)
	require.True(t, strings.Contains(stderr, "slot: not a flag of projector"), stderr)
	require.NotContains(t, stderr, "postgres://", "no URL in the message")
}
