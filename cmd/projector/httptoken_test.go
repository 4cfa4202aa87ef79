package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// A token file that is missing, empty or readable by everyone is refused
// at start (usage, exit 2) with one line, before anything connects, and
// the token is never printed.
func TestHTTPTokenFileIsChecked(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	const token = "do-not-print-this-token-123"
	open := filepath.Join(dir, "open")
	require.NoError(t, os.WriteFile(open, []byte(token), 0o644))
	require.NoError(t, os.Chmod(open, 0o644))
	empty := filepath.Join(dir, "empty")
	require.NoError(t, os.WriteFile(empty, nil, 0o600))
	vars := map[string]string{"EPITAPH_TARGET_URL": "postgres://nobody@127.0.0.1:1/none"}
	for file, want := range map[string]string{
		open:                          "--http-token-file " + open + ": readable by every user (mode 0644): chmod 600 it",
		empty:                         "--http-token-file " + empty + " is empty",
		filepath.Join(dir, "missing"): "no such file",
	} {
		code, _, stderr := projector(t, vars, "run", "--http-token-file", file)
		require.Equal(t, 2, code, stderr)
		require.Equal(t, 1, strings.Count(stderr, "\n"), stderr)
		require.Contains(t, stderr, want)
		require.NotContains(t, stderr, token)
	}
	vars["EPITAPH_HTTP_TOKEN_FILE"] = open
	code, _, stderr := projector(t, vars, "run")
	require.Equal(t, 2, code)
	require.Contains(t, stderr, "chmod 600 it")
}
