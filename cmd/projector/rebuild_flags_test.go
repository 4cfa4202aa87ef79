package main

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// rebuild --from-start=false (or --from-start with --from-time) is a
// contradiction, not a full rebuild: it must be refused as a usage error
// (exit 2) before anything connects, not ignored.
func TestRebuildFromStartIsNotIgnored(t *testing.T) {
	t.Parallel()
	vars := map[string]string{"EPITAPH_TARGET_URL": "postgres://nobody@127.0.0.1:1/none", "EPITAPH_NATS_URL": "nats://127.0.0.1:1"}
	for _, args := range [][]string{
		{"rebuild", "archive", "--from-start=false"},
		{"rebuild", "archive", "--from-start", "--from-time", "2026-11-01T00:00:00Z"},
	} {
		code, _, stderr := projector(t, vars, args...)
		require.Equal(t, 2, code, "%v: %s", args, stderr)
	}
}
