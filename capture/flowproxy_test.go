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
// flow that can be blackholed, as a silently dead network path (a NAT or
// firewall dropping the flow, a failover moving the address: no FIN, no
// RST) is to either end: nothing either end sends arrives or is
// acknowledged, while both of the flow's sockets stay open. The proxy
// drops what it still reads of the flow and a socket filter on each of its
// two sockets drops every packet the ends send (silence), so their kernels
// retransmit unacknowledged until TCP gives up. New connections are
// forwarded as before. The proxy's own sockets send no keepalive probes:
// a dead path carries none.
type flowProxy struct {
	l        net.Listener
	upstream string
	mu       sync.Mutex
	flows    map[int]*proxyFlow // by the upstream socket's local port: pg_stat_activity.client_port
	conns    []net.Conn
}

// proxyFlow is one forwarded connection: the capture's side (client) and
// the server's (up).
type proxyFlow struct {
	dead       atomic.Bool
	client, up net.Conn
}

// proxiedURL starts a flowProxy to the server of sourceURL and returns
// the URL through it.
func proxiedURL(t *testing.T, sourceURL string) (*flowProxy, string) {
	t.Helper()
	u, err := url.Parse(sourceURL)
	require.NoError(t, err)
	lc := net.ListenConfig{KeepAlive: -1}
	l, err := lc.Listen(t.Context(), "tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &flowProxy{l: l, upstream: u.Host, flows: map[int]*proxyFlow{}}
	t.Cleanup(func() {
		_ = l.Close()
		p.mu.Lock()
		defer p.mu.Unlock()
		for _, c := range p.conns {
			_ = unsilence(c) // the closes reach the ends
			_ = c.Close()
		}
	})
	go p.serve()
	u.Host = l.Addr().String()
	return p, u.String()
}

func (p *flowProxy) serve() {
	d := net.Dialer{KeepAlive: -1}
	for {
		c, err := p.l.Accept()
		if err != nil {
			return
		}
		up, err := d.Dial("tcp", p.upstream)
		if err != nil {
			_ = c.Close()
			continue
		}
		f := &proxyFlow{client: c, up: up}
		port := up.LocalAddr().(*net.TCPAddr).Port
		p.mu.Lock()
		p.flows[port] = f
		p.conns = append(p.conns, c, up)
		p.mu.Unlock()
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
// upstream socket has local port keep (0: none), and returns how many it
// killed.
func (p *flowProxy) blackholeAllBut(t *testing.T, keep int) int {
	t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for port, f := range p.flows {
		if port != keep && !f.dead.Swap(true) {
			require.NoError(t, silence(f.client), "silence the capture's side")
			require.NoError(t, silence(f.up), "silence the server's side")
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

// live reports whether the flow with upstream local port port is
// forwarded and not blackholed.
func (p *flowProxy) live(port int) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	f := p.flows[port]
	return f != nil && !f.dead.Load()
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

// walsenderPID waits at most bound for a walsender of the test's
// database other than not and returns its pid.
func (e *env) walsenderPID(t *testing.T, not int, bound time.Duration) int {
	t.Helper()
	deadline := time.Now().Add(bound)
	for {
		pid, err := strconv.Atoi(queryString(t, e.db, `SELECT coalesce(max(pid), 0)::text FROM pg_stat_activity
			WHERE datname = current_database() AND backend_type = 'walsender' AND pid <> $1`, not))
		require.NoError(t, err)
		if pid != 0 {
			return pid
		}
		require.True(t, time.Now().Before(deadline), "no walsender of the capture within %s", bound)
		time.Sleep(20 * time.Millisecond)
	}
}
