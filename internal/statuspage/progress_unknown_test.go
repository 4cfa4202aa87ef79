package statuspage_test

import (
	"context"
	"io"
	"net/http"
	"regexp"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
	pversion "github.com/epitaph-dev/epitaph/projection/version"
)

var rebuildPctText = regexp.MustCompile(`data-testid="rebuild-pct">([^<]*)<`)

// While JetStream cannot be read, how far a rebuild is cannot be measured
// (its events done are counted against the stream): the page says
// unknown, never "0.0%" for a rebuild that is well under way.
func TestRebuildProgressUnknownWhileTheStreamIs(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	n := testenv.NewNATS(t)
	_, js := n.Connect(t)
	publishDeletes(t, js, 4, 600)
	target := testenv.NewDatabase(t)
	svc, pageURL := startWorker(t, target, n.URL, 2)
	poll(t, 120*time.Second, "v1 caught up", func() bool {
		st, err := svc.Status(ctx)
		require.NoError(t, err)
		v1 := version(st, 1)
		return v1 != nil && v1.State == pversion.StateLive && v1.LagEvents == 0 && len(v1.Partitions) == 4
	})
	lock, err := pgx.Connect(ctx, target)
	require.NoError(t, err)
	t.Cleanup(func() { lock.Close(context.WithoutCancel(ctx)) })
	hold, err := lock.Begin(ctx)
	require.NoError(t, err)
	_, err = pversion.CreateVersion(ctx, svc.Pool(), js, pversion.RebuildOptions{Source: source, Note: "statuspage test"})
	require.NoError(t, err)
	_, err = hold.Exec(ctx, `LOCK TABLE archive_v2.rows IN SHARE MODE`)
	require.NoError(t, err)
	require.NoError(t, hold.Rollback(ctx))
	poll(t, 60*time.Second, "v2 applied some events", func() bool {
		st, err := svc.Status(ctx)
		require.NoError(t, err)
		v2 := version(st, 2)
		return v2 != nil && v2.Lifecycle != nil && v2.Lifecycle.EventsDone > 50
	})
	hold, err = lock.Begin(ctx)
	require.NoError(t, err)
	_, err = hold.Exec(ctx, `LOCK TABLE archive_v2.rows IN SHARE MODE`)
	require.NoError(t, err)
	defer hold.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // test cleanup
	st, err := svc.Status(ctx)
	require.NoError(t, err)
	require.Equal(t, pversion.StateBuilding, version(st, 2).State, "the rebuild ended before the test looked")

	n.Stop()
	defer n.Start()
	poll(t, 30*time.Second, "lag unknown", func() bool {
		st, err := svc.Status(ctx)
		require.NoError(t, err)
		return version(st, 2).LagUnknown != ""
	})
	resp, err := http.Get(pageURL + "?fragment=1")
	require.NoError(t, err)
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.NoError(t, err)
	m := rebuildPctText.FindStringSubmatch(string(body))
	require.NotNil(t, m, "the rebuild is shown")
	require.Equal(t, "unknown", m[1], "how far v2 is, while the stream cannot be read")
}
