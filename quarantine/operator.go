package quarantine

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
)

// Typed errors of the operator API.
var (
	ErrNotFound = errors.New("quarantine entry not found")
	ErrNotOpen  = errors.New("quarantine entry is already resolved")
)

// Filter selects entries. Zero fields match everything (Status "" matches
// every status; operators usually want StatusOpen).
type Filter struct {
	Projection string
	Version    int
	Category   Category
	Status     Status
	// Limit caps the number of entries returned by List (0: no limit).
	Limit int
}

func (f Filter) where(args *[]any) string {
	var conds []string
	add := func(cond string, v any) {
		*args = append(*args, v)
		conds = append(conds, fmt.Sprintf(cond, len(*args)))
	}
	if f.Projection != "" {
		add("projection = $%d", f.Projection)
	}
	if f.Version != 0 {
		add("version = $%d", f.Version)
	}
	if f.Category != "" {
		add("category = $%d", string(f.Category))
	}
	if f.Status != "" {
		add("status = $%d", string(f.Status))
	}
	if len(conds) == 0 {
		return "true"
	}
	return strings.Join(conds, " AND ")
}

// recordColumns are read by scanRecord; $data is data or NULL.
const recordColumns = `id, projection, version, partition, stream_seq, subject, headers, %s, octet_length(data),
    category, error, source_schema, source_table, source_key, first_seen, last_attempt_at, attempts,
    status, resolved_at, resolution_reason`

func scanRecord(row pgx.Row) (Record, error) {
	var r Record
	var seq int64
	var schema, table, reason *string
	var status string
	err := row.Scan(&r.ID, &r.Projection, &r.Version, &r.Partition, &seq, &r.Subject, &r.Headers, &r.Data, &r.Size,
		&r.Category, &r.Error, &schema, &table, &r.SourceKey, &r.FirstSeen, &r.LastAttemptAt, &r.Attempts,
		&status, &r.ResolvedAt, &reason)
	if err != nil {
		return Record{}, err
	}
	r.StreamSeq = uint64(seq)
	r.Status = Status(status)
	r.SourceSchema, r.SourceTable, r.ResolutionReason = deref(schema), deref(table), deref(reason)
	return r, nil
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

// List returns the entries matching f, in (projection, version, stream
// sequence) order, without their payloads (Size tells how big they are).
func List(ctx context.Context, db Querier, f Filter) ([]Record, error) {
	var args []any
	sql := "SELECT " + fmt.Sprintf(recordColumns, "NULL::bytea") + " FROM epitaph.quarantine WHERE " +
		f.where(&args) + " ORDER BY projection, version, stream_created, stream_seq"
	if f.Limit > 0 {
		sql += fmt.Sprintf(" LIMIT %d", f.Limit)
	}
	rows, err := db.Query(ctx, sql, args...)
	if err != nil {
		return nil, fmt.Errorf("list quarantine: %w", err)
	}
	defer rows.Close()
	var out []Record
	for rows.Next() {
		r, err := scanRecord(rows)
		if err != nil {
			return nil, fmt.Errorf("list quarantine: %w", err)
		}
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list quarantine: %w", err)
	}
	return out, nil
}

// Show returns one entry; its raw message (Data) only when withPayload,
// since the message holds row values.
func Show(ctx context.Context, db Querier, id int64, withPayload bool) (Record, error) {
	data := "NULL::bytea"
	if withPayload {
		data = "data"
	}
	r, err := scanRecord(db.QueryRow(ctx, "SELECT "+fmt.Sprintf(recordColumns, data)+
		" FROM epitaph.quarantine WHERE id = $1", id))
	if errors.Is(err, pgx.ErrNoRows) {
		return Record{}, fmt.Errorf("show quarantine entry %d: %w", id, ErrNotFound)
	}
	if err != nil {
		return Record{}, fmt.Errorf("show quarantine entry %d: %w", id, err)
	}
	return r, nil
}

// Discard resolves an open entry without applying it. The entry is kept as
// an audit record with status discarded, the time and the reason, which is
// required.
func Discard(ctx context.Context, db Querier, id int64, reason string) error {
	reason = strings.TrimSpace(reason)
	if reason == "" {
		return fmt.Errorf("discard quarantine entry %d: a reason is required", id)
	}
	tag, err := db.Exec(ctx, `
UPDATE epitaph.quarantine
SET status = 'discarded', resolved_at = now(), resolution_reason = $2
WHERE id = $1 AND status = 'open'`, id, cleanText(reason))
	if err != nil {
		return fmt.Errorf("discard quarantine entry %d: %w", id, err)
	}
	if tag.RowsAffected() == 1 {
		return nil
	}
	return fmt.Errorf("discard quarantine entry %d: %w", id, notOpenOrMissing(ctx, db, id))
}

func notOpenOrMissing(ctx context.Context, db Querier, id int64) error {
	var status string
	err := db.QueryRow(ctx, `SELECT status FROM epitaph.quarantine WHERE id = $1`, id).Scan(&status)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return ErrNotFound
	case err != nil:
		return err
	}
	return fmt.Errorf("%w (%s)", ErrNotOpen, status)
}
