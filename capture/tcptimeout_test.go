package capture

import (
	"context"
	"errors"
	"net"
	"os"
	"runtime"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/internal/workload"
)

// TestSourceTCPTimeoutConfig: the timeout defaults to 30 s, a negative
// one leaves the system's default, and one shorter than a second or longer
// than a day is refused with the range to use.
func TestSourceTCPTimeoutConfig(t *testing.T) {
	t.Parallel()
	base := Config{SourceURL: "postgres://x/db", NATSURL: "nats://x", SigningKey: "k"}
	for _, c := range []struct {
		set, want time.Duration
		err       string
	}{
		{0, DefaultSourceTCPTimeout, ""},
		{-1, -1, ""},
		{time.Second, time.Second, ""},
		{24 * time.Hour, 24 * time.Hour, ""},
		{500 * time.Millisecond, 0, "source TCP timeout 500ms: use 1s to 24h"},
		{25 * time.Hour, 0, "source TCP timeout 25h0m0s: use 1s to 24h"},
	} {
		cfg := base
		cfg.SourceTCPTimeout = c.set
		svc, err := New(cfg)
		if c.err != "" {
			requireFix(t, err, c.err)
			continue
		}
		require.NoError(t, err, "%v", c.set)
		require.Equal(t, c.want, svc.cfg.SourceTCPTimeout)
	}
	require.Equal(t, 30*time.Second, DefaultSourceTCPTimeout)
}

// TestOutageClassificationOfAGivenUpConnection: the kernel giving a
// connection up (ETIMEDOUT, a timeout to net.Error and to pgx) is a loss
// of the source, and the stream loop does not take it for its own read
// deadline.
func TestOutageClassificationOfAGivenUpConnection(t *testing.T) {
	t.Parallel()
	gaveUp := &net.OpError{Op: "read", Net: "tcp", Err: os.NewSyscallError("read", syscall.ETIMEDOUT)}
	require.True(t, gaveUp.Timeout(), "a net.Error timeout")
	require.False(t, errors.Is(gaveUp, os.ErrDeadlineExceeded))
	to, ok := outage(gaveUp)
	require.True(t, ok)
	require.Equal(t, linkSource, to)
}

// TestCaptureNoticesASilentlyDeadSource: the capture reaches the source
// through a proxy, with --source-tcp-timeout 3s, under a deleting
// workload. Every connection it opened (the replication connection, the
// pool's) has TCP_USER_TIMEOUT 3 s. Then every path through the proxy
// dies silently: nothing the capture or the server sends arrives or is
// acknowledged, no FIN, no RST; new connections go through. The capture
// reports the source lost within the timeout after it next sends (a
// standby status update goes out at least every 10 s; its partition
// sequences are recorded on the source first, bounded by the timeout
// too), and a query of its pool waiting for its answer fails within the
// timeout plus a keepalive interval. It reconnects through
// the proxy (its new session ends the lost session's walsender, which
// the source keeps until wal_sender_timeout) and streams on, and the stream
// holds every row the workload deleted exactly once, row by row and value
// by value. Without TCP_USER_TIMEOUT (and the keepalive that goes with
// it) the connections wait for TCP to give up (tcp_retries2: about 15
// minutes) and this test fails on the notice's bound.
func TestCaptureNoticesASilentlyDeadSource(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("TCP_USER_TIMEOUT and the proxy's socket filters are Linux's")
	}
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	_, e := walSenderTimeoutEnv(t, "5s")
	seedWorkload(t, ctx, e)

	proxy, viaProxy := testenv.ProxiedURL(t, e.db)
	const tcpTimeout = 3 * time.Second
	svc := e.start(t, func(c *Config) {
		c.SourceURL = viaProxy
		c.SourceTCPTimeout = tcpTimeout
		c.Tables = workload.Tables
		c.HeartbeatInterval = time.Second // the pool is busy too
	})
	walsender := e.walsenderPID(t, 0, 10*time.Second)
	require.True(t, proxy.Live(e.clientPort(t, walsender)), "the replication connection does not go through the proxy")
	requireUserTimeout(t, svc, tcpTimeout)

	runCtx, stopRun := context.WithCancel(ctx)
	defer stopRun()
	ran := runWorkload(runCtx, e.db, workload.Plan{Seed: 5, MaxOrdersPerTx: 4, Reinserts: 3, Pause: 20 * time.Millisecond})
	progress := streamProgress(t, e)
	progress("before the paths die")

	// A query of the pool's sent before the paths die, whose answer
	// never comes: nothing of it is left unacknowledged, the keepalive
	// probes go unanswered.
	type slept struct {
		err error
		at  time.Time
	}
	asleep := make(chan slept, 1)
	go func() {
		_, err := svc.pool.Exec(ctx, `SELECT pg_sleep(120)`)
		asleep <- slept{err, time.Now()}
	}()
	require.Eventually(t, func() bool {
		return queryString(t, e.db, `SELECT count(*)::text FROM pg_stat_activity
			WHERE datname = current_database() AND state = 'active' AND query = 'SELECT pg_sleep(120)'`) == "1"
	}, 10*time.Second, 10*time.Millisecond, "the pool's query did not start")

	killed := proxy.BlackholeAllBut(t, 0)
	died := time.Now()
	require.GreaterOrEqual(t, killed, 2, "the replication connection and at least one of the pool's")
	t.Logf("%d connections silently dead", killed)
	// The status updates go out at least every statusInterval; under the
	// workload the next one follows within a fraction of a second.
	bound := statusInterval + 2*tcpTimeout + 2*time.Second
	for metricValue(t, svc.m.connected.WithLabelValues(linkSource)) != 0 {
		require.Less(t, time.Since(died), bound, "the source is still reported connected %s after every path to it died", bound)
		time.Sleep(5 * time.Millisecond)
	}
	noticed := time.Since(died)
	t.Logf("source reported lost %s after its paths died (--source-tcp-timeout %s)", noticed.Round(time.Millisecond), tcpTimeout)
	require.Error(t, svc.healthy(ctx), "/readyz is 503 while the source is lost")
	// The keepalive probes start after half the timeout of silence
	// (rounded up to whole seconds), every half timeout.
	queryBound := 2*tcpTimeout + 2*time.Second
	select {
	case r := <-asleep:
		require.Error(t, r.err)
		require.Less(t, r.at.Sub(died), queryBound, "the pool's query failed late")
		t.Logf("the pool's query waiting for its answer failed %s after its path died: %v", r.at.Sub(died).Round(time.Millisecond), r.err)
	case <-time.After(queryBound - time.Since(died)):
		t.Fatalf("the pool's query still waits for its answer %s after its path died", queryBound)
	}

	requireStreamsAgain(t, svc)
	t.Logf("streaming again %s after the source was reported lost", (time.Since(died) - noticed).Round(time.Millisecond))
	again := e.walsenderPID(t, walsender, 10*time.Second)
	require.True(t, proxy.Live(e.clientPort(t, again)), "the new replication connection does not go through the proxy")
	requireUserTimeout(t, svc, tcpTimeout)
	progress("after the reconnect")

	stopRun()
	out := <-ran
	require.NoError(t, out.err)
	t.Logf("workload: %d transactions, %d rows deleted, %d reinserts", out.res.Transactions, out.res.Deleted, out.res.Reinserted)
	requireWorkloadStream(t, ctx, e, out.res)
}

// requireUserTimeout checks TCP_USER_TIMEOUT on the capture's
// replication connection and on a connection of its pool.
func requireUserTimeout(t *testing.T, svc *Service, want time.Duration) {
	t.Helper()
	got, err := testenv.UserTimeoutOf(svc.repl.Conn())
	require.NoError(t, err)
	require.Equal(t, want, got, "the replication connection's TCP_USER_TIMEOUT")
	c, err := svc.pool.Acquire(t.Context())
	require.NoError(t, err)
	defer c.Release()
	got, err = testenv.UserTimeoutOf(c.Conn().PgConn().Conn())
	require.NoError(t, err)
	require.Equal(t, want, got, "a pool connection's TCP_USER_TIMEOUT")
}

// TestUninstallGivesUpOnASilentSource: uninstall against a server that
// accepts the TCP connection and never answers fails after its timeout
// (the URL sets no connect_timeout), naming the source without its
// password, instead of hanging until TCP gives up.
func TestUninstallGivesUpOnASilentSource(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	go func() {
		var held []net.Conn // accepted, never answered
		for {
			c, err := ln.Accept()
			if err != nil {
				for _, c := range held {
					c.Close()
				}
				return
			}
			held = append(held, c)
		}
	}()
	old := uninstallTimeout
	uninstallTimeout = time.Second
	defer func() { uninstallTimeout = old }()
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_, err = PlanUninstall(ctx, UninstallConfig{SourceURL: "postgres://epitaph:s3cret@" + ln.Addr().String() + "/app?sslmode=disable"})
	require.Error(t, err)
	require.Less(t, time.Since(start), 10*time.Second, "gave up after its timeout: %v", err)
	require.Contains(t, err.Error(), "connect to source")
	require.NotContains(t, err.Error(), "s3cret")
}
