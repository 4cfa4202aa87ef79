package snapshot_test

import (
	"context"
	"encoding/json"
	"os/exec"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/bench"
	"github.com/epitaph-dev/epitaph/projection/snapshot"
)

// The real projector binary: `snapshots batch` assembles from a host that
// runs no projector, `snapshots show` prints the documents.
func TestProjectorSnapshotsCommands(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx, cancel := context.WithTimeout(e.ctx, 5*time.Minute)
	defer cancel()
	bins, err := bench.Build(ctx, t.TempDir(), "projector")
	require.NoError(t, err)
	projector := func(args ...string) (string, error) {
		cmd := exec.CommandContext(ctx, bins["projector"], args...)
		cmd.Env = []string{"EPITAPH_TARGET_URL=" + e.url}
		out, err := cmd.CombinedOutput()
		return string(out), err
	}

	e.seedOrder(t, 5, 2)
	s := e.begin(t)
	s.deleteOrder(t, 5)
	require.Equal(t, 1, s.apply(t, orderRoots))

	out, err := projector("snapshots", "batch", "--version", "1")
	require.NoError(t, err, out)
	require.Equal(t, "archive_v1: claimed 1, complete 1, retry later 0, failed 0\n", out)

	out, err = projector("snapshots", "show", s.correlationID(), "--version", "1")
	require.NoError(t, err, out)
	var list []snapshot.Snapshot
	require.NoError(t, json.Unmarshal([]byte(out), &list), out)
	require.Len(t, list, 1)
	d := decodeDoc(t, list[0])
	require.Equal(t, `{"id":5}`, compact(t, d.Root.Key))
	require.Len(t, d.Children["public.lines"], 2)

	out, err = projector("snapshots", "show", "--version", "1", "main:1:0/1")
	require.Error(t, err)
	require.Contains(t, out, `no snapshots for "main:1:0/1" in archive_v1`)
}
