package cli

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestStartCPUProfileWritesAProfile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "cpu.pprof")
	stop, err := StartCPUProfile(path)
	require.NoError(t, err)
	stop()
	fi, err := os.Stat(path)
	require.NoError(t, err)
	require.NotZero(t, fi.Size(), "stop writes the profile")

	_, err = StartCPUProfile(filepath.Join(t.TempDir(), "missing", "cpu.pprof"))
	require.ErrorContains(t, err, "--cpu-profile", "a path that cannot be created names the flag")
}
