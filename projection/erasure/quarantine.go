package erasure

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"regexp"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/epitaph-dev/epitaph/event"
)

// quarantineMatcher finds the quarantine entries an erasure covers: the
// events of a matched row (by the fence's digest, as apply matches them)
// and the events of the rows erased with it (by identity).
//
// An entry whose message cannot be decoded as an event is matched by what
// can be read of it: its message id (the row's identity, for an erased
// child), the source key recorded when the body was read far enough, the
// table, key and row of a body that is still a JSON object (matched by
// value as an event is), and the raw bytes of one that is not (the table's
// name and every selected column with its value, as JSON writes them). A
// JSON object that names a table is read, match or not. An entry none of
// these can read is left as it is and counted on the receipt as unchecked
// (Receipt.Unchecked["epitaph.quarantine"]): it may still hold the data, in
// an encoding this cannot read, and the operator is told so.
type quarantineMatcher struct {
	key    []byte
	table  string // schema.table
	mode   string
	cols   []string
	sel    map[string]json.RawMessage
	digest string
	erased []rowIdentity

	msgIDs map[string]bool
	raw    []*regexp.Regexp
}

// quarantineUnchecked is the receipt's key for the unchecked entries.
const quarantineUnchecked = "epitaph.quarantine"

// erase clears the message (data, headers, source key) of every entry the
// erasure covers; the entry stays, discarded, as the audit record. It
// returns the unchecked counts.
func (q *quarantineMatcher) erase(ctx context.Context, tx pgx.Tx, id int64, removed map[string]int) (map[string]int, error) {
	if err := q.prepare(ctx, tx, id); err != nil {
		return nil, err
	}
	rows, err := tx.Query(ctx, `SELECT id, data, headers, source_schema || '.' || source_table, source_key
		FROM epitaph.quarantine WHERE length(data) > 0`)
	if err != nil {
		return nil, fmt.Errorf("read quarantine: %w", err)
	}
	var hit []int64
	unchecked := 0
	var qid int64
	var data []byte
	var headers map[string][]string
	var srcTable *string
	var srcKey json.RawMessage
	_, err = pgx.ForEachRow(rows, []any{&qid, &data, &headers, &srcTable, &srcKey}, func() error {
		matched, undecodable := q.matches(data, headers, srcTable, srcKey)
		switch {
		case matched:
			hit = append(hit, qid)
		case undecodable:
			unchecked++
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read quarantine: %w", err)
	}
	out := map[string]int{}
	if unchecked > 0 {
		out[quarantineUnchecked] = unchecked
	}
	if len(hit) == 0 {
		return out, nil
	}
	tag, err := tx.Exec(ctx, `
		UPDATE epitaph.quarantine
		   SET data = ''::bytea, headers = '{}', source_key = NULL,
		       status = CASE WHEN status = 'open' THEN 'discarded' ELSE status END,
		       resolved_at = COALESCE(resolved_at, now()),
		       resolution_reason = CASE WHEN status = 'open' THEN 'erased' ELSE resolution_reason END
		 WHERE id = ANY($1)`, hit)
	if err != nil {
		return nil, fmt.Errorf("erase quarantine payloads: %w", err)
	}
	removed["epitaph.quarantine"] += int(tag.RowsAffected())
	return out, nil
}

// prepare collects the message ids of the erased rows (this run's and the
// erasure's earlier ones) and the raw-bytes patterns of the selector.
func (q *quarantineMatcher) prepare(ctx context.Context, tx pgx.Tx, id int64) error {
	q.msgIDs = map[string]bool{}
	for _, r := range q.erased {
		q.msgIDs[event.MsgID(r.source, r.lsn, r.seq)] = true
	}
	rows, err := tx.Query(ctx, `SELECT source, commit_lsn::text, seq FROM epitaph.erased_rows WHERE erasure_id = $1`, id)
	if err != nil {
		return fmt.Errorf("read erased rows: %w", err)
	}
	var src, lsn string
	var seq int
	if _, err := pgx.ForEachRow(rows, []any{&src, &lsn, &seq}, func() error {
		l, err := event.ParseLSN(lsn)
		if err == nil {
			q.msgIDs[event.MsgID(src, l, seq)] = true
		}
		return err
	}); err != nil {
		return fmt.Errorf("read erased rows: %w", err)
	}
	q.raw = rawPatterns(q.table, q.cols, q.sel)
	return nil
}

// matches says whether the entry is covered, and whether its message could
// not be decoded.
func (q *quarantineMatcher) matches(data []byte, headers map[string][]string, srcTable *string, srcKey json.RawMessage) (matched, undecodable bool) {
	for _, id := range headers[event.HeaderMsgID] {
		if q.msgIDs[event.UntaggedMsgID(id)] {
			return true, false
		}
	}
	e, err := event.Decode(data)
	if err == nil {
		if e.Op != event.OpDelete || e.QualifiedTable() != q.table {
			return false, false
		}
		obj := e.Row
		if q.mode == EraseByKey {
			obj = e.Key
		}
		d, ok := rowDigest(q.key, q.table, q.mode, q.cols, obj)
		return ok && d == q.digest, false
	}
	if srcTable != nil && *srcTable == q.table && len(srcKey) > 0 {
		// The key a match selects on may be the key itself.
		if d, ok := rowDigest(q.key, q.table, q.mode, q.cols, srcKey); ok && d == q.digest {
			return true, true
		}
	}
	if m, ok := q.matchesJSON(data); ok {
		return m, false
	}
	for _, re := range q.raw {
		if !re.Match(data) {
			return false, true
		}
	}
	return len(q.raw) > 0, true
}

// looseEvent is what an undecodable message that is still a JSON object
// says of its row: the fields of a row event, whatever their order or
// spacing, with nothing else of the event required to be valid.
type looseEvent struct {
	Schema *string         `json:"schema"`
	Table  *string         `json:"table"`
	Key    json.RawMessage `json:"key"`
	Row    json.RawMessage `json:"row"`
}

// matchesJSON matches a message that is a JSON object but not a decodable
// event (a bad commit_lsn, a wrong version) by the table it names and its
// key or row, as a decoded event is matched. ok is false when the bytes are
// no JSON object, or name no table (then only the raw patterns can tell).
// A JSON object naming another table, or this table with another row, is
// read and not a match: it is not counted as unchecked.
func (q *quarantineMatcher) matchesJSON(data []byte) (matched, ok bool) {
	var le looseEvent
	if !json.Valid(data) || json.Unmarshal(data, &le) != nil || le.Table == nil {
		return false, false
	}
	schema, name, _ := strings.Cut(q.table, ".")
	if *le.Table != name || (le.Schema != nil && *le.Schema != schema) {
		return false, true
	}
	for _, obj := range []json.RawMessage{le.Key, le.Row} {
		if d, ok := rowDigest(q.key, q.table, q.mode, q.cols, obj); ok && d == q.digest {
			return true, true
		}
	}
	return false, true
}

// rawPatterns are the patterns an undecodable message's bytes must all
// match to be taken as the selected row's: the table's name as a JSON
// string and, for every selected column, "column": value as JSON writes it
// (a number not followed by more digits).
func rawPatterns(table string, cols []string, sel map[string]json.RawMessage) []*regexp.Regexp {
	_, name, _ := strings.Cut(table, ".")
	out := []*regexp.Regexp{regexp.MustCompile(regexp.QuoteMeta(jsonString(name)))}
	for _, c := range cols {
		v := sel[c]
		var alts []string
		for _, form := range jsonForms(v) {
			alts = append(alts, regexp.QuoteMeta(form))
		}
		if len(alts) == 0 {
			return nil
		}
		tail := ""
		if t := bytes.TrimSpace(v); len(t) > 0 && (t[0] == '-' || (t[0] >= '0' && t[0] <= '9')) {
			tail = `(?:[^0-9.eE]|$)`
		}
		out = append(out, regexp.MustCompile(regexp.QuoteMeta(jsonString(c))+`\s*:\s*(?:`+strings.Join(alts, "|")+`)`+tail))
	}
	return out
}

// jsonForms are the ways a JSON encoder commonly writes v: as given,
// canonical, and without HTML escaping.
func jsonForms(v json.RawMessage) []string {
	seen := map[string]bool{}
	var out []string
	add := func(s string) {
		if s != "" && !seen[s] {
			seen[s] = true
			out = append(out, s)
		}
	}
	add(string(bytes.TrimSpace(v)))
	if c, err := canonicalJSON(v); err == nil {
		add(string(c))
	}
	var x any
	if err := json.Unmarshal(v, &x); err == nil {
		var b bytes.Buffer
		enc := json.NewEncoder(&b)
		enc.SetEscapeHTML(false)
		if enc.Encode(x) == nil {
			add(strings.TrimSpace(b.String()))
		}
	}
	return out
}

func jsonString(s string) string {
	b, _ := json.Marshal(s)
	return string(b)
}
