package projection_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/status"
)

// Unauthenticated GET /wait requests hammering a running projector: the
// waits run on a small pool of their own, at most the cap at once, the
// rest answered 503 with Retry-After at once; meanwhile the apply keeps
// its pace (a batch of transactions archived, row by row, within a bound
// far above its normal time but far below what waits polling on the
// apply's own pool cost it).
func TestWaitsBeyondTheCapAreRefusedAndTheApplyKeepsItsPace(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	e.start(e.config("w1"))
	c := e.conn()
	ctx := context.Background()
	pool, err := status.NewWaitPool(ctx, e.url, 0)
	require.NoError(t, err)
	defer pool.Close()
	const limit = 4
	srv := httptest.NewServer(status.WaitHandler(pool, archive.Projection, status.WithWaitLimit(status.NewWaitLimiter(limit))))
	defer srv.Close()

	far := event.LSN(0xFFFF_0000_0000) // never reached: every admitted wait polls to its timeout
	var refused, timedOut, other atomic.Int64
	var badRetry atomic.Bool
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for i := 0; i < 60; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				resp, err := http.Get(srv.URL + "?lsn=" + far.String() + "&timeout=2s")
				if err != nil {
					other.Add(1)
					continue
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				switch resp.StatusCode {
				case http.StatusServiceUnavailable:
					refused.Add(1)
					if resp.Header.Get("Retry-After") == "" {
						badRetry.Store(true)
					}
					time.Sleep(5 * time.Millisecond) // pacing, as a client honouring Retry-After would
				case http.StatusGatewayTimeout:
					timedOut.Add(1)
				default:
					other.Add(1)
				}
			}
		}()
	}
	eventually(t, 20*time.Second, func() bool { return refused.Load() > 0 }, "waits past the cap are refused")

	var txs []*txn
	start := time.Now()
	for i := 1; i <= 50; i++ {
		tx := e.nextTx(orderRows(i, 1)...)
		e.publish(tx)
		txs = append(txs, tx)
	}
	eventually(t, 30*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 100 },
		"the apply keeps its pace under the waits")
	applied := time.Since(start)
	close(stop)
	wg.Wait()

	require.Equal(t, expectedArchive(t, txs), archiveOf(t, c))
	require.Positive(t, refused.Load())
	require.False(t, badRetry.Load(), "every 503 says when to retry")
	require.Zero(t, other.Load(), "only 503 (past the cap) and 504 (the admitted waits' timeout)")
	require.LessOrEqual(t, pool.Stat().MaxConns(), int32(status.WaitPoolConns))
	t.Logf("50 transactions applied in %v under %d refused and %d timed-out waits", applied, refused.Load(), timedOut.Load())
}
