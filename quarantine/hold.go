package quarantine

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// SourceRow is the identity the quarantine records for a source row, the
// one Held matches: schema and table as stored text and the key normalized
// as jsonb accepts it. ok is false when the key is not a JSON object or
// cannot be stored: such a row is never held.
func SourceRow(schema, table string, key []byte) (storedSchema, storedTable string, storedKey []byte, ok bool) {
	k := normalizeKey(key)
	if k == nil {
		return "", "", nil, false
	}
	return cleanText(schema), cleanText(table), k, true
}

// HeldRow names the source row Held looks for, in one version of a
// projection.
type HeldRow struct {
	Projection    string
	Version       int
	Schema, Table string
	Key           []byte // the key as JSON
}

// Held reports whether an open entry exists for the source row (Schema,
// Table, Key) in (Projection, Version). In hold mode the runtime then
// quarantines the event with category Held instead of applying it, so the
// events of one row are applied in order; Replay releases them in stream
// order once the entry in front is resolved. Call it in the batch
// transaction, after the batch's earlier events were applied or
// quarantined, so entries made by the same batch count. A key that is not
// a JSON object (or cannot be stored) is never held.
func Held(ctx context.Context, tx pgx.Tx, r HeldRow) (bool, error) {
	k := normalizeKey(r.Key)
	if k == nil {
		return false, nil
	}
	var held bool
	err := tx.QueryRow(ctx, `
SELECT EXISTS (
    SELECT 1 FROM epitaph.quarantine
    WHERE projection = $1 AND version = $2 AND status = 'open'
      AND source_schema = $3 AND source_table = $4 AND source_key = $5)`,
		r.Projection, r.Version, cleanText(r.Schema), cleanText(r.Table), k).Scan(&held)
	if err != nil {
		return false, fmt.Errorf("check quarantine hold %s.%s: %w", r.Schema, r.Table, err)
	}
	return held, nil
}
