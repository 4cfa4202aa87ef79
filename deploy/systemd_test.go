package deploy_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestSystemdUnits checks the single-machine units: systemd-analyze verify
// accepts them (with the binaries they start stood in for), they restart
// on failure and stop softly, and every EPITAPH_* variable they set is one
// a binary reads.
func TestSystemdUnits(t *testing.T) {
	t.Parallel()
	analyze, err := exec.LookPath("systemd-analyze")
	if err != nil {
		t.Fatalf("systemd-analyze not found: install it with `apt-get install -y systemd` (scripts/test-deps.sh does)")
	}
	flagSources := readAll(t, "../cmd/capture/main.go", "../cmd/projector/commands.go", "../cmd/projector/run.go", "../internal/natsconn/natsconn.go")
	dir := t.TempDir()
	stand := filepath.Join(dir, "bin")
	require.NoError(t, os.Mkdir(stand, 0o755))
	for _, unit := range []string{"epitaph-capture.service", "epitaph-projector.service"} {
		b, err := os.ReadFile(filepath.Join("systemd", unit))
		require.NoError(t, err)
		text := string(b)
		require.Contains(t, text, "\nRestart=on-failure\n", unit)
		require.Contains(t, text, "\nKillSignal=SIGTERM\n", unit)
		require.Regexp(t, `\nExecStart=/usr/local/bin/epitaph-(capture|projector)( run)?\n`, text, unit)
		for _, m := range regexp.MustCompile(`\b(EPITAPH_[A-Z_]+)=`).FindAllStringSubmatch(text, -1) {
			require.Contains(t, flagSources, `"`+m[1]+`"`, "%s sets %s, which no binary reads", unit, m[1])
		}
		// verify needs ExecStart's program to exist: a stand-in.
		bin := strings.TrimSuffix(unit, ".service")
		require.NoError(t, os.WriteFile(filepath.Join(stand, bin), []byte("#!/bin/sh\n"), 0o755))
		text = strings.ReplaceAll(text, "/usr/local/bin/", stand+"/")
		require.NoError(t, os.WriteFile(filepath.Join(dir, unit), []byte(text), 0o644))
		out, err := exec.Command(analyze, "verify", "--man=no", filepath.Join(dir, unit)).CombinedOutput()
		require.NoError(t, err, "systemd-analyze verify %s:\n%s", unit, out)
		for _, l := range strings.Split(strings.TrimSpace(string(out)), "\n") {
			// Other units of the machine may draw warnings; ours none.
			require.NotContains(t, l, unit, "systemd-analyze verify: %s", out)
		}
	}
}

func readAll(t *testing.T, paths ...string) string {
	t.Helper()
	var sb strings.Builder
	for _, p := range paths {
		b, err := os.ReadFile(p)
		require.NoError(t, err)
		sb.Write(b)
	}
	return sb.String()
}
