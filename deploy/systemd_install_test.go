package deploy_test

import (
	"os"
	"path"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestSystemdInstallStepsInstallTheReleaseBinaries: the units' heads say
// how to install the binary they start. Without containers the binary
// comes from a release archive (`make dist`), `make build` or `go
// install`, all of which name it after its cmd/ directory (capture,
// projector; only the image calls it epitaph-capture). The install line
// must take a file one of those gives and put it where ExecStart runs it.
func TestSystemdInstallStepsInstallTheReleaseBinaries(t *testing.T) {
	mk, err := os.ReadFile("../Makefile")
	require.NoError(t, err)
	m := regexp.MustCompile(`(?m)^\s+CGO_ENABLED=0 .*\$\(GO\) build .*-o \$\$dir/ (.+);`).FindStringSubmatch(string(mk))
	require.NotNil(t, m, "the dist target's go build line")
	shipped := map[string]bool{}
	for _, pkg := range strings.Fields(m[1]) {
		shipped[path.Base(pkg)] = true
	}
	for _, unit := range []string{"epitaph-capture.service", "epitaph-projector.service"} {
		b, err := os.ReadFile(filepath.Join("systemd", unit))
		require.NoError(t, err)
		text := string(b)
		exec := regexp.MustCompile(`(?m)^ExecStart=(\S+)`).FindStringSubmatch(text)
		require.NotNil(t, exec, unit)
		inst := regexp.MustCompile(`(?m)^#\s+install -m \d+ (\S+) (\S+)(?:\s+#.*)?$`).FindStringSubmatch(text)
		require.NotNil(t, inst, "%s: no install step for its binary", unit)
		src, dst := inst[1], inst[2]
		if strings.HasSuffix(dst, "/") {
			dst += path.Base(src)
		}
		require.True(t, shipped[path.Base(src)], "%s: `install ... %s`: the release archive (and make build, go install) has %v, no %s",
			unit, src, shipped, src)
		require.Equal(t, exec[1], dst, "%s: the install step puts the binary elsewhere than ExecStart runs it", unit)
	}
}
