package main

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// The read API serves deleted rows: off loopback it needs a token, and
// run refuses to start without one (before connecting anywhere).
func TestRunRefusesAnOpenReadAPIOffLoopback(t *testing.T) {
	t.Parallel()
	vars := map[string]string{"EPITAPH_TARGET_URL": "postgres://nobody@127.0.0.1:1/none"}
	code, _, stderr := projector(t, vars, "run", "--metrics-addr", "0.0.0.0:0")
	require.Equal(t, 2, code, stderr)
	require.Contains(t, stderr, "--metrics-addr 0.0.0.0:0 is not a loopback address: the read API needs --http-token-file")
	code, _, stderr = projector(t, vars, "run", "--metrics-addr", ":9188")
	require.Equal(t, 2, code, stderr)

	empty := filepath.Join(t.TempDir(), "empty")
	require.NoError(t, os.WriteFile(empty, []byte("\n"), 0o600))
	code, _, stderr = projector(t, vars, "run", "--metrics-addr", "0.0.0.0:0", "--http-token-file", empty)
	require.Equal(t, 2, code, stderr)
	require.Contains(t, stderr, "is empty")

	good := filepath.Join(t.TempDir(), "token")
	require.NoError(t, os.WriteFile(good, []byte("s3cret-value-of-the-read-api\n"), 0o600))
	code, _, stderr = projector(t, vars, "run", "--metrics-addr", "0.0.0.0:0", "--http-token-file", good)
	require.NotEqual(t, 2, code, "with a token it gets past the check (and fails on the unreachable target): %s", stderr)
	require.NotContains(t, stderr, "s3cret-value", "the token is never printed")

	for addr, want := range map[string]bool{"127.0.0.1:9188": true, "[::1]:1": true, "localhost:9188": true,
		"0.0.0.0:9188": false, ":9188": false, "10.0.0.1:80": false, "[::]:1": false} {
		require.Equal(t, want, loopback(addr), addr)
	}
}
