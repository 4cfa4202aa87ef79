package docs

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// distStandInGo stands in for go in `make dist`: build writes two small
// executables where -o says (as go build does, their mode from the
// umask), run prints a fixed SBOM and writes the notices file -notices
// names. The packaging (cp, tar, gzip,
// sha256sum) is the Makefile's own; compiling four platforms twice would
// take minutes and prove nothing more about it.
const distStandInGo = `#!/bin/sh
case "$1" in
build)
  out=""
  while [ $# -gt 0 ]; do [ "$1" = "-o" ] && out="$2"; shift; done
  for b in capture projector; do printf '%s\n' "$b" > "$out/$b"; chmod +x "$out/$b"; done;;
run)
  while [ $# -gt 0 ]; do [ "$1" = "-notices" ] && printf 'notices\n' > "$2"; shift; done
  echo '{}';;
esac
`

// TestDistArchiveDoesNotDependOnTheUmask: docs/release.md says the same
// commit built with the same Go gives the same bytes. `make dist` made
// with umask 002 (the default of many distributions' users) must give
// the archive it gives with umask 022: tar records the modes of the
// directory it makes and of the binaries go build writes, which follow
// the umask.
func TestDistArchiveDoesNotDependOnTheUmask(t *testing.T) {
	if _, err := exec.LookPath("make"); err != nil {
		t.Skip("make not found")
	}
	root, err := filepath.Abs("..")
	require.NoError(t, err)
	dir := t.TempDir()
	goBin := filepath.Join(dir, "go")
	require.NoError(t, os.WriteFile(goBin, []byte(distStandInGo), 0o755))
	dist := func(umask string) []byte {
		t.Helper()
		out := filepath.Join(dir, "dist"+umask)
		cmd := exec.Command("sh", "-c", `umask `+umask+` && exec make -s -C "$0" dist GO="$1" DIST="$2" DIST_PLATFORMS=linux/amd64 VERSION=v0.0.0-test COMMIT=test`,
			root, goBin, out)
		b, err := cmd.CombinedOutput()
		require.NoError(t, err, "make dist with umask %s:\n%s", umask, b)
		archive, err := os.ReadFile(filepath.Join(out, "epitaph_v0.0.0-test_linux_amd64.tar.gz"))
		require.NoError(t, err)
		return archive
	}
	a, b := dist("022"), dist("002")
	if !bytes.Equal(a, b) {
		list := func(umask string) string {
			out, _ := exec.Command("tar", "-tvzf", filepath.Join(dir, "dist"+umask, "epitaph_v0.0.0-test_linux_amd64.tar.gz")).CombinedOutput()
			return string(out)
		}
		t.Fatalf("the archive differs with the umask:\numask 022:\n%s\numask 002:\n%s", list("022"), list("002"))
	}
	// What docs/release.md says each archive holds.
	names, err := exec.Command("tar", "-tzf", filepath.Join(dir, "dist022", "epitaph_v0.0.0-test_linux_amd64.tar.gz")).Output()
	require.NoError(t, err)
	for _, f := range []string{"capture", "projector", "LICENSE", "README.md", "CHANGELOG.md", "sbom.cdx.json", "THIRD_PARTY_NOTICES"} {
		require.Contains(t, strings.Fields(string(names)), "epitaph_v0.0.0-test_linux_amd64/"+f)
	}
}
