package capture

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// sourcePingTimeout is how long a ping of a source connection may take:
// the notify guard's LISTEN pings its connection after ddlListenQuiet
// without a notification, and the pool pings a connection idle for more
// than a second before handing it out. A connection whose path died
// without a word (a NAT or firewall dropping the flow, a failover moving
// the address) is given up and replaced then, instead of when TCP gives up
// minutes later: the LISTEN at most about 20 s after its last sign of
// life.
const (
	sourcePingTimeout = 5 * time.Second
	ddlListenQuiet    = 15 * time.Second
)

// listenDDL follows the notify guard's signals: on a connection of its own
// it LISTENs on the publication's channel and asks the catalog watch for a
// check at each notification (ddlSignal: a burst makes one check or a
// few). A lost connection, or one that stays quiet and does not answer a
// ping, is reconnected with backoff, the catalog poll covering the time
// between; it is logged once per outage and never stops the capture.
func (s *Service) listenDDL(ctx context.Context) {
	defer s.bgWG.Done()
	defer s.setDDLListen(false)
	b := newReconnectBackoff()
	down := false
	for {
		err := s.listenDDLOnce(ctx, func() {
			if down {
				s.log.Info("DDL guard's LISTEN connection is back: new tables are published as they are created")
			}
			down = false
			b.Reset()
		})
		s.setDDLListen(false)
		if ctx.Err() != nil {
			return
		}
		// What took the LISTEN connection (a NAT or firewall forgetting
		// flows, a failover, a restart) most likely took the pool's idle
		// connections too: each would cost a ping timeout when next
		// handed out (the reconnect's and the catalog checks' acquires
		// among them). Closed now, they are dialled afresh.
		s.pool.Reset()
		s.abortCatalogCheck()
		if !down {
			s.log.Warn("DDL guard's LISTEN connection lost; reconnecting, the catalog poll (--catalog-poll) publishes new tables meanwhile",
				"err", redactErr(err))
			down = true
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(b.NextBackOff()):
		}
	}
}

// listenDDLOnce listens until the connection fails, stays quiet for
// ddlListenQuiet and then does not answer a ping within
// sourcePingTimeout, or ctx ends; up runs once the LISTEN is in place.
func (s *Service) listenDDLOnce(ctx context.Context, up func()) error {
	pc, err := s.pool.Acquire(ctx)
	if err != nil {
		return err
	}
	// Out of the pool for good: a listening session is nobody else's.
	conn := pc.Hijack()
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_ = conn.Close(cctx)
	}()
	if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{guardChannel(s.cfg.PublicationName)}.Sanitize()); err != nil {
		return err
	}
	s.setDDLListen(true)
	up()
	// A table created while nobody listened: look now.
	s.kickCatalog()
	for {
		wctx, cancel := context.WithTimeout(ctx, ddlListenQuiet)
		_, err := conn.WaitForNotification(wctx)
		cancel()
		if err == nil {
			s.ddlSignal()
			continue
		}
		if ctx.Err() != nil {
			return err
		}
		// The quiet period ended the wait. pgx ends it with a read
		// deadline and keeps the connection, with any notification it had
		// half read; a closed one is reconnected.
		if !pgconn.Timeout(err) || conn.IsClosed() {
			return err
		}
		// Notifications that arrive during the ping are kept by pgx for
		// the next wait.
		pctx, cancel := context.WithTimeout(ctx, sourcePingTimeout)
		err = conn.Ping(pctx)
		cancel()
		if err != nil {
			if ctx.Err() != nil {
				return err
			}
			return fmt.Errorf("LISTEN connection quiet for %s and no answer to a ping within %s: %w", ddlListenQuiet, sourcePingTimeout, err)
		}
	}
}

// ddlSettle is how long a signal of the notify guard waits for the
// others of its burst (a migration's DDL statements) before the catalog
// check: one check per burst, not one per statement.
const ddlSettle = 20 * time.Millisecond

// ddlSignal asks the catalog watch for a check ddlSettle from now, unless
// one is already due.
func (s *Service) ddlSignal() {
	if s.ddlDue.CompareAndSwap(false, true) {
		time.AfterFunc(ddlSettle, func() {
			s.ddlDue.Store(false)
			s.kickCatalog()
		})
	}
}

// setDDLListen records whether the notify guard's LISTEN is up.
func (s *Service) setDDLListen(up bool) {
	v := 0.0
	if up {
		v = 1
	}
	s.m.ddlListenUp.Set(v)
	s.ddlListenUp.Store(up)
}
