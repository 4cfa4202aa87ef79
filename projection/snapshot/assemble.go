package snapshot

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/tidwall/gjson"

	"github.com/epitaph-dev/epitaph/event"
)

// archiveRow is one archive row of a transaction, as assembly reads it.
type archiveRow struct {
	Schema     string
	Table      string
	Identity   string // full, key or nothing
	Key        json.RawMessage
	Row        json.RawMessage
	Refs       []event.Ref
	CommitLSN  event.LSN
	Seq        int
	ArchivedAt time.Time
	CommitTime time.Time

	// cols: the row's columns some foreign key of the group names
	// (parse), those the image holds (NULL included), each with its match
	// form (ok false when NULL or not comparable). A handful per row: a
	// slice, not maps (two maps a row were a visible share of assembly).
	cols []colValue
	q    string // qualified()
}

type colValue struct {
	name, form string
	ok         bool
}

// qualified is "schema.table", made once per row (it is asked for often).
func (r *archiveRow) qualified() string {
	if r.q == "" {
		r.q = r.Schema + "." + r.Table
	}
	return r.q
}

// parse reads the columns in want from the row image, once, reading only
// its top level. A row that is not a JSON object has no values; as with
// encoding/json, a repeated name keeps its last value.
func (r *archiveRow) parse(want map[string]bool) {
	r.cols = r.cols[:0]
	s := string(r.Row)
	if !gjson.Valid(s) {
		return
	}
	obj := gjson.Parse(s)
	if !obj.IsObject() {
		return
	}
	obj.ForEach(func(k, v gjson.Result) bool {
		if want[k.Str] {
			f, ok := matchForm(v)
			if i := r.col(k.Str); i >= 0 {
				r.cols[i] = colValue{k.Str, f, ok}
			} else {
				r.cols = append(r.cols, colValue{k.Str, f, ok})
			}
		}
		return true
	})
}

func (r *archiveRow) col(name string) int {
	for i := range r.cols {
		if r.cols[i].name == name {
			return i
		}
	}
	return -1
}

// has reports whether the row image holds column col (NULL included); col
// must be one parse was asked for (a column some foreign key names).
func (r *archiveRow) has(col string) bool { return r.col(col) >= 0 }

// value returns the comparable form of column col, and false when the
// column is absent or NULL (a NULL foreign key references nothing).
func (r *archiveRow) value(col string) (string, bool) {
	if i := r.col(col); i >= 0 && r.cols[i].ok {
		return r.cols[i].form, true
	}
	return "", false
}

// matchForm maps a value of the wire encoding to a string equal for equal
// SQL values of compatible types: a string's content (text forms), a
// number's exact digits, other JSON compacted. So an integer key matches an
// integer foreign key, and a numeric "1" one of integer 1.
func matchForm(v gjson.Result) (string, bool) {
	switch v.Type {
	case gjson.Null:
		return "", false
	case gjson.String:
		return v.Str, true
	case gjson.Number:
		return strings.TrimSpace(v.Raw), true
	default:
		var buf bytes.Buffer
		if err := json.Compact(&buf, []byte(v.Raw)); err != nil {
			return "", false
		}
		return buf.String(), true
	}
}

// group is the archive rows of one source transaction with the candidate
// parent -> child edges between them, derived from the rows' foreign key
// refs.
type group struct {
	correlationID string
	rows          []*archiveRow // by seq
	children      [][]int       // children[i]: rows whose foreign key points at row i, by seq
	bySeq         map[int]int
	// walked: the subtrees unrelated walked, by root row, each taken
	// by the root's document (walked once, not twice).
	walked map[int]walk
}

type walk struct {
	children map[string][]*node
	members  []int
}

// refKey identifies (table, columns, values) for the parent lookup: each
// part length-prefixed, so distinct lists never make the same key.
func refKey(table string, cols []string, vals []string) string {
	n := len(table) + 8
	for i := range cols {
		n += len(cols[i]) + len(vals[i]) + 16
	}
	b := make([]byte, 0, n)
	add := func(s string) {
		b = strconv.AppendInt(b, int64(len(s)), 10)
		b = append(b, ':')
		b = append(b, s...)
	}
	add(table)
	for _, c := range cols {
		add(c)
	}
	b = append(b, '=')
	for _, v := range vals {
		add(v)
	}
	return string(b)
}

func newGroup(correlationID string, rows []*archiveRow) *group {
	slices.SortFunc(rows, func(a, b *archiveRow) int { return a.Seq - b.Seq })
	g := &group{correlationID: correlationID, rows: rows, children: make([][]int, len(rows)), bySeq: map[int]int{}}
	for i, r := range rows {
		g.bySeq[r.Seq] = i
	}
	// Which (table, referenced columns) pairs are referenced at all, so
	// each row is indexed only under the keys some child looks up; and
	// which columns are read at all.
	wanted := map[string][][]string{}
	cols := map[string]bool{}
	for _, r := range rows {
		for _, f := range r.Refs {
			t := f.Schema + "." + f.Table
			if !slices.ContainsFunc(wanted[t], func(c []string) bool { return slices.Equal(c, f.RefColumns) }) {
				wanted[t] = append(wanted[t], f.RefColumns)
			}
			for _, c := range f.Columns {
				cols[c] = true
			}
			for _, c := range f.RefColumns {
				cols[c] = true
			}
		}
	}
	for _, r := range rows {
		r.parse(cols)
	}
	parents := map[string][]int{}
	for i, r := range rows {
		for _, cols := range wanted[r.qualified()] {
			if vals, ok := valuesOf(r, cols); ok {
				k := refKey(r.qualified(), cols, vals)
				parents[k] = append(parents[k], i)
			}
		}
	}
	for i, r := range rows {
		for _, f := range r.Refs {
			if len(f.Columns) == 0 || len(f.Columns) != len(f.RefColumns) {
				continue
			}
			vals, ok := valuesOf(r, f.Columns)
			if !ok {
				continue
			}
			for _, p := range parents[refKey(f.Schema+"."+f.Table, f.RefColumns, vals)] {
				// i grows monotonically, so children stay in seq order and
				// a duplicate (two foreign keys to one parent) is the last.
				if ch := g.children[p]; p != i && (len(ch) == 0 || ch[len(ch)-1] != i) {
					g.children[p] = append(ch, i)
				}
			}
		}
	}
	return g
}

func valuesOf(r *archiveRow, cols []string) ([]string, bool) {
	vals := make([]string, len(cols))
	for i, c := range cols {
		v, ok := r.value(c)
		if !ok {
			return nil, false
		}
		vals[i] = v
	}
	return vals, true
}

// node is one row of a document with its descendants.
type node struct {
	Table    string
	Key      json.RawMessage
	Row      json.RawMessage
	Children map[string][]*node
}

// Meta is the "meta" object of a document.
type Meta struct {
	CorrelationID string `json:"correlation_id"`
	// ArchivedAt is when the last row of the document was archived.
	ArchivedAt time.Time `json:"archived_at"`
	CommitTime time.Time `json:"commit_time"`
	// EntityCount counts the rows in the document, the root included.
	EntityCount int `json:"entity_count"`
	// UnrelatedCount counts the transaction's rows that belong to no
	// root's document (rows of unrelated tables); they are left out.
	UnrelatedCount int `json:"unrelated_count"`
	// TransactionRows counts the transaction's archive rows.
	TransactionRows int `json:"transaction_rows"`
}

// appendJSON appends what json.Marshal(m) writes, without its reflection
// (a visible share of assembly): the fields in order, the times as
// time.Time marshals them (RFC 3339 with nanoseconds), and json.Marshal's
// error for a time it cannot encode.
func (m *Meta) appendJSON(b []byte) ([]byte, error) {
	for _, t := range []time.Time{m.ArchivedAt, m.CommitTime} {
		if y := t.Year(); y < 0 || y > 9999 {
			return json.Marshal(m)
		}
	}
	var w bytes.Buffer
	w.Write(b)
	w.WriteString(`{"correlation_id":`)
	writeJSONString(&w, m.CorrelationID)
	w.WriteString(`,"archived_at":"`)
	w.Write(m.ArchivedAt.AppendFormat(nil, time.RFC3339Nano))
	w.WriteString(`","commit_time":"`)
	w.Write(m.CommitTime.AppendFormat(nil, time.RFC3339Nano))
	w.WriteString(`","entity_count":`)
	w.WriteString(strconv.Itoa(m.EntityCount))
	w.WriteString(`,"unrelated_count":`)
	w.WriteString(strconv.Itoa(m.UnrelatedCount))
	w.WriteString(`,"transaction_rows":`)
	w.WriteString(strconv.Itoa(m.TransactionRows))
	w.WriteByte('}')
	return w.Bytes(), nil
}

// The document is written by hand rather than by encoding/json: the row
// images are copied as they are (encoding/json would scan and compact
// every one again, a visible share of the apply's CPU when documents are
// assembled in the apply transaction). They are valid JSON: the batch reads
// them from jsonb, the apply has just stored them as jsonb in the same
// transaction. The payload is stored as jsonb, which normalizes spacing
// and key order, so both paths store the same document.

func writeJSONString(b *bytes.Buffer, s string) {
	if plainJSON(s) { // what json.Marshal writes for it, without its allocations
		b.WriteByte('"')
		b.WriteString(s)
		b.WriteByte('"')
		return
	}
	enc, _ := json.Marshal(s) // a string always encodes
	b.Write(enc)
}

// plainJSON reports whether json.Marshal encodes s as s in quotes:
// printable ASCII without the characters it escapes.
func plainJSON(s string) bool {
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c < 0x20 || c > 0x7e, c == '"', c == '\\', c == '<', c == '>', c == '&':
			return false
		}
	}
	return true
}

func writeNode(b *bytes.Buffer, table string, key, row json.RawMessage) {
	b.WriteString(`{"table":`)
	writeJSONString(b, table)
	b.WriteString(`,"key":`)
	b.Write(orNull(key))
	b.WriteString(`,"row":`)
	b.Write(orNull(row))
}

// writeChildren writes children keyed by table, the tables sorted.
func writeChildren(b *bytes.Buffer, kids map[string][]*node) {
	tables := make([]string, 0, len(kids))
	for t := range kids {
		tables = append(tables, t)
	}
	slices.Sort(tables)
	b.WriteByte('{')
	for i, t := range tables {
		if i > 0 {
			b.WriteByte(',')
		}
		writeJSONString(b, t)
		b.WriteString(":[")
		for j, n := range kids[t] {
			if j > 0 {
				b.WriteByte(',')
			}
			writeNode(b, n.Table, n.Key, n.Row)
			b.WriteString(`,"children":`)
			writeChildren(b, n.Children)
			b.WriteByte('}')
		}
		b.WriteByte(']')
	}
	b.WriteByte('}')
}

// subtree walks breadth first from row root over the child edges and
// returns the nested children and the rows reached (root included). Each
// row appears once, under the parent nearest the root; a row already
// reached (a cycle, or a second foreign key to a row in the document) is
// not entered again, so a cycle of self-references terminates.
func (g *group) subtree(root int) (map[string][]*node, []int) {
	seen := map[int]bool{root: true}
	top := &node{}
	type item struct {
		row    int
		parent *node
	}
	queue := []item{{root, top}}
	members := []int{root}
	for len(queue) > 0 {
		it := queue[0]
		queue = queue[1:]
		for _, c := range g.children[it.row] {
			if seen[c] {
				continue
			}
			seen[c] = true
			members = append(members, c)
			r := g.rows[c]
			n := &node{Table: r.qualified(), Key: orNull(r.Key), Row: orNull(r.Row)}
			if it.parent.Children == nil { // a leaf's stays nil: written {}
				it.parent.Children = map[string][]*node{}
			}
			it.parent.Children[n.Table] = append(it.parent.Children[n.Table], n)
			queue = append(queue, item{c, n})
		}
	}
	return top.Children, members
}

func orNull(m json.RawMessage) json.RawMessage {
	if len(bytes.TrimSpace(m)) == 0 {
		return json.RawMessage("null")
	}
	return m
}

// unrelated counts the rows reached from none of the roots.
func (g *group) unrelated(roots []int) int {
	reached := make([]bool, len(g.rows))
	n := 0
	for _, r := range roots {
		if reached[r] {
			continue // its subtree is inside one already walked
		}
		children, members := g.subtree(r)
		if g.walked == nil {
			g.walked = map[int]walk{}
		}
		g.walked[r] = walk{children, members}
		for _, m := range members {
			if !reached[m] {
				reached[m] = true
				n++
			}
		}
	}
	return len(g.rows) - n
}

// document builds the payload rooted at row root; unrelated is the count of
// the transaction's rows in no root's document.
func (g *group) document(root int, unrelated int) ([]byte, error) {
	w, ok := g.walked[root]
	if ok {
		delete(g.walked, root)
	} else {
		w.children, w.members = g.subtree(root)
	}
	children, members := w.children, w.members
	r := g.rows[root]
	meta := Meta{
		CorrelationID:   g.correlationID,
		CommitTime:      r.CommitTime.UTC(),
		EntityCount:     len(members),
		UnrelatedCount:  unrelated,
		TransactionRows: len(g.rows),
	}
	for _, m := range members {
		if t := g.rows[m].ArchivedAt; t.After(meta.ArchivedAt) {
			meta.ArchivedAt = t
		}
	}
	meta.ArchivedAt = meta.ArchivedAt.UTC()
	m, err := meta.appendJSON(nil)
	if err != nil {
		return nil, fmt.Errorf("encode snapshot document: %w", err)
	}
	// Sized for the rows and their framing at once: grown by doubling,
	// a document of many rows was copied several times.
	size := len(m) + 64
	for _, i := range members {
		size += len(g.rows[i].Key) + len(g.rows[i].Row) + len(g.rows[i].Table) + len(g.rows[i].Schema) + 48
	}
	var b bytes.Buffer
	b.Grow(size)
	b.WriteString(`{"root":`)
	writeNode(&b, r.qualified(), r.Key, r.Row)
	b.WriteString(`},"children":`)
	writeChildren(&b, children)
	b.WriteString(`,"meta":`)
	b.Write(m)
	b.WriteByte('}')
	return b.Bytes(), nil
}

// fingerprint is the sha256 (hex) of the sorted identities (commit_lsn,
// seq) of every archive row of the transaction the documents were built
// from. Any row added to or removed from the group changes it.
func (g *group) fingerprint() string {
	ids := make([][2]uint64, len(g.rows))
	for i, r := range g.rows {
		ids[i] = [2]uint64{uint64(r.CommitLSN), uint64(r.Seq)}
	}
	slices.SortFunc(ids, func(a, b [2]uint64) int {
		if c := cmpU(a[0], b[0]); c != 0 {
			return c
		}
		return cmpU(a[1], b[1])
	})
	h := sha256.New()
	var line []byte
	// A transaction's rows share their commit LSN: its text is made once
	// per distinct LSN (in a row), not once per row.
	var lsn string
	for i, id := range ids {
		if i == 0 || id[0] != ids[i-1][0] {
			lsn = event.LSN(id[0]).String()
		}
		// "%s/%d\n" of the LSN and seq, without fmt.
		line = strconv.AppendUint(append(append(line[:0], lsn...), '/'), id[1], 10)
		h.Write(append(line, '\n'))
	}
	return hex.EncodeToString(h.Sum(nil))
}

func cmpU(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// counts returns the number of rows per "schema.table".
func (g *group) counts() map[string]int {
	c := map[string]int{}
	for _, r := range g.rows {
		c[r.qualified()]++
	}
	return c
}

// missing describes, sorted by table, each table with fewer archive rows
// than the commit said; empty when the group is complete. Only table names
// and counts appear: never row values.
func missing(expected, have map[string]int) string {
	var parts []string
	for t, n := range expected {
		if have[t] < n {
			parts = append(parts, fmt.Sprintf("%s has %d of %d rows", sanitize(t), have[t], n))
		}
	}
	slices.Sort(parts)
	return strings.Join(parts, "; ")
}

// sanitize keeps a reason printable and bounded.
func sanitize(s string) string {
	s = strings.Map(func(r rune) rune {
		if r < 0x20 || r == 0x7f {
			return ' '
		}
		return r
	}, s)
	if len(s) > 200 {
		s = s[:200] + "..."
	}
	return s
}
