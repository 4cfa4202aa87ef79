package revalidate_test

import (
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/handler/revalidate"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// TestSourceReadGivesUpASilentlyDeadPath: the evaluator reads the source
// through a proxy with SourceTCPTimeout 2 s and SourceTimeout a minute.
// Its read waits behind a table lock the test holds, every path through
// the proxy dies silently (no FIN, no RST) and the lock is released, so
// the answer never arrives. The evaluation defers as the source being
// down within seconds, not when SourceTimeout runs out (this test fails
// on its 20 s bound without the dialer), and the next evaluation, on a
// path that works again, sends.
func TestSourceReadGivesUpASilentlyDeadPath(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("TCP_USER_TIMEOUT and the proxy's socket filters are Linux's")
	}
	e := setup(t)
	ctx := e.ctx
	g := e.newGroup()
	e.archive(g, 0, 1, "ada")
	id := e.queue(e.handler, g, 0, 1)

	proxy, viaProxy := testenv.ProxiedURL(t, e.sourceURL)
	ev, err := revalidate.New(e.target, revalidate.Config{SourceURL: viaProxy, SourceTimeout: time.Minute,
		SourceTCPTimeout: 2 * time.Second, Logger: testLogger()})
	require.NoError(t, err)
	defer ev.Close()

	lock, err := e.source.Begin(ctx)
	require.NoError(t, err)
	defer lock.Rollback(ctx) //nolint:errcheck // released below; a no-op then
	_, err = lock.Exec(ctx, `LOCK TABLE public.customers IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)

	var res revalidate.Result
	err = testenv.AnswerLostOnADeadPath(t, e.sourceURL, "%customers%", proxy, lock, func() (err error) {
		res, err = ev.Evaluate(ctx, id)
		return err
	})
	require.NoError(t, err)
	require.Equal(t, revalidate.Defer, res.Outcome)
	require.Equal(t, revalidate.ReasonSourceDown, res.Reason)

	// The pool dials again through the proxy, whose new paths work.
	res, err = ev.Evaluate(ctx, id)
	require.NoError(t, err)
	require.Equal(t, revalidate.Send, res.Outcome)
}
