package projection_test

import (
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// TestApplyRidesOutASilentlyDeadTarget: the projector reaches the target
// through a proxy, with a 2 s TargetTCPTimeout. Every path through the
// proxy then dies silently (nothing either end sends arrives or is
// acknowledged; no FIN, no RST: a managed Postgres failing over to
// another address, a NAT forgetting the flow); new connections go
// through. The next transaction is archived within seconds, on new
// connections, once, row by row. Without TCP_USER_TIMEOUT the pool's
// connections wait for TCP to give up (about 15 minutes) and this test
// fails on its bound.
func TestApplyRidesOutASilentlyDeadTarget(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("TCP_USER_TIMEOUT and the proxy's socket filters are Linux's")
	}
	t.Parallel()
	e := newEnv(t, 1)
	proxy, viaProxy := testenv.ProxiedURL(t, e.url)
	cfg := e.config("w1")
	cfg.TargetURL = testenv.NoSearchPath(viaProxy)
	cfg.TargetTCPTimeout = 2 * time.Second
	e.start(cfg)
	c := e.conn() // directly, not through the proxy
	e.publish(e.nextTx(orderRows(1, 2)...))
	eventually(t, time.Minute, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 3 })

	killed := proxy.BlackholeAllBut(t, 0)
	require.Positive(t, killed, "the projector's connections go through the proxy")
	start := time.Now()
	e.publish(e.nextTx(orderRows(2, 3)...))
	eventually(t, 45*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 7 },
		"the next transaction archived after the target's paths died")
	t.Logf("archived %s after the paths died (%d connections)", time.Since(start).Round(time.Millisecond), killed)
	require.Equal(t, 7, count(t, c, `SELECT count(DISTINCT (commit_lsn, seq)) FROM archive.rows`), "each row once")
	require.Equal(t, 4, count(t, c, `SELECT count(*) FROM archive.rows WHERE (table_name = 'orders' AND key->>'id' = '2')
		OR (table_name = 'order_lines' AND key->>'id' IN ('2000', '2001', '2002'))`), "the order and its three lines")
}
