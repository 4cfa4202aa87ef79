package capture

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// waitListenUp waits at most bound for the capture's ddl_listen_up (in
// /status and epitaph_capture_ddl_listen_up) to be want, returning how
// long it took.
func waitListenUp(t *testing.T, svc *Service, want bool, bound time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	for {
		up := svc.CurrentStatus().DDLListenUp
		require.NotNil(t, up)
		gauge := metricValue(t, svc.m.ddlListenUp)
		if *up == want && gauge == map[bool]float64{false: 0, true: 1}[want] {
			return time.Since(start)
		}
		if time.Since(start) > bound {
			t.Fatalf("ddl_listen_up still %v (gauge %v) %s after it should have become %v", *up, gauge, bound, want)
		}
		// Down is a few hundred milliseconds only: look often.
		time.Sleep(5 * time.Millisecond)
	}
}

// TestDDLGuardListenNoticesSilentDeath: the capture reaches the source
// through a proxy. A LISTEN connection quiet for longer than
// ddlListenQuiet is kept (it answers the ping) and still publishes a new
// table within 2 s. Then the paths of that connection and of the pool's
// idle ones die silently (the proxy drops their bytes both ways and keeps
// their sockets open; new connections go through). The capture notices
// within 30 s (ddl_listen_up and its gauge go false), reconnects through
// the proxy, replacing the dead pool connections, within 30 s more (true
// again), and a table created after that is published within 2 s with
// the catalog poll at an hour.
func TestDDLGuardListenNoticesSilentDeath(t *testing.T) {
	t.Parallel()
	e := setupNoTwoPhase(t)
	proxy, viaProxy := testenv.ProxiedURL(t, e.db)
	svc := e.start(t, func(c *Config) {
		notifyGuard(c)
		c.SourceURL = viaProxy
	})
	pid := e.listenPID(t, 0)
	port := e.clientPort(t, pid)
	require.True(t, proxy.Has(port), "the LISTEN session does not go through the proxy")
	waitListenUp(t, svc, true, 5*time.Second)

	// Quiet for longer than ddlListenQuiet: the ping answers, the same
	// session listens on and ddl_listen_up stays true.
	for end := time.Now().Add(ddlListenQuiet + 2*time.Second); time.Now().Before(end); {
		require.True(t, *svc.CurrentStatus().DDLListenUp, "ddl_listen_up went false on a quiet, live connection")
		time.Sleep(5 * time.Millisecond)
	}
	// pgx's ping is an empty query: the session's last.
	require.Equal(t, "-- ping", queryString(t, e.db, `SELECT coalesce(max(query), 'gone') FROM pg_stat_activity WHERE pid = $1`, pid))
	require.Equal(t, "0", queryString(t, e.db, `SELECT count(*)::text FROM pg_stat_activity
		WHERE datname = current_database() AND query LIKE 'LISTEN %'`), "a new LISTEN session")
	e.exec(t, `CREATE TABLE quiet (id int PRIMARY KEY, v text); ALTER TABLE quiet REPLICA IDENTITY FULL`)
	took := e.waitPublished(t, "quiet", 2*time.Second)
	t.Logf("after a quiet period: published %s after the CREATE TABLE committed", took)

	// Every path through the proxy dies but the replication connection's:
	// the LISTEN and the pool's idle connections, as when a NAT or a
	// firewall in between forgets its flows. The replication connection
	// is kept to keep the test on the LISTEN: a silent death of that one
	// is not noticed here.
	walsender := e.walsenderPID(t, 0, 5*time.Second)
	killed := proxy.BlackholeAllBut(t, e.clientPort(t, walsender))
	require.GreaterOrEqual(t, killed, 2, "the LISTEN and at least one idle pool connection")
	t.Logf("%d connections silently dead", killed)
	took = waitListenUp(t, svc, false, 30*time.Second)
	t.Logf("LISTEN reported down %s after its path died", took)
	took = waitListenUp(t, svc, true, 30*time.Second)
	t.Logf("and up again %s later", took)
	again := e.listenPID(t, pid)
	port = e.clientPort(t, again)
	require.True(t, proxy.Has(port), "the new LISTEN session does not go through the proxy")

	time.Sleep(300 * time.Millisecond) // the reconnect's own catalog check is done
	e.exec(t, `CREATE TABLE later (id int PRIMARY KEY, v text); ALTER TABLE later REPLICA IDENTITY FULL`)
	took = e.waitPublished(t, "later", 2*time.Second)
	t.Logf("after the reconnect: published %s after the CREATE TABLE committed", took)
	e.exec(t, `INSERT INTO later VALUES (7, 'r7'); DELETE FROM later`)
	e.requireFreshDeletes(t, "public.later", 7)
}
