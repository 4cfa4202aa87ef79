package capture

import (
	"context"
	"errors"
	"fmt"

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
}

const sqlSlot = `
SELECT slot_type, coalesce(plugin, ''), coalesce(database::text, ''), active_pid, wal_status, confirmed_flush_lsn::text
FROM pg_replication_slots WHERE slot_name = $1`

func readSlot(ctx context.Context, pool *pgxpool.Pool, name string) (slotState, error) {
	var s slotState
	err := pool.QueryRow(ctx, sqlSlot, name).Scan(&s.slotType, &s.plugin, &s.database, &s.activePID, &s.walStatus, &s.confirmed)
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

// planSlot decides, failing closed on a gap unless recreate is set.
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
	if (s.walStatus != nil && *s.walStatus == "lost") || s.confirmed == nil {
		if !recreate {
			return slotPlan{}, configErr("replication slot %q was invalidated (wal_status lost: max_slot_wal_keep_size exceeded): deletes were lost upstream. Restart once with --recreate-slot to recreate it and record a gap event", name)
		}
		return slotPlan{create: true, drop: true, gap: fmt.Sprintf("replication slot %q was invalidated (wal_status lost)", name)}, nil
	}
	return slotPlan{}, nil
}

// createSlot creates the permanent logical slot and returns its consistent
// point.
func createSlot(ctx context.Context, conn *pgconn.PgConn, name string) (event.LSN, error) {
	res, err := pglogrepl.CreateReplicationSlot(ctx, conn, name, "pgoutput", pglogrepl.CreateReplicationSlotOptions{
		Mode:           pglogrepl.LogicalReplication,
		SnapshotAction: "NOEXPORT_SNAPSHOT",
	})
	if err != nil {
		return 0, fmt.Errorf("create replication slot %s: %w", name, slotErr(name, err))
	}
	lsn, err := event.ParseLSN(res.ConsistentPoint)
	if err != nil {
		return 0, fmt.Errorf("create replication slot %s: %w", name, err)
	}
	return lsn, nil
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
