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

	type answer struct {
		res revalidate.Result
		err error
	}
	done := make(chan answer, 1)
	go func() {
		res, err := ev.Evaluate(ctx, id)
		done <- answer{res, err}
	}()
	require.Eventually(t, func() bool {
		var n int
		return e.source.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock' AND query ILIKE '%customers%'`).Scan(&n) == nil && n == 1
	}, 20*time.Second, 20*time.Millisecond, "the evaluation's read waits behind the lock")
	require.Positive(t, proxy.BlackholeAllBut(t, 0), "the evaluation reads through the proxy")
	start := time.Now()
	require.NoError(t, lock.Rollback(ctx)) // the read completes; its answer never arrives
	select {
	case a := <-done:
		require.NoError(t, a.err)
		require.Equal(t, revalidate.Defer, a.res.Outcome)
		require.Equal(t, revalidate.ReasonSourceDown, a.res.Reason)
		t.Logf("the evaluation deferred %s after the path died", time.Since(start).Round(time.Millisecond))
	case <-time.After(20 * time.Second):
		t.Fatal("the evaluation still waits 20 s after its path died")
	}

	// The pool dials again through the proxy, whose new paths work.
	res, err := ev.Evaluate(ctx, id)
	require.NoError(t, err)
	require.Equal(t, revalidate.Send, res.Outcome)
}
