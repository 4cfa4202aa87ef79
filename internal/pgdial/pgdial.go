// Package pgdial dials Postgres so that a connection whose network path
// died silently (a NAT or firewall dropping the flow, a failover moving
// the address: no FIN, no RST) fails within a bound instead of when TCP
// gives up, about 15 minutes later. The capture uses it for the source,
// the projector for the target.
package pgdial

import (
	"context"
	"errors"
	"fmt"
	"net"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// defaultKeepAlive is Go's (and so pgx's) TCP keepalive idle time and
// probe interval.
const defaultKeepAlive = 15 * time.Second

// Set sets the DialFunc of c, the configuration of a connection to
// Postgres: pgx's default dialer (Go's TCP keepalive, the URL's
// connect_timeout) whose TCP sockets get TCP_USER_TIMEOUT = timeout
// before they connect (timeout <= 0, or a system without it: the
// system's default). The timeout bounds how long sent data (the
// connect's SYNs too) may stay unacknowledged, and how long keepalive
// probes may go unanswered: a connection whose network path died without
// a FIN or RST fails about timeout after the client next sends on it, or
// after it last heard from the server while it waits for an answer,
// instead of when TCP gives up (about 15 minutes). The keepalive probes
// start after half the timeout of silence, every half timeout, at most
// Go's 15 s: the default timeout, 30 s, keeps Go's keepalive as it is.
// It is a socket option, never a URL parameter: pgx sends those to the
// server as settings.
func Set(c *pgconn.Config, timeout time.Duration) {
	d := &net.Dialer{Timeout: c.ConnectTimeout}
	if timeout > 0 && UserTimeoutApplies {
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

// Connect opens one connection to url dialled by Set with timeout. A
// malformed URL's error does not quote it (it may hold a password).
func Connect(ctx context.Context, url string, timeout time.Duration) (*pgx.Conn, error) {
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		return nil, errors.New("invalid database URL")
	}
	Set(&cfg.Config, timeout)
	return pgx.ConnectConfig(ctx, cfg)
}

// The bounds of a timeout Set is given: shorter would give up
// connections on an ordinary retransmission; TCP_USER_TIMEOUT takes
// milliseconds in a C int.
const (
	MinTimeout = time.Second
	MaxTimeout = 24 * time.Hour
)

// CheckTimeout refuses a positive timeout outside [MinTimeout,
// MaxTimeout], naming it what and the flag that sets it (0 there: the
// system's default); nil otherwise.
func CheckTimeout(what, flag string, t time.Duration) error {
	if t > 0 && (t < MinTimeout || t > MaxTimeout) {
		return fmt.Errorf("%s %v: use 1s to 24h (%s 0: the system's default)", what, t, flag)
	}
	return nil
}
