package quarantine

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// ApplyFunc is provided by the projector: decode e.Data with the current
// code and apply it into the read model of (e.Projection, e.Version), in tx.
// It returns an error Classify calls permanent when the event still cannot
// be used, and a transient error when the target is unavailable.
type ApplyFunc func(ctx context.Context, tx pgx.Tx, e Entry) error

// Beginner starts transactions: a pool or a connection.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// Selection says which entries to replay: one entry by ID, or (ID 0) every
// open entry matching Filter (Status and Limit are ignored).
type Selection struct {
	ID     int64
	Filter Filter
	// Hold: the projector runs in hold mode (Config.HoldOnQuarantine of
	// package projection), so every entry of a source row waits behind an
	// earlier open entry of that row, whatever its category: an event that
	// failed on its own behind one (unknown_version, say) kept its category
	// instead of held, and must not reach the read model ahead of it.
	Hold bool
}

// ReplayResult lists the entries replayed, still failing, and still held
// behind an open entry for the same source row.
type ReplayResult struct {
	Replayed []int64 `json:"replayed"`
	Failed   []int64 `json:"failed"`
	Held     []int64 `json:"held"`
}

// Replay applies open entries again with the current code, in stream
// sequence order, one transaction per entry. On success the entry is marked
// replayed in the same transaction that applied it, so a replay is applied
// exactly once even when replays race (the entry row is locked and must
// still be open). On a permanent failure the entry stays open with attempts
// incremented and the new category and error. A held entry (in hold mode,
// sel.Hold, any entry) is not replayed while an earlier open entry for the
// same source row remains. A transient error stops the replay and is
// returned; entries not reached stay open.
//
// Selecting a single entry that is not open returns ErrNotOpen (or
// ErrNotFound).
func Replay(ctx context.Context, db Beginner, sel Selection, apply ApplyFunc) (ReplayResult, error) {
	var res ReplayResult
	ids, err := replayIDs(ctx, db, sel)
	if err != nil {
		return res, err
	}
	for _, id := range ids {
		outcome, err := replayOne(ctx, db, id, sel.Hold, apply)
		if errors.Is(err, ErrNotOpen) && sel.ID == 0 {
			continue // resolved meanwhile by someone else
		}
		if err != nil {
			return res, err
		}
		switch outcome {
		case replayed:
			res.Replayed = append(res.Replayed, id)
		case failed:
			res.Failed = append(res.Failed, id)
		case held:
			res.Held = append(res.Held, id)
		}
	}
	return res, nil
}

func replayIDs(ctx context.Context, db Beginner, sel Selection) ([]int64, error) {
	if sel.ID != 0 {
		return []int64{sel.ID}, nil
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("replay quarantine: %w", err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // read-only
	f := sel.Filter
	f.Status, f.Limit = StatusOpen, 0
	var args []any
	rows, err := tx.Query(ctx, "SELECT id FROM epitaph.quarantine WHERE "+f.where(&args)+
		" ORDER BY stream_created, stream_seq, projection, version", args...)
	if err != nil {
		return nil, fmt.Errorf("replay quarantine: select entries: %w", err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return nil, fmt.Errorf("replay quarantine: select entries: %w", err)
	}
	return ids, nil
}

type outcome int

const (
	replayed outcome = iota + 1
	failed
	held
)

func replayOne(ctx context.Context, db Beginner, id int64, hold bool, apply ApplyFunc) (outcome, error) {
	tx, err := db.Begin(ctx)
	if err != nil {
		return 0, fmt.Errorf("replay quarantine entry %d: %w", id, err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // after Commit this is a no-op

	r, err := scanRecord(tx.QueryRow(ctx, "SELECT "+fmt.Sprintf(recordColumns, "data")+
		" FROM epitaph.quarantine WHERE id = $1 FOR UPDATE", id))
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, fmt.Errorf("replay quarantine entry %d: %w", id, ErrNotFound)
	}
	if err != nil {
		return 0, fmt.Errorf("replay quarantine entry %d: %w", id, err)
	}
	if r.Status != StatusOpen {
		return 0, fmt.Errorf("replay quarantine entry %d: %w (%s)", id, ErrNotOpen, r.Status)
	}
	if (hold || Category(r.Category) == CategoryHeld) && r.SourceKey != nil {
		var blocked bool
		err := tx.QueryRow(ctx, `
SELECT EXISTS (
    SELECT 1 FROM epitaph.quarantine
    WHERE projection = $1 AND version = $2 AND status = 'open'
      AND (stream_created, stream_seq) < ((SELECT stream_created FROM epitaph.quarantine WHERE id = $7), $3)
      AND source_schema = $4 AND source_table = $5 AND source_key = $6)`,
			r.Projection, r.Version, int64(r.StreamSeq), r.SourceSchema, r.SourceTable, []byte(r.SourceKey), id).Scan(&blocked)
		if err != nil {
			return 0, fmt.Errorf("replay quarantine entry %d: check hold: %w", id, err)
		}
		if blocked {
			return held, nil
		}
	}

	sp, err := tx.Begin(ctx) // savepoint: a failed apply must not abort the bookkeeping
	if err != nil {
		return 0, fmt.Errorf("replay quarantine entry %d: %w", id, err)
	}
	applyErr := apply(ctx, sp, r.Entry)
	if applyErr == nil {
		if err := sp.Commit(ctx); err != nil {
			applyErr = err
		}
	}
	if applyErr != nil {
		_ = sp.Rollback(ctx)
		cat, permanent := Classify(applyErr)
		if !permanent {
			return 0, fmt.Errorf("replay quarantine entry %d: %w", id, applyErr)
		}
		_, err := tx.Exec(ctx, `
UPDATE epitaph.quarantine
SET attempts = attempts + 1, last_attempt_at = now(), category = $2, error = $3
WHERE id = $1`, id, string(cat), Sanitize(applyErr))
		if err != nil {
			return 0, fmt.Errorf("replay quarantine entry %d: record failure: %w", id, err)
		}
		if err := tx.Commit(ctx); err != nil {
			return 0, fmt.Errorf("replay quarantine entry %d: record failure: %w", id, err)
		}
		return failed, nil
	}
	_, err = tx.Exec(ctx, `
UPDATE epitaph.quarantine
SET status = 'replayed', resolved_at = now(), last_attempt_at = now(), attempts = attempts + 1,
    resolution_reason = 'replayed'
WHERE id = $1`, id)
	if err != nil {
		return 0, fmt.Errorf("replay quarantine entry %d: mark replayed: %w", id, err)
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, fmt.Errorf("replay quarantine entry %d: commit: %w", id, err)
	}
	return replayed, nil
}
