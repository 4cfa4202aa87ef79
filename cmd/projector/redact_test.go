package main

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// A NATS URL without its scheme (nats.go adds nats://) may carry
// user:password like any other: status names the unreachable server on
// stderr and in its document without the password.
func TestStatusHidesPasswordOfSchemelessNATSURL(t *testing.T) {
	t.Parallel()
	vars := map[string]string{"EPITAPH_TARGET_URL": testenv.NewDatabase(t), "EPITAPH_NATS_URL": "epitaph:nats-secret-4711@127.0.0.1:1"}
	code, _, stderr := projector(t, vars, "migrate")
	require.Equal(t, 0, code, stderr)
	code, stdout, stderr := projector(t, vars, "status", "--json")
	require.Equal(t, 0, code, stderr)
	require.Contains(t, stderr, "127.0.0.1:1 unreachable", "status says NATS cannot be reached")
	require.NotContains(t, stdout+stderr, "nats-secret-4711")
}

// pgx reads a URL's password up to its '@', an unencoded space included
// (and refuses it with "unexpected spaces found in password"): the error
// that names the URL hides the whole password.
func TestBadTargetURLErrorHidesPasswordWithSpace(t *testing.T) {
	t.Parallel()
	code, _, stderr := projector(t, map[string]string{"EPITAPH_TARGET_URL": "postgres://epitaph:correct horse-4714@127.0.0.1:1/db"}, "status")
	require.Equal(t, 2, code, stderr)
	require.Contains(t, stderr, "postgres://epitaph:xxxxx@127.0.0.1:1/db")
	require.NotContains(t, stderr, "horse-4714")
	require.NotContains(t, stderr, "correct")
}
