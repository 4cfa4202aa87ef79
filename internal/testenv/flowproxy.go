package testenv

import (
	"net"
	"net/url"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
)

// FlowProxy forwards TCP connections to a Postgres server, each one a
// flow that can be blackholed, as a silently dead network path (a NAT or
// firewall dropping the flow, a failover moving the address: no FIN, no
// RST) is to either end: nothing either end sends arrives or is
// acknowledged, while both of the flow's sockets stay open. The proxy
// drops what it still reads of the flow and a socket filter on each of its
// two sockets drops every packet the ends send (silence), so their kernels
// retransmit unacknowledged until TCP gives up. New connections are
// forwarded as before. The proxy's own sockets send no keepalive probes:
// a dead path carries none.
type FlowProxy struct {
	l        net.Listener
	upstream string
	mu       sync.Mutex
	flows    map[int]*proxyFlow // by the upstream socket's local port: pg_stat_activity.client_port
	conns    []net.Conn
}

// proxyFlow is one forwarded connection: the client's side and
// the server's (up).
type proxyFlow struct {
	dead       atomic.Bool
	client, up net.Conn
}

// ProxiedURL starts a FlowProxy to the server of sourceURL and returns
// the URL through it.
func ProxiedURL(t *testing.T, sourceURL string) (*FlowProxy, string) {
	t.Helper()
	u, err := url.Parse(sourceURL)
	require.NoError(t, err)
	lc := net.ListenConfig{KeepAlive: -1}
	l, err := lc.Listen(t.Context(), "tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &FlowProxy{l: l, upstream: u.Host, flows: map[int]*proxyFlow{}}
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

func (p *FlowProxy) serve() {
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
func (p *FlowProxy) pipe(f *proxyFlow, port int, dst, src net.Conn) {
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

// BlackholeAllBut kills every flow of the proxy but the one whose
// upstream socket has local port keep (0: none), and returns how many it
// killed.
func (p *FlowProxy) BlackholeAllBut(t *testing.T, keep int) int {
	t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for port, f := range p.flows {
		if port != keep && !f.dead.Swap(true) {
			require.NoError(t, silence(f.client), "silence the client's side")
			require.NoError(t, silence(f.up), "silence the server's side")
			n++
		}
	}
	return n
}

// Has reports whether a live or dead flow of the proxy has upstream
// local port port.
func (p *FlowProxy) Has(port int) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.flows[port] != nil
}

// Live reports whether the flow with upstream local port port is
// forwarded and not blackholed.
func (p *FlowProxy) Live(port int) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	f := p.flows[port]
	return f != nil && !f.dead.Load()
}
