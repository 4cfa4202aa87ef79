package projection

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/projection/version"
	"github.com/epitaph-dev/epitaph/quarantine"
)

// Hold mode (Config.HoldOnQuarantine): a delete event whose source row
// (schema, table, key) has an open quarantine entry in its projection
// version, or an earlier event in the same page that is being quarantined,
// is quarantined with category held instead of being applied, so the events
// of one row reach the read model in stream order; quarantine.Replay
// releases held entries in order once the entry in front is resolved.
//
// Within a partition the order is exact. Events of one row can live in
// different partitions (partitions are by commit LSN): there an event is
// held only behind entries committed before its page was applied.
//
// When hold mode is off, none of this runs and no query is made.

// errHeld is the failure recorded for a held event.
var errHeld = errors.New("held behind an open quarantine entry for the same source row (hold mode)")

// rowKey is a source row: schema, table and the key as normalized JSON.
type rowKey struct{ schema, table, key string }

// holder is one page's hold state in one apply transaction.
type holder struct {
	keys map[*item]rowKey // items that name a source row
	open map[rowKey]bool  // rows of the page with an open entry in the database
}

// holdBefore marks the page's delete events that must wait (category held)
// and returns the rows to insert: those not quarantined for any reason.
// Off: rows unchanged, nil holder, no query.
func (s *Service) holdBefore(ctx context.Context, tx pgx.Tx, v version.Version, items []*item, rows []*archiveRow) (*holder, []*archiveRow, error) {
	if !s.cfg.HoldOnQuarantine {
		return nil, rows, nil
	}
	h := &holder{keys: map[*item]rowKey{}, open: map[rowKey]bool{}}
	var cand []rowKey
	seen := map[rowKey]bool{}
	for _, it := range items {
		k, ok := itemRowKey(it)
		if !ok {
			continue
		}
		h.keys[it] = k
		if it.ev != nil && it.ev.Op == event.OpDelete && it.category == "" && !seen[k] {
			seen[k] = true
			cand = append(cand, k)
		}
	}
	if err := h.queryOpen(ctx, tx, v, cand); err != nil {
		return nil, nil, err
	}
	h.mark(items)
	out := make([]*archiveRow, 0, len(rows))
	for _, r := range rows {
		if r.item.category == "" {
			out = append(out, r)
		}
	}
	return h, out, nil
}

// holdAfter runs after the page's rows were inserted: a row inserted behind
// an event of the same row that was rejected in the same page must wait
// instead. It marks such rows held and returns an error wrapping errCareful,
// so the page is applied again (the marks kept, the rows left out). nil
// holder (hold off): nothing.
func (h *holder) holdAfter(items []*item) error {
	if h == nil {
		return nil
	}
	if n := h.mark(items); n > 0 {
		return fmt.Errorf("%w: %d events must wait behind a rejected event of the same row", errCareful, n)
	}
	return nil
}

// mark walks the page in stream order and marks each delete event not yet
// quarantined whose row is blocked (an open entry, or an earlier event of
// the row in this page being quarantined) as held. It returns how many it
// marked.
func (h *holder) mark(items []*item) int {
	blocked := make(map[rowKey]bool, len(h.open))
	for k := range h.open {
		blocked[k] = true
	}
	n := 0
	for _, it := range items {
		k, ok := h.keys[it]
		if !ok {
			continue
		}
		if it.category != "" {
			blocked[k] = true
			continue
		}
		if it.ev != nil && it.ev.Op == event.OpDelete && blocked[k] {
			it.category, it.failure = string(quarantine.CategoryHeld), errHeld
			n++
		}
	}
	return n
}

// queryOpen looks up, in one query, which of the rows have an open entry
// (the condition of quarantine.Held, for the whole page at once).
func (h *holder) queryOpen(ctx context.Context, tx pgx.Tx, v version.Version, keys []rowKey) error {
	if len(keys) == 0 {
		return nil
	}
	schemas, tables, ks := make([]string, len(keys)), make([]string, len(keys)), make([]string, len(keys))
	for i, k := range keys {
		schemas[i], tables[i], ks[i] = k.schema, k.table, k.key
	}
	rows, err := tx.Query(ctx, `
SELECT k.i - 1
FROM unnest($3::text[], $4::text[], $5::text[]) WITH ORDINALITY AS k(s, t, key, i)
WHERE EXISTS (
    SELECT 1 FROM epitaph.quarantine q
    WHERE q.projection = $1 AND q.version = $2 AND q.status = 'open' AND q.source_key IS NOT NULL
      AND q.source_schema = k.s AND q.source_table = k.t AND q.source_key = k.key::jsonb)`,
		v.Projection, v.Version, schemas, tables, ks)
	if err != nil {
		return fmt.Errorf("check quarantine hold: %w", err)
	}
	idx, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return fmt.Errorf("check quarantine hold: %w", err)
	}
	for _, i := range idx {
		h.open[keys[i]] = true
	}
	return nil
}

// itemRowKey is the source row an event is about: from the decoded delete
// event, or read from the raw body of an event that could not be decoded
// (as the quarantine records it). False when it cannot be told.
func itemRowKey(it *item) (rowKey, bool) {
	var schema, table string
	var key []byte
	switch {
	case it.ev != nil && it.ev.Op == event.OpDelete:
		schema, table, key = it.ev.Schema, it.ev.Table, it.ev.Key
	case it.ev != nil:
		return rowKey{}, false
	default:
		var probe struct {
			Schema json.RawMessage `json:"schema"`
			Table  json.RawMessage `json:"table"`
			Key    json.RawMessage `json:"key"`
		}
		if json.Unmarshal(it.data, &probe) != nil ||
			json.Unmarshal(probe.Schema, &schema) != nil || json.Unmarshal(probe.Table, &table) != nil {
			return rowKey{}, false
		}
		key = probe.Key
	}
	if schema == "" || table == "" {
		return rowKey{}, false
	}
	s, t, k, ok := quarantine.SourceRow(schema, table, key)
	if !ok {
		return rowKey{}, false
	}
	return rowKey{schema: s, table: t, key: string(k)}, true
}
