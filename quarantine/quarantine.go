// Package quarantine keeps the events a projector could not decode or apply,
// so that a bad event never blocks its partition and is never lost.
//
// The projector runtime calls Insert in the same target transaction that
// advances the partition's cursor past the event: the event is then either
// applied or quarantined, atomically. Operators list, show, replay (with the
// current code) or discard entries; resolved entries are kept as an audit
// record. Classify tells permanent failures (quarantine) from transient ones
// (retry with backoff, never quarantine).
package quarantine

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/epitaph-dev/epitaph/event"
)

// Category says why an event was quarantined.
type Category string

// Quarantine categories. The first three are the decoder's (event.Category);
// the others are assigned when applying.
const (
	CategoryMalformed      Category = Category(event.CategoryMalformed)      // not JSON, or not an object
	CategoryUnknownVersion Category = Category(event.CategoryUnknownVersion) // "v" this code does not know
	CategoryInvalid        Category = Category(event.CategoryInvalid)        // required fields missing or ill-typed
	CategoryIncompatible   Category = "incompatible"                         // decodes, but the read model rejects it
	CategoryOversized      Category = "oversized"                            // a referenced large value is too big to use
	CategoryMissingPayload Category = "missing_payload"                      // a referenced large value cannot be fetched
	// CategoryHeld is not a failure of the event itself: in hold mode it waits behind
	// an open entry for the same source row, so order per row is kept.
	CategoryHeld Category = "held"
	// CategoryUnauthenticated: the message failed verification:
	// unsigned, a bad signature or an untrusted key, or rows not
	// matching their commit's signed digest. Never replayed alone.
	CategoryUnauthenticated Category = "unauthenticated"
)

// Categories lists every category, in a stable order.
var Categories = []Category{CategoryMalformed, CategoryUnknownVersion, CategoryInvalid, CategoryIncompatible, CategoryOversized, CategoryMissingPayload, CategoryHeld, CategoryUnauthenticated}

// Status of an entry.
type Status string

// Entry statuses.
const (
	StatusOpen      Status = "open"
	StatusReplayed  Status = "replayed"
	StatusDiscarded Status = "discarded"
)

// Entry is one quarantined message as the projector hands it over: where it
// was in the stream, the message itself, and why it was set aside. Error
// must already be sanitized (see Sanitize); Insert sanitizes it again.
type Entry struct {
	Projection string              `json:"projection"`
	Version    int                 `json:"version"`
	Partition  int                 `json:"partition"`
	StreamSeq  uint64              `json:"stream_seq"`
	Subject    string              `json:"subject"`
	Headers    map[string][]string `json:"headers,omitempty"`
	// Data is the raw message (base64 in JSON); nil unless asked for.
	Data     []byte `json:"data,omitempty"`
	Category string `json:"category"`
	Error    string `json:"error"`
	// After is the partition's watermark (source LSN) when it met the
	// message: the message lies after it, so readers are told the archive
	// is complete at most up to After while the entry is open. Zero when
	// the partition had none (nothing can be claimed complete then).
	After event.LSN `json:"after_lsn"`
}

// Record is a stored entry with its bookkeeping.
type Record struct {
	ID int64 `json:"id"`
	Entry
	// Size is len(Data) even when Data was not loaded.
	Size             int             `json:"size"`
	SourceSchema     string          `json:"source_schema,omitempty"`
	SourceTable      string          `json:"source_table,omitempty"`
	SourceKey        json.RawMessage `json:"source_key,omitempty"`
	FirstSeen        time.Time       `json:"first_seen"`
	LastAttemptAt    time.Time       `json:"last_attempt_at"`
	Attempts         int             `json:"attempts"`
	Status           Status          `json:"status"`
	ResolvedAt       *time.Time      `json:"resolved_at,omitempty"`
	ResolutionReason string          `json:"resolution_reason,omitempty"`
}

// maxErrorLen bounds the stored error text.
const maxErrorLen = 2000

const insertSQL = `
INSERT INTO epitaph.quarantine AS q
    (projection, version, partition, stream_seq, subject, headers, data,
     category, error, source_schema, source_table, source_key, after_lsn, stream_created)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13::text::pg_lsn,
        -- the stream the partition's cursor counts in (its sequences are
        -- that stream's): a stream made anew numbers from 1 again
        COALESCE((SELECT p.stream_created FROM epitaph.progress p
                  WHERE p.projection = $1 AND p.version = $2 AND p.partition = $3), '-infinity'))
ON CONFLICT ON CONSTRAINT quarantine_event_once DO UPDATE
SET attempts        = q.attempts + 1,
    last_attempt_at = now(),
    -- an event re-delivered behind itself in hold mode keeps its own category;
    -- a resolved entry keeps those it was resolved with (its audit record)
    category        = CASE WHEN EXCLUDED.category = 'held' OR q.status <> 'open' THEN q.category ELSE EXCLUDED.category END,
    error           = CASE WHEN EXCLUDED.category = 'held' OR q.status <> 'open' THEN q.error ELSE EXCLUDED.error END`

// Insert records e in tx, the transaction that advances the cursor past the
// event. It is idempotent per (projection, version, stream, stream
// sequence), the stream named by the creation time the partition's cursor
// records (a stream made anew numbers from 1 again): a re-delivered event is not quarantined twice; the existing entry's attempts
// are bumped and, while it is open, its category and error updated. A
// resolved entry stays resolved with the category and error it was resolved
// with (its audit record).
//
// Insert never fails because of what the message holds: text that Postgres
// cannot store (NUL bytes, invalid UTF-8) is cleaned, and the source row key
// is recorded only when it can be read safely.
func Insert(ctx context.Context, tx pgx.Tx, e Entry) error {
	if e.Projection == "" || e.Category == "" {
		return fmt.Errorf("quarantine insert: projection and category are required")
	}
	headers, err := json.Marshal(cleanHeaders(e.Headers))
	if err != nil {
		return fmt.Errorf("quarantine insert: encode headers: %w", err)
	}
	data := e.Data
	if data == nil {
		data = []byte{}
	}
	src := sourceOf(data)
	_, err = tx.Exec(ctx, insertSQL,
		cleanText(e.Projection), e.Version, e.Partition, int64(e.StreamSeq), cleanText(e.Subject),
		headers, data, cleanText(e.Category), truncate(cleanText(e.Error), maxErrorLen),
		src.schema, src.table, src.key, e.After.String())
	if err != nil {
		return fmt.Errorf("quarantine insert %s v%d seq %d: %w", e.Projection, e.Version, e.StreamSeq, err)
	}
	return nil
}

// cleanText makes s storable as Postgres text: valid UTF-8, no NUL.
func cleanText(s string) string {
	s = strings.ToValidUTF8(s, "\uFFFD")
	return strings.ReplaceAll(s, "\x00", "")
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	s = s[:n]
	for len(s) > 0 && !utf8.ValidString(s) {
		s = s[:len(s)-1]
	}
	return s + "…"
}

func cleanHeaders(h map[string][]string) map[string][]string {
	out := make(map[string][]string, len(h))
	for k, vs := range h {
		cvs := make([]string, len(vs))
		for i, v := range vs {
			cvs[i] = cleanText(v)
		}
		out[cleanText(k)] = cvs
	}
	return out
}

// source is the source row a message is about, as far as it can be told.
type source struct {
	schema, table *string
	key           []byte // normalized JSON object, or nil
}

// sourceOf reads schema, table and key from a message body without
// requiring the rest of it to be valid, for hold mode.
func sourceOf(data []byte) source {
	var probe struct {
		Schema json.RawMessage `json:"schema"`
		Table  json.RawMessage `json:"table"`
		Key    json.RawMessage `json:"key"`
	}
	var s source
	if json.Unmarshal(data, &probe) != nil {
		return s
	}
	var schema, table string
	if json.Unmarshal(probe.Schema, &schema) != nil || json.Unmarshal(probe.Table, &table) != nil ||
		schema == "" || table == "" {
		return s
	}
	schema, table = cleanText(schema), cleanText(table)
	s.schema, s.table = &schema, &table
	s.key = normalizeKey(probe.Key)
	return s
}

// normalizeKey returns key as JSON that jsonb accepts, or nil when key is
// not an object or cannot be stored (a NUL character, which no Postgres key
// can hold anyway). Numbers keep their exact digits.
func normalizeKey(key []byte) []byte {
	t := bytes.TrimSpace(key)
	if len(t) == 0 || t[0] != '{' {
		return nil
	}
	dec := json.NewDecoder(bytes.NewReader(t))
	dec.UseNumber()
	var v map[string]any
	if dec.Decode(&v) != nil {
		return nil
	}
	out, err := json.Marshal(v) // lone surrogates become U+FFFD, as jsonb wants
	if err != nil || bytes.Contains(out, []byte(`\u0000`)) {
		return nil
	}
	return out
}

// Querier is what the read-side functions need: a pool, a connection or a
// transaction.
type Querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}
