package capture

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/epitaph-dev/epitaph/event"
)

type slotStats struct {
	At              time.Time `json:"at"`
	CurrentLSN      string    `json:"current_lsn"`
	ConfirmedLSN    string    `json:"confirmed_flush_lsn"`
	RestartLSN      string    `json:"restart_lsn"`
	WALStatus       string    `json:"wal_status"`
	RetainedBytes   int64     `json:"retained_wal_bytes"`
	LagBytes        int64     `json:"lag_bytes"`
	SafeBytes       int64     `json:"safe_wal_bytes"` // -1: unlimited
	TimeToInvalidS  float64   `json:"time_to_invalidation_seconds"`
	Failover        bool      `json:"failover"` // the slot has FAILOVER (PostgreSQL 17+): a synced standby keeps it
	currentLSNValue event.LSN
}

const sqlSlotStats = `
SELECT pg_current_wal_lsn()::text, coalesce(confirmed_flush_lsn::text, ''), coalesce(restart_lsn::text, ''),
       coalesce(wal_status, ''), coalesce(pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn), 0)::bigint,
       coalesce(pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn), 0)::bigint, safe_wal_size,
       coalesce((to_jsonb(s) ->> 'failover')::boolean, false)
FROM pg_replication_slots s WHERE slot_name = $1`

const slotPollInterval = 5 * time.Second

// pollSlot keeps the slot gauges current.
func (s *Service) pollSlot(ctx context.Context) {
	defer s.bgWG.Done()
	t := time.NewTicker(slotPollInterval)
	defer t.Stop()
	for {
		s.readSlotStats(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (s *Service) readSlotStats(ctx context.Context) {
	var (
		st   slotStats
		safe *int64
	)
	err := s.pool.QueryRow(ctx, sqlSlotStats, s.cfg.SlotName).Scan(&st.CurrentLSN, &st.ConfirmedLSN, &st.RestartLSN,
		&st.WALStatus, &st.RetainedBytes, &st.LagBytes, &safe, &st.Failover)
	if err != nil {
		if ctx.Err() == nil && !errors.Is(err, pgx.ErrNoRows) {
			s.log.Debug("read slot statistics", "err", err)
		}
		return
	}
	st.At = s.now()
	st.currentLSNValue, _ = event.ParseLSN(st.CurrentLSN)
	st.SafeBytes, st.TimeToInvalidS = -1, -1
	s.mu.Lock()
	prev := s.slotStats
	if safe != nil {
		// Past max_slot_wal_keep_size (wal_status "unreserved", lost at the
		// next checkpoint) PostgreSQL reports a negative size: nothing is
		// left, and only -1 may mean unlimited.
		st.SafeBytes = max(*safe, 0)
		if !prev.At.IsZero() && st.currentLSNValue > prev.currentLSNValue {
			rate := float64(st.currentLSNValue-prev.currentLSNValue) / st.At.Sub(prev.At).Seconds()
			if rate > 0 {
				st.TimeToInvalidS = float64(max(*safe, 0)) / rate
			}
		}
	}
	s.slotStats = st
	s.mu.Unlock()
	s.m.retainedWAL.Set(float64(st.RetainedBytes))
	s.m.lagBytes.Set(float64(st.LagBytes))
	s.m.safeWAL.Set(float64(st.SafeBytes))
	s.m.timeToInvalid.Set(st.TimeToInvalidS)
	if st.Failover {
		s.m.slotFailover.Set(1)
	} else {
		s.m.slotFailover.Set(0)
	}
}

// Status is the /status document of a capture.
type Status struct {
	Source      string `json:"source"`
	Slot        string `json:"slot"`
	Publication string `json:"publication"`
	Stream      string `json:"stream"`
	NATSURL     string `json:"nats_url"`
	Partitions  int    `json:"partitions"`
	Active      bool   `json:"active"`
	// Role is starting, standby, taking_over, active or stopped.
	Role string `json:"role"`
	// Standby says what a waiting standby waits for, and who holds it.
	Standby *StandbyStatus `json:"standby,omitempty"`
	// ApplicationName of this capture's connections to the source.
	ApplicationName   string    `json:"application_name"`
	ConfirmedLSN      string    `json:"confirmed_lsn"`
	LagBytes          int64     `json:"lag_bytes"`
	LagSeconds        float64   `json:"lag_seconds"`
	SlotStats         slotStats `json:"slot_stats"`
	HeartbeatAgeSec   float64   `json:"heartbeat_age_seconds"`
	PublicationTables []string  `json:"publication_tables"`
	SkippedTables     []string  `json:"skipped_tables"`
	KeyIdentityTables []string  `json:"key_identity_tables"`
	// DDLGuard is the mode of the DDL guard the capture installed (notify
	// or inline; empty: none); DDLListenUp, with notify, whether its
	// LISTEN connection is up.
	DDLGuard           string `json:"ddl_guard,omitempty"`
	DDLListenUp        *bool  `json:"ddl_listen_up,omitempty"`
	Error              string `json:"error,omitempty"`
	BrokerSyncInterval string `json:"broker_sync_interval"`
	// CPUMode is all (not limited), tail (on --tail-cpus) or catch_up
	// (every CPU); CPUs the GOMAXPROCS it runs with; BacklogBytes the WAL
	// bytes it was behind the source at the last check (-1: not measured).
	CPUMode      string `json:"cpu_mode"`
	CPUs         int    `json:"cpus"`
	BacklogBytes int64  `json:"backlog_bytes"`
	// CPUNice is the nice value the capture set on its scheduling group
	// (--tail-nice while tailing, else 0); CPUNiceUnavailable why
	// --tail-nice cannot be applied here (empty when it is, or is 0).
	CPUNice            int    `json:"cpu_nice"`
	CPUNiceUnavailable string `json:"cpu_nice_unavailable,omitempty"`
	// The key the capture signs with (public half only), so an operator
	// can pin it in projectors (projector trust-key).
	SigningKeyID         string `json:"signing_key_id,omitempty"`
	SigningPublicKey     string `json:"signing_public_key,omitempty"`
	SigningPublicKeyFile string `json:"signing_public_key_file,omitempty"`
}

// CurrentStatus returns what /status serves.
func (s *Service) CurrentStatus() Status {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := Status{
		Source: s.cfg.SourceName, Slot: s.cfg.SlotName, Publication: s.cfg.PublicationName,
		Stream: event.StreamName(s.cfg.SourceName), NATSURL: RedactURL(s.natsURL),
		Partitions: s.cfg.Partitions, Active: s.activeState.Load(),
		Role: s.role, Standby: s.standby, ApplicationName: s.cfg.ApplicationName,
		ConfirmedLSN: s.confirmed.String(), LagBytes: s.slotStats.LagBytes, LagSeconds: s.lagSeconds,
		SlotStats: s.slotStats, HeartbeatAgeSec: s.heartbeatAge(),
		PublicationTables: s.pubTables, BrokerSyncInterval: s.cfg.BrokerSyncInterval.String(),
		SigningKeyID: s.keyID, SigningPublicKeyFile: s.pubPath,
	}
	if s.cfg.InstallDDLGuard {
		st.DDLGuard = s.cfg.DDLGuardMode
		if s.notifyGuard() {
			up := s.ddlListenUp.Load()
			st.DDLListenUp = &up
		}
	}
	st.CPUMode, st.CPUs, st.BacklogBytes = s.cpuState()
	st.CPUNice, st.CPUNiceUnavailable = s.niceState()
	if s.pub != nil {
		st.SigningPublicKey = event.PublicKeyString(s.pub)
	}
	if s.sel != nil {
		st.SkippedTables, st.KeyIdentityTables = s.sel.skipped, s.sel.keyOnly
	}
	select {
	case <-s.ss.Done():
		if err := s.ss.Wait(); err != nil {
			st.Error = err.Error()
		}
	default:
	}
	return st
}

func (s *Service) status(context.Context) (any, error) { return s.CurrentStatus(), nil }

// live is /livez: the stream (or standby) loop has not ended.
func (s *Service) live(context.Context) error {
	select {
	case <-s.ss.Done():
		return errors.New("capture loop ended")
	default:
		return nil
	}
}

// healthy: streaming with both links up, or waiting as a standby (or
// taking over) is healthy; starting, reconnecting and stopped are not.
func (s *Service) healthy(context.Context) error {
	if s.activeState.Load() {
		return s.links.ready()
	}
	s.mu.Lock()
	role := s.role
	s.mu.Unlock()
	if role == RoleStandby || role == RoleTakingOver {
		return nil
	}
	return errors.New("capture is not streaming")
}
