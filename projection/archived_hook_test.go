package projection_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// OnArchiveCommit's function runs after each page the archive commits,
// once its rows are visible (the webhook dispatcher claims them from
// another connection at once), and after a page that only moved a
// watermark (a heartbeat: the horizon a batch waits for).
func TestOnArchiveCommitRunsOnceThePageIsVisible(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	s := e.start(e.config("w1"))
	pool := e.pool()
	var mu sync.Mutex
	var seen []int
	s.OnArchiveCommit(func() {
		var n int
		if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM archive.rows`).Scan(&n); err != nil {
			n = -1
		}
		mu.Lock()
		seen = append(seen, n)
		mu.Unlock()
	})
	calls := func() []int {
		mu.Lock()
		defer mu.Unlock()
		return append([]int(nil), seen...)
	}
	e.publish(e.nextTx(orderRows(1, 2)...))
	eventually(t, time.Minute, func() bool {
		c := calls()
		return len(c) > 0 && c[len(c)-1] == 3
	}, "a call after the page that archived the order and its two lines, seeing them")
	for _, n := range calls() {
		require.Contains(t, []int{0, 3}, n, "a call saw part of a page: it ran before the commit")
	}
	before := len(calls())
	e.heartbeat()
	eventually(t, time.Minute, func() bool { return len(calls()) > before }, "a call after the heartbeat's page")
}
