package erasure

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// LegalHold keeps the archived rows it covers past their expires_at
// (package projection/retention honours it) and refuses their erasure:
// the rows of Table whose key equals Key, or whose row contains Match.
// Not to be confused with hold mode (Config.HoldOnQuarantine of package
// projection, holdonquarantine.go), which keeps later events of a
// quarantined row back.
type LegalHold struct {
	ID        int64           `json:"id"`
	Table     string          `json:"table"`
	Key       json.RawMessage `json:"key,omitempty"`
	Match     json.RawMessage `json:"match,omitempty"`
	Reason    string          `json:"reason"`
	CreatedBy string          `json:"created_by"`
	CreatedAt time.Time       `json:"created_at"`
}

// querier is what a pool, a connection and a transaction all do.
type querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

func nullRaw(b json.RawMessage) *string {
	if len(b) == 0 {
		return nil
	}
	s := string(b)
	return &s
}

// LegalHoldOptions is what AddLegalHold records.
type LegalHoldOptions struct {
	Table      string          // schema.table
	Key, Match json.RawMessage // exactly one: the key equal to Key, or the rows containing Match
	Reason     string          // required
	Actor      string          // recorded as created_by
}

// AddLegalHold records a hold (exactly one of key and match) and returns it.
func AddLegalHold(ctx context.Context, db querier, opts LegalHoldOptions) (LegalHold, error) {
	schema, name, mode, sel, _, err := selector(opts.Table, opts.Key, opts.Match)
	if err != nil {
		return LegalHold{}, err
	}
	if _, err := checkShape(ctx, db, schema, name, mode, sel); err != nil {
		return LegalHold{}, err
	}
	if opts.Reason == "" {
		return LegalHold{}, fmt.Errorf("%w: a legal hold needs --reason TEXT", ErrBadSelector)
	}
	rows, err := db.Query(ctx, `
		INSERT INTO epitaph.legal_holds (schema_name, table_name, key, match, reason, created_by)
		VALUES ($1, $2, $3::jsonb, $4::jsonb, $5, $6)
		RETURNING `+holdColumns, schema, name, nullRaw(opts.Key), nullRaw(opts.Match), opts.Reason, opts.Actor)
	if err != nil {
		return LegalHold{}, fmt.Errorf("add legal hold: %w", err)
	}
	h, err := pgx.CollectExactlyOneRow(rows, scanHold)
	if err != nil {
		return LegalHold{}, fmt.Errorf("add legal hold: %w", err)
	}
	return h, nil
}

const holdColumns = `id, schema_name || '.' || table_name, key::text, match::text, reason, created_by, created_at`

func scanHold(r pgx.CollectableRow) (LegalHold, error) {
	var h LegalHold
	var key, match *string
	err := r.Scan(&h.ID, &h.Table, &key, &match, &h.Reason, &h.CreatedBy, &h.CreatedAt)
	if key != nil {
		h.Key = json.RawMessage(*key)
	}
	if match != nil {
		h.Match = json.RawMessage(*match)
	}
	return h, err
}

// ListLegalHolds returns every hold, oldest first.
func ListLegalHolds(ctx context.Context, db querier) ([]LegalHold, error) {
	rows, err := db.Query(ctx, `SELECT `+holdColumns+` FROM epitaph.legal_holds ORDER BY id`)
	if err != nil {
		return nil, fmt.Errorf("list legal holds: %w", err)
	}
	hs, err := pgx.CollectRows(rows, scanHold)
	if err != nil {
		return nil, fmt.Errorf("list legal holds: %w", err)
	}
	return hs, nil
}

// RemoveLegalHold deletes a hold; false when there is none with that id.
// Its rows expire with the next cleanup batch.
func RemoveLegalHold(ctx context.Context, db querier, id int64) (bool, error) {
	rows, err := db.Query(ctx, `DELETE FROM epitaph.legal_holds WHERE id = $1 RETURNING id`, id)
	if err != nil {
		return false, fmt.Errorf("remove legal hold %d: %w", id, err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return false, fmt.Errorf("remove legal hold %d: %w", id, err)
	}
	return len(ids) > 0, nil
}
