package capture

import (
	"net"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// defaultKeepAlive is Go's (and so pgx's) TCP keepalive idle time and
// probe interval.
const defaultKeepAlive = 15 * time.Second

// sourceDialer sets the DialFunc of c, the configuration of a connection
// to the source: pgx's default dialer (Go's TCP keepalive, the URL's
// connect_timeout) whose TCP sockets get TCP_USER_TIMEOUT = timeout
// before they connect (timeout <= 0, or a system without it: the
// system's default). The timeout bounds how long sent data (the
// connect's SYNs too) may stay unacknowledged, and how long keepalive
// probes may go unanswered: a connection whose network path died without
// a FIN or RST fails about timeout after the capture next sends on it, or
// after it last heard from the server while it waits for an answer,
// instead of when TCP gives up (about 15 minutes). The keepalive probes
// start after half the timeout of silence, every half timeout, at most
// Go's 15 s: the default timeout, 30 s, keeps Go's keepalive as it is.
// It is a socket option, never a URL parameter: pgx sends those to the
// server as settings.
func sourceDialer(c *pgconn.Config, timeout time.Duration) {
	d := &net.Dialer{Timeout: c.ConnectTimeout}
	if timeout > 0 && userTimeoutApplies {
		probe := min(defaultKeepAlive, timeout/2)
		d.KeepAliveConfig = net.KeepAliveConfig{Enable: true, Idle: probe, Interval: probe}
		d.Control = func(network, _ string, rc syscall.RawConn) error {
			if network != "tcp" && network != "tcp4" && network != "tcp6" {
				return nil // a Unix socket: no network path to lose
			}
			return setUserTimeout(rc, timeout)
		}
	}
	c.DialFunc = d.DialContext
}
