package capture

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
)

// The capture's two links, the label values of epitaph_capture_connected.
const (
	linkSource = "source"
	linkBroker = "broker"
)

// links is the state of the capture's connections to the source and the
// broker: the epitaph_capture_connected gauge, /readyz, and one log line
// each time a link is lost or back (never one per retry).
type links struct {
	log   *slog.Logger
	gauge *prometheus.GaugeVec
	now   func() time.Time

	mu    sync.Mutex
	up    map[string]bool
	since map[string]time.Time // when a down link went down
}

func newLinks(log *slog.Logger, gauge *prometheus.GaugeVec, now func() time.Time) *links {
	l := &links{log: log, gauge: gauge, now: now, up: map[string]bool{}, since: map[string]time.Time{}}
	for _, to := range []string{linkSource, linkBroker} {
		gauge.WithLabelValues(to).Set(0)
	}
	return l
}

// connected records that the link to `to` works. The first time it says
// nothing (the start logs its own lines); after a loss it logs once.
func (l *links) connected(to string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.up[to] {
		return
	}
	l.up[to] = true
	l.gauge.WithLabelValues(to).Set(1)
	if since, lost := l.since[to]; lost {
		delete(l.since, to)
		l.log.Info("reconnected to the "+to, "down_for", l.now().Sub(since).Round(time.Millisecond).String())
	}
}

// lost records that the link to `to` is down; the first loss of a link
// that was up logs err once.
func (l *links) lost(to string, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, lost := l.since[to]; lost {
		return
	}
	l.since[to] = l.now()
	l.gauge.WithLabelValues(to).Set(0)
	if l.up[to] {
		msg := "lost the connection to the " + to + ": reconnecting with backoff (the capture keeps running; /readyz is 503 until it streams again)"
		if err != nil {
			l.log.Warn(msg, "err", redactErr(err))
		} else {
			l.log.Warn(msg)
		}
	}
	l.up[to] = false
}

// ready is nil when no link is down.
func (l *links) ready() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	var down []string
	for _, to := range []string{linkSource, linkBroker} {
		if _, lost := l.since[to]; lost {
			down = append(down, to)
		}
	}
	if len(down) > 0 {
		return errors.New("capture is reconnecting to the " + strings.Join(down, " and the "))
	}
	return nil
}

// natsHandlers keep the broker's link state as the NATS client sees it, so
// /readyz and the gauge follow a broker outage even while nothing is
// published.
func (l *links) natsHandlers() []nats.Option {
	return []nats.Option{
		nats.DisconnectErrHandler(func(nc *nats.Conn, err error) {
			if nc.IsClosed() {
				return // closed by the capture itself
			}
			if err == nil {
				err = nats.ErrDisconnected
			}
			l.lost(linkBroker, err)
		}),
		nats.ReconnectHandler(func(*nats.Conn) { l.connected(linkBroker) }),
	}
}

// newReconnectBackoff is the wait between two attempts to start a session
// after an outage: from a quarter second, doubling to at most 10 s, with
// jitter, for as long as the outage lasts.
func newReconnectBackoff() *backoff.ExponentialBackOff {
	b := backoff.NewExponentialBackOff()
	b.InitialInterval = 250 * time.Millisecond
	b.MaxInterval = 10 * time.Second
	b.MaxElapsedTime = 0 // never give up: an outage ends, or an operator stops the capture
	b.Reset()
	return b
}

// outage reports whether err is a transient loss of the source or the
// broker (which one: linkSource or linkBroker), one the capture rides out
// by reconnecting. Anything a restart cannot fix is not: a *ConfigError
// (a missing slot, privilege or table), a lost lease, limits it cannot
// keep, and every PostgreSQL error but the few a restart or shutdown of
// the server causes (a refused password, 28P01, or a missing privilege,
// 42501, stays fatal). Errors are told apart by type and SQLSTATE, never
// by their text.
func outage(err error) (to string, ok bool) {
	if err == nil {
		return "", false
	}
	var (
		ce *ConfigError
		le *LeaseLostError
		lm *LimitsError
	)
	if errors.As(err, &ce) || errors.As(err, &le) || errors.As(err, &lm) {
		return "", false
	}
	if errors.Is(err, errLeaderMoved) {
		return linkBroker, true
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return linkSource, transientSQLState(pgErr.Code)
	}
	var se *serverEndedError
	var sb *slotBusyError
	if errors.As(err, &se) || errors.As(err, &sb) {
		return linkSource, true
	}
	if pgconn.Timeout(err) {
		return linkSource, true
	}
	if brokerOutage(err) || errors.Is(err, context.DeadlineExceeded) {
		// A JetStream request past its timeout ends with its context's
		// error; the source's ends as a pgconn timeout (above).
		return linkBroker, true
	}
	var onBroker *brokerIOError
	if errors.As(err, &onBroker) {
		return linkBroker, true
	}
	var connectErr *pgconn.ConnectError
	var netErr net.Error
	switch {
	case errors.As(err, &connectErr), errors.Is(err, pgconn.ErrConnClosed),
		errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, net.ErrClosed),
		errors.As(err, &netErr):
		// Network errors from a publish are marked (brokerIO); the
		// capture's other plain network connections are the source's.
		return linkSource, true
	}
	return "", false
}

// transientSQLState reports whether a PostgreSQL error is one a server
// restart, shutdown or crash causes: connection exceptions (class 08),
// admin or crash shutdown and "the database system is starting up"
// (57P01-57P03), and too many connections (53300).
func transientSQLState(code string) bool {
	switch {
	case strings.HasPrefix(code, "08"):
		return true
	case code == "57P01", code == "57P02", code == "57P03", code == "53300":
		return true
	}
	return false
}

// brokerOutage reports whether err is the NATS client's or JetStream's
// report of a broker that is down, restarting or not answering yet.
func brokerOutage(err error) bool {
	for _, e := range []error{nats.ErrConnectionClosed, nats.ErrConnectionReconnecting, nats.ErrDisconnected,
		nats.ErrReconnectBufExceeded, nats.ErrTimeout, nats.ErrNoResponders, nats.ErrNoServers, nats.ErrStaleConnection,
		jetstream.ErrNoStreamResponse, jetstream.ErrAsyncPublishTimeout, jetstream.ErrJetStreamNotEnabled, errBrokerDown} {
		if errors.Is(err, e) {
			return true
		}
	}
	var apiErr *jetstream.APIError
	if !errors.As(err, &apiErr) {
		return false
	}
	// JetStream is not available yet: a server still recovering its
	// streams, a cluster without a leader. Not every 503 is that: a stream
	// that refuses to store a message (its limits) answers 503 too.
	switch apiErr.ErrorCode {
	case jsErrCodeClusterNotAvail, jsErrCodeLastSeqPerSubjectNotReady:
		return true
	}
	return false
}

// JetStream's error codes of a system that is not available yet.
const (
	jsErrCodeClusterNotAvail           jetstream.ErrorCode = 10008 // JetStream system temporarily unavailable
	jsErrCodeLastSeqPerSubjectNotReady jetstream.ErrorCode = 10163 // expected last sequence per subject temporarily unavailable
)

// errBrokerDown: the NATS connection is not connected (it reconnects in
// the background).
var errBrokerDown = errors.New("the NATS connection is reconnecting")

// errLeaderMoved: the stream's leader changed, or it has none or no
// quorum, while a publish was unanswered: a leader that lost its
// leadership drops what it had not stored without a reply, and one without
// a quorum stores nothing.
var errLeaderMoved = errors.New("the stream's leader changed or cannot store: a publish in flight is unanswered")

// errLeaderChanged (an errLeaderMoved): the stream's leader is another
// than the one the session published to. The old one dropped what it had
// not stored without a reply, so waiting for those acknowledgements only
// waits out their timeout (a minute): the session ends at once, and the
// next one resumes after what the new leader holds (trust.go), its
// publishes on a JetStream context of their own.
var errLeaderChanged = fmt.Errorf("%w", errLeaderMoved)

// serverEndedError: the source ended replication (CopyDone), as a
// PostgreSQL shutdown does once the capture has confirmed what it sent.
type serverEndedError struct{ slot string }

func (e *serverEndedError) Error() string {
	return "replication slot " + e.slot + ": the server ended replication"
}

// slotBusyError: a new session found the slot still streamed by another
// process (after an outage, most likely the previous session's walsender,
// which the source ends once wal_sender_timeout has passed).
type slotBusyError struct {
	slot string
	pid  int32
}

func (e *slotBusyError) Error() string {
	return fmt.Sprintf("replication slot %s is still active in process %d (the previous session's walsender until wal_sender_timeout ends it, or another capture)", e.slot, e.pid)
}

// awaitBroker returns errBrokerDown unless the NATS connection is
// connected, after a flush: every message published before is then with
// the server before the stream's tail is read.
func (s *Service) awaitBroker(ctx context.Context) error {
	if s.nc.IsClosed() {
		// The client gave up (the server refused the credentials on
		// reconnecting): no reconnect will follow.
		return fmt.Errorf("the NATS connection was closed: %v", s.nc.LastError())
	}
	if s.nc.Status() != nats.CONNECTED {
		return errBrokerDown
	}
	fctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := s.nc.FlushWithContext(fctx); err != nil && ctx.Err() == nil {
		return errors.Join(errBrokerDown, err)
	}
	return nil
}

// sourceLoginErr is a *ConfigError when the source refused the capture's
// login for a reason a restart cannot fix (a wrong password, a role or
// database that does not exist, no CONNECT privilege), else nil.
func sourceLoginErr(sourceURL string, err error) error {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return nil
	}
	var fix string
	switch pgErr.Code {
	case "28P01": // invalid_password
		fix = "check the user and password in the source URL"
	case "28000": // invalid_authorization_specification (pg_hba.conf, a missing role)
		fix = "check the user in the source URL and pg_hba.conf"
	case "3D000": // invalid_catalog_name
		fix = "check the database name in the source URL"
	case "42501": // insufficient_privilege
		fix = "grant the role CONNECT on the database"
	default:
		return nil
	}
	return configErr("connect to source %s: %s (SQLSTATE %s): %s; a restart will not fix this", RedactURL(sourceURL), pgErr.Message, pgErr.Code, fix)
}

// untilReachable runs f, the first contact with the link `to` at start,
// until it succeeds, fails for another reason than an outage of that link,
// or ctx ends (a stop). While it waits, the endpoints are served (/livez
// 200, /readyz 503), and the wait and its end are logged once each.
func (s *Service) untilReachable(ctx context.Context, to string, f func() error) error {
	b := newReconnectBackoff()
	var since time.Time
	for {
		err := f()
		if err == nil {
			if !since.IsZero() {
				s.log.Info("the "+to+" is reachable", "waited", s.now().Sub(since).Round(time.Millisecond).String())
			}
			return nil
		}
		if t, ok := outage(err); !ok || t != to || ctx.Err() != nil {
			return err
		}
		if since.IsZero() {
			since = s.now()
			s.log.Warn("the "+to+" is unreachable: waiting for it, retrying with backoff (/livez 200, /readyz 503 meanwhile)", "err", redactErr(err))
			if err := s.startEndpoints(ctx); err != nil {
				return err
			}
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(b.NextBackOff()):
		}
	}
}

// brokerIOError marks a network error a publish returned: the NATS client
// can hand back its connection's raw write error (a reset, a broken pipe)
// instead of one of its own, which without the mark would read as the
// source's.
type brokerIOError struct{ err error }

func (e *brokerIOError) Error() string { return e.err.Error() }
func (e *brokerIOError) Unwrap() error { return e.err }

// brokerIO marks err as the broker's when it is a network error; a
// JetStream answer (a stream refusing a message) stays as it is.
func brokerIO(err error) error {
	var netErr net.Error
	if errors.As(err, &netErr) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, net.ErrClosed) {
		return &brokerIOError{err: err}
	}
	return err
}
