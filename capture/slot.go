package capture

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/epitaph-dev/epitaph/event"
)

type slotState struct {
	exists    bool
	slotType  string
	plugin    string
	database  string
	activePID *int32
	walStatus *string
	confirmed *string
	failover  bool // created or altered with FAILOVER (PostgreSQL 17+)
	// synced: a copy a standby synced from its primary's slot (PostgreSQL
	// 17+; still true once that standby is promoted).
	synced bool
	// invalidation is pg_replication_slots.invalidation_reason
	// (PostgreSQL 17+; 18 adds idle_timeout, idle_replication_slot_timeout),
	// "" when valid or not reported.
	invalidation string
}

// sqlSlot reads failover through to_jsonb: the column exists from
// PostgreSQL 17 on, and the same query serves every version.
const sqlSlot = `
SELECT slot_type, coalesce(plugin, ''), coalesce(database::text, ''), active_pid, wal_status, confirmed_flush_lsn::text,
       coalesce((to_jsonb(s) ->> 'failover')::boolean, false), coalesce(to_jsonb(s) ->> 'invalidation_reason', ''),
       coalesce((to_jsonb(s) ->> 'synced')::boolean, false)
FROM pg_replication_slots s WHERE slot_name = $1`

func readSlot(ctx context.Context, pool *pgxpool.Pool, name string) (slotState, error) {
	var s slotState
	err := pool.QueryRow(ctx, sqlSlot, name).Scan(&s.slotType, &s.plugin, &s.database, &s.activePID, &s.walStatus, &s.confirmed, &s.failover, &s.invalidation, &s.synced)
	if errors.Is(err, pgx.ErrNoRows) {
		return slotState{}, nil
	}
	if err != nil {
		return slotState{}, fmt.Errorf("read replication slot %s: %w", name, err)
	}
	s.exists = true
	return s, nil
}

// gapInfo describes deletes lost upstream, to be published as a gap event.
type gapInfo struct {
	from   event.LSN
	to     event.LSN
	reason string
}

// slotPlan is what to do with the slot at start.
type slotPlan struct {
	create bool
	drop   bool
	gap    string // reason, when the new slot starts after a gap
}

// planSlot decides, failing closed on a gap unless recreate is set. If the
// process dies between creating the slot and the gap event being
// acknowledged, the next start sees a healthy slot and publishes no gap.
func planSlot(s slotState, name, db string, t tail, streamName string, recreate bool) (slotPlan, error) {
	if !s.exists {
		if !t.has {
			return slotPlan{create: true}, nil
		}
		if !recreate {
			return slotPlan{}, configErr("replication slot %q is missing but stream %s already holds events up to %s: deletes since then may have been lost. Restart once with --recreate-slot to create it and record a gap event", name, streamName, t.pos.lsn)
		}
		return slotPlan{create: true, gap: fmt.Sprintf("replication slot %q was missing", name)}, nil
	}
	if s.slotType != "logical" || s.plugin != "pgoutput" {
		return slotPlan{}, configErr("replication slot %q is a %s slot with plugin %q, capture needs a logical pgoutput slot: use another --slot", name, s.slotType, s.plugin)
	}
	if s.database != db {
		return slotPlan{}, configErr("replication slot %q belongs to database %q, not %q: use another --slot", name, s.database, db)
	}
	if s.activePID != nil {
		return slotPlan{}, configErr("replication slot %q is active in process %d (another capture?): stop it, or use another --slot", name, *s.activePID)
	}
	if (s.walStatus != nil && *s.walStatus == "lost") || s.confirmed == nil || s.invalidation != "" {
		why := invalidationCause(s)
		if !recreate {
			return slotPlan{}, configErr("replication slot %q was invalidated (%s): deletes were lost upstream. Restart once with --recreate-slot to recreate it and record a gap event", name, why)
		}
		return slotPlan{create: true, drop: true, gap: fmt.Sprintf("replication slot %q was invalidated (%s)", name, why)}, nil
	}
	if from, ok := slotPastRecord(s, t); ok {
		if !recreate {
			return slotPlan{}, configErr("replication slot %q starts at %s, past %s, the last position this capture confirmed to it and the last one stream %s holds: it was dropped and created again, or advanced, by someone else while the capture was away, and deletes since then may have been lost. Restart once with --recreate-slot to record a gap event", name, *s.confirmed, from, streamName)
		}
		return slotPlan{gap: fmt.Sprintf("replication slot %q started at %s, past the capture's last confirmed position %s (created again or advanced by someone else)", name, *s.confirmed, from)}, nil
	}
	return slotPlan{}, nil
}

// slotPastRecord reports whether the healthy slot s starts past every
// position the capture confirmed to its slot (t.recorded, recorded before
// each confirmation) and past the stream's tail: PostgreSQL streams from
// the slot's confirmed position whatever the capture asks, so the WAL in
// between was never decoded for the capture. A slot a promoted standby
// synced (s.synced) is the capture's own, and its record may not have
// reached the standby before the slot's position did; without a record
// (a capture older than it, no table on the source) nothing is known.
// It returns the position the capture had reached.
func slotPastRecord(s slotState, t tail) (event.LSN, bool) {
	if !t.has || t.recorded == 0 || s.synced || s.confirmed == nil {
		return 0, false
	}
	c, err := event.ParseLSN(*s.confirmed)
	if err != nil {
		return 0, false
	}
	reached := max(t.recorded, t.pos.lsn)
	return reached, c > reached
}

// invalidationCause says why PostgreSQL invalidated slot s, for a user.
func invalidationCause(s slotState) string {
	switch s.invalidation {
	case "idle_timeout":
		return "idle_timeout: inactive longer than idle_replication_slot_timeout"
	case "rows_removed":
		return "rows_removed: catalog rows it needed were vacuumed away"
	case "wal_level_insufficient":
		return "wal_level_insufficient: the primary's wal_level is below logical"
	case "", "wal_removed":
		return "wal_status lost: max_slot_wal_keep_size exceeded"
	}
	return s.invalidation
}

// minFailoverMajor is the first PostgreSQL with failover slots: a slot
// created (or altered) with FAILOVER is synced to the physical standbys
// that have sync_replication_slots on, so it survives their promotion.
const minFailoverMajor = 17

// serverMajor is the PostgreSQL major of conn's server, from the
// server_version it reports at connection ("17.10", "14.23 (Debian
// 14.23-1)"); 0 when it cannot be read.
func serverMajor(conn *pgconn.PgConn) int {
	v := conn.ParameterStatus("server_version")
	end := strings.IndexFunc(v, func(r rune) bool { return r < '0' || r > '9' })
	if end >= 0 {
		v = v[:end]
	}
	n, _ := strconv.Atoi(v)
	return n
}

// createSlot creates the permanent logical slot and returns its consistent
// point; with failover it has FAILOVER (the caller checks the server has
// it). pglogrepl's CreateReplicationSlot has no option for FAILOVER, and
// the option list (PostgreSQL 15+ syntax) is written here.
func createSlot(ctx context.Context, conn *pgconn.PgConn, name string, failover bool) (event.LSN, error) {
	var (
		res pglogrepl.CreateReplicationSlotResult
		err error
	)
	if failover {
		// name is checked against identRE by Config.
		res, err = pglogrepl.ParseCreateReplicationSlot(conn.Exec(ctx,
			"CREATE_REPLICATION_SLOT "+name+" LOGICAL pgoutput (SNAPSHOT 'nothing', FAILOVER true)"))
	} else {
		res, err = pglogrepl.CreateReplicationSlot(ctx, conn, name, "pgoutput", pglogrepl.CreateReplicationSlotOptions{
			Mode:           pglogrepl.LogicalReplication,
			SnapshotAction: "NOEXPORT_SNAPSHOT",
		})
	}
	if err != nil {
		return 0, fmt.Errorf("create replication slot %s: %w", name, slotErr(name, err))
	}
	lsn, err := event.ParseLSN(res.ConsistentPoint)
	if err != nil {
		return 0, fmt.Errorf("create replication slot %s: %w", name, err)
	}
	return lsn, nil
}

// While creating the slot takes long, the capture says what it waits for,
// first after slotWaitFirst, then every slotWaitEvery, and keeps waiting:
// PostgreSQL builds a logical slot's starting snapshot only once every
// transaction that holds an xid anywhere in the cluster (another database's
// too, a prepared one until it is committed) has ended.
const (
	slotWaitFirst = 5 * time.Second
	slotWaitEvery = 30 * time.Second
)

// sqlSlotBlockers lists what blocks the walsender $1: the sessions
// (pg_blocking_pids) and the prepared transactions (a prepared transaction
// blocks as pid 0). No query text: it may hold data.
const sqlSlotBlockers = `
SELECT format('pid %s (database %s, %s, %s, transaction open %ss, xid %s)', b.pid, coalesce(b.datname, '-'),
	coalesce(nullif(b.application_name, ''), b.backend_type), coalesce(b.state, '-'),
	coalesce(round(extract(epoch FROM now() - b.xact_start))::text, '?'), coalesce(b.backend_xid::text, '-'))
FROM pg_stat_activity b WHERE b.pid = ANY (pg_blocking_pids($1)) AND b.pid <> 0
UNION ALL
SELECT format('prepared transaction %s (database %s, prepared %ss ago, xid %s: COMMIT PREPARED or ROLLBACK PREPARED ends it)',
	quote_literal(p.gid), p.database, round(extract(epoch FROM now() - p.prepared)), p.transaction)
FROM pg_prepared_xacts p`

// reportSlotWaits logs what creating slot on the replication connection
// of backend pid waits for, until stop is called (stop returns once the
// reporting goroutine has ended).
func (s *Service) reportSlotWaits(ctx context.Context, slot string, pid uint32) (stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		start := time.Now()
		t := time.NewTimer(slotWaitFirst)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			s.logSlotWaits(ctx, slot, pid, time.Since(start))
			t.Reset(slotWaitEvery)
		}
	}()
	return func() { cancel(); <-done }
}

func (s *Service) logSlotWaits(ctx context.Context, slot string, pid uint32, waited time.Duration) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	var waitEvent string
	err := s.pool.QueryRow(ctx, `SELECT coalesce(wait_event_type || '/' || wait_event, 'none') FROM pg_stat_activity WHERE pid = $1`, int64(pid)).Scan(&waitEvent)
	var blockers []string
	if err == nil {
		var rows pgx.Rows
		if rows, err = s.pool.Query(ctx, sqlSlotBlockers, int64(pid)); err == nil {
			blockers, err = pgx.CollectRows(rows, pgx.RowTo[string])
		}
	}
	if err != nil {
		s.log.Warn("creating the replication slot takes long; cannot tell what it waits for", "slot", slot,
			"waited", waited.Round(time.Second), "err", redactErr(err))
		return
	}
	s.log.Warn("creating the replication slot waits for transactions running in the cluster to end (in any database); still waiting",
		"slot", slot, "waited", waited.Round(time.Second), "walsender_pid", pid, "wait_event", waitEvent, "blockers", blockers)
}

// alterSlotFailover sets FAILOVER on an existing (inactive) slot, so a
// slot made before, or by an older capture, follows --failover-slot.
func alterSlotFailover(ctx context.Context, conn *pgconn.PgConn, name string, on bool) error {
	if _, err := conn.Exec(ctx, "ALTER_REPLICATION_SLOT "+name+" (FAILOVER "+strconv.FormatBool(on)+")").ReadAll(); err != nil {
		return fmt.Errorf("alter replication slot %s (FAILOVER %t): %w", name, on, slotErr(name, err))
	}
	return nil
}

// slotFailover decides whether the slot is to have FAILOVER: asked for and
// the server has it. Once, where asked for on an older server, it says why
// not.
func (s *Service) slotFailover() bool {
	if s.cfg.NoFailoverSlot {
		return false
	}
	if major := serverMajor(s.repl); major < minFailoverMajor {
		s.failoverOnce.Do(func() {
			s.log.Info("replication slot without FAILOVER: PostgreSQL "+strconv.Itoa(major)+" has no failover slots (17+): a standby promoted after a failover has no copy of it",
				"slot", s.cfg.SlotName)
		})
		return false
	}
	return true
}

// syncSlotFailover gives an existing slot the FAILOVER setting
// slotFailover asks for (on 17+; an older server's slots have none).
func (s *Service) syncSlotFailover(ctx context.Context, slot slotState) error {
	if !slot.exists || serverMajor(s.repl) < minFailoverMajor {
		return nil
	}
	want := s.slotFailover()
	if slot.failover == want {
		return nil
	}
	if err := alterSlotFailover(ctx, s.repl, s.cfg.SlotName, want); err != nil {
		return err
	}
	s.log.Info("replication slot altered", "slot", s.cfg.SlotName, "failover", want)
	return nil
}

func dropSlot(ctx context.Context, conn *pgconn.PgConn, name string) error {
	if err := pglogrepl.DropReplicationSlot(ctx, conn, name, pglogrepl.DropReplicationSlotOptions{}); err != nil {
		return fmt.Errorf("drop replication slot %s: %w", name, slotErr(name, err))
	}
	return nil
}

// slotErr turns the server's errors about slots into clear permanent ones.
func slotErr(name string, err error) error {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return err
	}
	switch pgErr.Code {
	case "55006": // object_in_use
		return configErr("replication slot %q is active in another process (another capture?): stop it, or use another --slot (%s)", name, pgErr.Message)
	case "53400": // configuration_limit_exceeded
		return configErr("cannot create replication slot %q: %s (raise max_replication_slots and restart PostgreSQL)", name, pgErr.Message)
	case "42501":
		return configErr("replication slot %q: %s (the role needs the REPLICATION privilege)", name, pgErr.Message)
	case "42704": // undefined_object
		return configErr("replication slot %q does not exist: %s", name, pgErr.Message)
	}
	return err
}
