package capture

import (
	"net"
	"net/url"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// flowProxy forwards TCP connections to a Postgres server, each one a
// flow that can be blackholed: its bytes are then dropped both ways while
// both of its sockets stay open, which is what a silently dead network
// path (a NAT or firewall dropping the flow: no FIN, no RST) looks like
// to either end. New connections are forwarded as before.
type flowProxy struct {
	l        net.Listener
	upstream string
	mu       sync.Mutex
	flows    map[int]*proxyFlow // by the upstream socket's local port: pg_stat_activity.client_port
	conns    []net.Conn
}

type proxyFlow struct{ dead atomic.Bool }

// proxiedURL starts a flowProxy to the server of sourceURL and returns
// the URL through it.
func proxiedURL(t *testing.T, sourceURL string) (*flowProxy, string) {
	t.Helper()
	u, err := url.Parse(sourceURL)
	require.NoError(t, err)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &flowProxy{l: l, upstream: u.Host, flows: map[int]*proxyFlow{}}
	t.Cleanup(func() {
		_ = l.Close()
		p.mu.Lock()
		defer p.mu.Unlock()
		for _, c := range p.conns {
			_ = c.Close()
		}
	})
	go p.serve()
	u.Host = l.Addr().String()
	return p, u.String()
}

func (p *flowProxy) serve() {
	for {
		c, err := p.l.Accept()
		if err != nil {
			return
		}
		up, err := net.Dial("tcp", p.upstream)
		if err != nil {
			_ = c.Close()
			continue
		}
		f := &proxyFlow{}
		p.mu.Lock()
		p.flows[up.LocalAddr().(*net.TCPAddr).Port] = f
		p.conns = append(p.conns, c, up)
		p.mu.Unlock()
		port := up.LocalAddr().(*net.TCPAddr).Port
		go p.pipe(f, port, up, c)
		go p.pipe(f, port, c, up)
	}
}

// pipe copies src to dst. A live flow ends both sockets with either (and
// leaves the proxy's flows); a dead one drops what it reads and closes
// nothing.
func (p *flowProxy) pipe(f *proxyFlow, port int, dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 && !f.dead.Load() {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				err = werr
			}
		}
		if err != nil {
			if !f.dead.Load() {
				_, _ = src.Close(), dst.Close()
				p.mu.Lock()
				if p.flows[port] == f {
					delete(p.flows, port)
				}
				p.mu.Unlock()
			}
			return
		}
	}
}

// blackholeAllBut kills every flow of the proxy but the one whose
// upstream socket has local port keep, and returns how many it killed.
func (p *flowProxy) blackholeAllBut(keep int) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for port, f := range p.flows {
		if port != keep && !f.dead.Swap(true) {
			n++
		}
	}
	return n
}

// has reports whether a live or dead flow of the proxy has upstream
// local port port.
func (p *flowProxy) has(port int) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.flows[port] != nil
}

// clientPort is the client port of the session pid, as the server sees
// it: the proxy's upstream socket when it goes through the proxy.
func (e *env) clientPort(t *testing.T, pid int) int {
	t.Helper()
	port, err := strconv.Atoi(queryString(t, e.db, `SELECT coalesce(max(client_port), 0)::text FROM pg_stat_activity WHERE pid = $1`, pid))
	require.NoError(t, err)
	require.NotZero(t, port, "session %d has no TCP client port", pid)
	return port
}

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
	proxy, viaProxy := proxiedURL(t, e.db)
	svc := e.start(t, func(c *Config) {
		notifyGuard(c)
		c.SourceURL = viaProxy
	})
	pid := e.listenPID(t, 0)
	port := e.clientPort(t, pid)
	require.True(t, proxy.has(port), "the LISTEN session does not go through the proxy")
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
	walsender, err := strconv.Atoi(queryString(t, e.db, `SELECT coalesce(max(pid), 0)::text FROM pg_stat_activity
		WHERE datname = current_database() AND backend_type = 'walsender'`))
	require.NoError(t, err)
	killed := proxy.blackholeAllBut(e.clientPort(t, walsender))
	require.GreaterOrEqual(t, killed, 2, "the LISTEN and at least one idle pool connection")
	t.Logf("%d connections silently dead", killed)
	took = waitListenUp(t, svc, false, 30*time.Second)
	t.Logf("LISTEN reported down %s after its path died", took)
	took = waitListenUp(t, svc, true, 30*time.Second)
	t.Logf("and up again %s later", took)
	again := e.listenPID(t, pid)
	port = e.clientPort(t, again)
	require.True(t, proxy.has(port), "the new LISTEN session does not go through the proxy")

	time.Sleep(300 * time.Millisecond) // the reconnect's own catalog check is done
	e.exec(t, `CREATE TABLE later (id int PRIMARY KEY, v text); ALTER TABLE later REPLICA IDENTITY FULL`)
	took = e.waitPublished(t, "later", 2*time.Second)
	t.Logf("after the reconnect: published %s after the CREATE TABLE committed", took)
	e.exec(t, `INSERT INTO later VALUES (7, 'r7'); DELETE FROM later`)
	e.requireFreshDeletes(t, "public.later", 7)
}
