package capture

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/epitaph-dev/epitaph/internal/pgdial"
)

// leaseKeepalive are the TCP settings asked of the source for the lease
// connection (server-side GUCs, per session): a capture whose host vanishes
// without closing its sockets loses the lease after about
// idle + interval*count = 25s instead of the kernel default of hours, and a
// connection with unacknowledged data after tcp_user_timeout. Settings in
// the source URL win.
var leaseKeepalive = map[string]string{
	"tcp_keepalives_idle":     "10",
	"tcp_keepalives_interval": "5",
	"tcp_keepalives_count":    "3",
	"tcp_user_timeout":        "20000",
}

// lease is the standby lease: a session advisory lock on the source
// (pg_try_advisory_lock of leaseKey, in pg_locks as classid/objid with
// objsubid 1), held by a dedicated connection for as long as the capture
// streams. The lock goes when the session goes (process death, closed or
// broken connection), which is what lets a standby take over. A standby
// takes it before it touches the publication, the stream or the slot, and
// then also waits for the slot to be inactive: the old holder's walsender
// can outlive its lease session, and a capture started without Standby
// takes no lease.
type lease struct {
	cfg  *pgx.ConnConfig
	key  int64
	conn *pgx.Conn
}

// leaseKey is the advisory lock key of (database, slot). Advisory locks are
// per database already; the database name is in the key too so the key
// reads the same in pg_locks of any database.
func leaseKey(db, slot string) int64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte("epitaph-capture\x00" + db + "\x00" + slot))
	return int64(h.Sum64())
}

func newLease(sourceURL, appName, db, slot string, tcpTimeout time.Duration) (*lease, error) {
	cfg, err := pgx.ParseConfig(sourceURL)
	if err != nil {
		return nil, configErr("source URL %s: %v", RedactURL(sourceURL), redactErr(err))
	}
	cfg.RuntimeParams["application_name"] = appName
	pgdial.Set(&cfg.Config, tcpTimeout)
	for k, v := range leaseKeepalive {
		if _, set := cfg.RuntimeParams[k]; !set {
			cfg.RuntimeParams[k] = v
		}
	}
	return &lease{cfg: cfg, key: leaseKey(db, slot)}, nil
}

// try takes the lock if it is free. It (re)connects as needed; a
// connection error closes the connection, so the next try starts afresh.
func (l *lease) try(ctx context.Context) (bool, error) {
	if l.conn == nil {
		c, err := pgx.ConnectConfig(ctx, l.cfg)
		if err != nil {
			return false, fmt.Errorf("connect for the standby lease: %w", err)
		}
		l.conn = c
	}
	var got bool
	if err := l.conn.QueryRow(ctx, `SELECT pg_try_advisory_lock($1)`, l.key).Scan(&got); err != nil {
		l.close()
		return false, fmt.Errorf("try the standby lease: %w", err)
	}
	return got, nil
}

const sqlLeaseHolder = `
SELECT l.pid, coalesce(a.application_name, ''), coalesce(host(a.client_addr), ''), a.backend_start
FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.classid::bigint = $1 AND l.objid::bigint = $2
LIMIT 1`

// Holder is a session holding the lease or streaming the slot, as far as
// pg_locks and pg_stat_activity tell (application_name names a capture
// process: epitaph-capture:<host>-<pid>).
type Holder struct {
	PID             int32      `json:"pid"`
	ApplicationName string     `json:"application_name"`
	ClientAddr      string     `json:"client_addr,omitempty"`
	BackendStart    *time.Time `json:"backend_start,omitempty"`
}

// lockParts are the classid and objid pg_locks shows for a bigint key.
func lockParts(key int64) (int64, int64) {
	u := uint64(key)
	return int64(u >> 32), int64(u & 0xffffffff)
}

// holder returns the session holding the lease, or nil.
func (l *lease) holder(ctx context.Context) (*Holder, error) {
	if l.conn == nil {
		return nil, errors.New("no lease connection")
	}
	hi, lo := lockParts(l.key)
	var h Holder
	err := l.conn.QueryRow(ctx, sqlLeaseHolder, hi, lo).Scan(&h.PID, &h.ApplicationName, &h.ClientAddr, &h.BackendStart)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read the standby lease holder: %w", err)
	}
	return &h, nil
}

const sqlLeaseHeld = `
SELECT EXISTS (SELECT 1 FROM pg_locks
  WHERE locktype = 'advisory' AND granted AND objsubid = 1 AND pid = pg_backend_pid()
    AND classid::bigint = $1 AND objid::bigint = $2)`

// check returns nil while this session still holds the lock.
func (l *lease) check(ctx context.Context) error {
	if l.conn == nil {
		return errors.New("no lease connection")
	}
	hi, lo := lockParts(l.key)
	var held bool
	if err := l.conn.QueryRow(ctx, sqlLeaseHeld, hi, lo).Scan(&held); err != nil {
		return err
	}
	if !held {
		return errors.New("the advisory lock is no longer held by this session")
	}
	return nil
}

func (l *lease) close() {
	if l.conn == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	_ = l.conn.Close(ctx)
	cancel()
	l.conn = nil
}

const sqlSessionOf = `
SELECT pid, coalesce(application_name, ''), coalesce(host(client_addr), ''), backend_start
FROM pg_stat_activity WHERE pid = $1`

// sessionOf describes a backend (the walsender streaming the slot).
func (s *Service) sessionOf(ctx context.Context, pid int32) *Holder {
	h := Holder{PID: pid}
	if err := s.pool.QueryRow(ctx, sqlSessionOf, pid).Scan(&h.PID, &h.ApplicationName, &h.ClientAddr, &h.BackendStart); err != nil {
		return &Holder{PID: pid}
	}
	return &h
}

// LeaseLostError stops a capture whose lease connection failed while it
// held the lease: it stops streaming at once, since another capture may
// take over. Restarting makes it a standby.
type LeaseLostError struct{ Err error }

func (e *LeaseLostError) Error() string {
	return "lost the standby lease (its connection to the source failed or the lock is gone): stopped streaming so that another capture can take over; restart to wait as standby: " + e.Err.Error()
}

func (e *LeaseLostError) Unwrap() error { return e.Err }

// StandbyStatus is what a waiting standby reports in /status.
type StandbyStatus struct {
	Since time.Time `json:"since"`
	// WaitingFor is "lease" (another capture holds it) or "slot" (this
	// capture holds the lease; the slot is still active, typically the
	// previous holder's walsender on its way out).
	WaitingFor string  `json:"waiting_for"`
	Holder     *Holder `json:"holder,omitempty"`
	LastError  string  `json:"last_error,omitempty"`
}

// Roles of a capture in /status.
const (
	RoleStarting   = "starting"
	RoleStandby    = "standby"
	RoleTakingOver = "taking_over"
	RoleActive     = "active"
	RoleStopped    = "stopped"
)

func (s *Service) setRole(role string, sb *StandbyStatus) {
	s.mu.Lock()
	s.role, s.standby = role, sb
	s.mu.Unlock()
}

func (s *Service) updateStandby(f func(*StandbyStatus)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.standby != nil {
		cp := *s.standby
		f(&cp)
		s.standby = &cp
	}
}

// acquire waits for the lease, then for the slot to be inactive. It
// returns ctx's error when stopped while waiting.
func (s *Service) acquire(ctx context.Context) error {
	cfg := &s.cfg
	s.setRole(RoleStandby, &StandbyStatus{Since: s.now().UTC(), WaitingFor: "lease"})
	var lastHolder string
	failing := false
	for {
		got, err := s.lease.try(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if !failing {
				s.log.Warn("standby: cannot check the lease; retrying", "err", redactErr(err))
			}
			failing = true
			s.updateStandby(func(sb *StandbyStatus) { sb.LastError = redactErr(err) })
		} else if got {
			break
		} else {
			failing = false
			h, err := s.lease.holder(ctx)
			if err != nil && ctx.Err() == nil {
				s.log.Debug("standby: read the lease holder", "err", err)
			}
			s.updateStandby(func(sb *StandbyStatus) { sb.Holder, sb.LastError = h, "" })
			name := "unknown"
			if h != nil {
				name = fmt.Sprintf("%s (pid %d)", h.ApplicationName, h.PID)
			}
			if name != lastHolder {
				s.log.Info("waiting as standby: another capture holds the lease", "slot", cfg.SlotName, "holder", name)
				lastHolder = name
			}
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(cfg.StandbyPoll):
		}
	}
	s.log.Info("standby lease taken", "slot", cfg.SlotName, "application_name", cfg.ApplicationName)
	s.bgWG.Add(1)
	go s.watchLease(ctx)

	s.setRole(RoleStandby, &StandbyStatus{Since: s.now().UTC(), WaitingFor: "slot"})
	poll := min(cfg.StandbyPoll, 200*time.Millisecond)
	var lastLog time.Time
	for {
		slot, err := readSlot(ctx, s.pool, cfg.SlotName)
		if err != nil {
			// A pool connection lost while waiting (the lease, checked by
			// watchLease, is what decides): wait on, as for the lease.
			if _, transient := outage(err); !transient || ctx.Err() != nil {
				return err
			}
			s.updateStandby(func(sb *StandbyStatus) { sb.LastError = redactErr(err) })
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(poll):
			}
			continue
		}
		s.updateStandby(func(sb *StandbyStatus) { sb.LastError = "" })
		if !slot.exists || slot.activePID == nil {
			break
		}
		h := s.sessionOf(ctx, *slot.activePID)
		s.updateStandby(func(sb *StandbyStatus) { sb.Holder = h })
		if lastLog.IsZero() || s.now().Sub(lastLog) > 30*time.Second {
			s.log.Warn("lease taken, waiting for the slot to become inactive (the previous holder's walsender, or a capture running without --standby)",
				"slot", cfg.SlotName, "active_pid", h.PID, "application_name", h.ApplicationName)
			lastLog = s.now()
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(poll):
		}
	}
	s.setRole(RoleTakingOver, nil)
	return nil
}

// watchLease checks the lease every StandbyPoll while this capture holds
// it; when the check fails the capture stops at once with a
// *LeaseLostError (fail closed: a standby may be taking over).
func (s *Service) watchLease(ctx context.Context) {
	defer s.bgWG.Done()
	t := time.NewTicker(s.cfg.StandbyPoll)
	defer t.Stop()
	timeout := max(2*s.cfg.StandbyPoll, 5*time.Second)
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		cctx, cancel := context.WithTimeout(ctx, timeout)
		err := s.lease.check(cctx)
		cancel()
		if err != nil && ctx.Err() == nil {
			s.leaseErr.Store(&LeaseLostError{Err: err})
			s.log.Error("standby lease lost: stopping at once", "err", redactErr(err))
			s.cancel()
			return
		}
	}
}

// lostLease returns the error of a lost lease, or nil.
func (s *Service) lostLease() error {
	if e := s.leaseErr.Load(); e != nil {
		return e
	}
	return nil
}
