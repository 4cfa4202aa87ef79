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
	"unsafe"

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
// encoding/json, a repeated name keeps its last value. want is the few
// columns the foreign keys of the row's table name (a slice: looking a
// handful up by comparison is cheaper than hashing every member's name).
func (r *archiveRow) parse(want []string) {
	r.cols = r.cols[:0]
	if len(want) == 0 {
		return
	}
	// Read in place, not copied: a row image is never changed once read,
	// and the forms kept (unescaped strings, numbers) are slices of it.
	s := bytesString(r.Row)
	if !gjson.Valid(s) {
		return
	}
	obj := gjson.Parse(s)
	if !obj.IsObject() {
		return
	}
	obj.ForEach(func(k, v gjson.Result) bool {
		w := slices.Index(want, k.Str)
		if w < 0 {
			return true
		}
		f, ok := matchForm(v)
		if i := r.col(k.Str); i >= 0 {
			r.cols[i] = colValue{want[w], f, ok}
		} else {
			r.cols = append(r.cols, colValue{want[w], f, ok})
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

// bytesString is b as a string without copying it: for the buffers
// assembly makes and hands on (a document's payload, a key's identity),
// which nothing writes to after. Copying every payload into a string for
// the statement's parameters was a fifth of assembly's allocated bytes.
func bytesString(b []byte) string { return unsafe.String(unsafe.SliceData(b), len(b)) }

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
	// walked: the subtrees unrelated walked, by root row, each taken
	// by the root's document (walked once, not twice).
	walked map[int]walk
	// subtree's scratch: seen is all false between walks.
	seen         []bool
	queue, first []int
}

// walk is the rows a document holds: members in walk order, the root
// first; the children of members[k] are members[first[k]:first[k+1]].
type walk struct {
	members, first []int
}

// index returns the position in g.rows of the row with the given seq. The
// rows are sorted by seq and, in a complete group, are seqs 0..n-1: the
// row is usually at its seq; otherwise it is searched for.
func (g *group) index(seq int) (int, bool) {
	if seq >= 0 && seq < len(g.rows) && g.rows[seq].Seq == seq {
		return seq, true
	}
	return slices.BinarySearchFunc(g.rows, seq, func(r *archiveRow, s int) int { return r.Seq - s })
}

// appendRefKey appends the key identifying (table, cols, the values of
// r's columns vals) for the parent lookup: each part length-prefixed, so
// distinct lists never make the same key. False when a value is absent or
// NULL (a NULL foreign key references nothing).
func appendRefKey(b []byte, table string, cols []string, r *archiveRow, vals []string) ([]byte, bool) {
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
	for _, c := range vals {
		v, ok := r.value(c)
		if !ok {
			return b, false
		}
		add(v)
	}
	return b, true
}

// names interns "schema.table" per (schema, table): made once per group,
// not once per row and foreign key.
type names map[[2]string]string

func (n names) of(schema, table string) string {
	k := [2]string{schema, table}
	q, ok := n[k]
	if !ok {
		q = schema + "." + table
		n[k] = q
	}
	return q
}

// addNames appends to list the names it lacks.
func addNames(list, add []string) []string {
	for _, c := range add {
		if !slices.Contains(list, c) {
			list = append(list, c)
		}
	}
	return list
}

func newGroup(correlationID string, rows []*archiveRow) *group {
	bySeq := func(a, b *archiveRow) int { return a.Seq - b.Seq }
	if !slices.IsSortedFunc(rows, bySeq) {
		slices.SortFunc(rows, bySeq)
	}
	g := &group{correlationID: correlationID, rows: rows}
	qn := names{}
	for _, r := range rows {
		if r.q == "" {
			r.q = qn.of(r.Schema, r.Table)
		}
	}
	// Which (table, referenced columns) pairs are referenced at all, so
	// each row is indexed only under the keys some child looks up; and
	// which columns each table's rows are read for (its foreign keys' and
	// those its children reference).
	wanted := map[string][][]string{}
	read := map[string][]string{}
	for _, r := range rows {
		for _, f := range r.Refs {
			t := qn.of(f.Schema, f.Table)
			if !slices.ContainsFunc(wanted[t], func(c []string) bool { return slices.Equal(c, f.RefColumns) }) {
				wanted[t] = append(wanted[t], f.RefColumns)
				read[t] = addNames(read[t], f.RefColumns)
			}
			read[r.q] = addNames(read[r.q], f.Columns)
		}
	}
	// The rows' column values in one array, each row's part sized for
	// its table's columns.
	n := 0
	for _, r := range rows {
		n += len(read[r.q])
	}
	cv := make([]colValue, n)
	for _, r := range rows {
		want := read[r.q]
		if cap(r.cols) < len(want) {
			r.cols, cv = cv[:0:len(want)], cv[len(want):]
		}
		r.parse(want)
	}
	g.link(indexParents(rows, wanted), qn)
	return g
}

// parentIndex finds rows by (table, referenced columns, values): head[key]
// is 1 + the key's first entry, next chains the entries of one key (a key
// is almost always one row's), entryRow is each entry's row.
type parentIndex struct {
	head           map[string]int32
	entryRow, next []int32
}

// indexParents indexes each row under the keys wanted names for its table.
func indexParents(rows []*archiveRow, wanted map[string][][]string) parentIndex {
	n := 0
	for _, r := range rows {
		n += len(wanted[r.q])
	}
	// Sized once: grown, the map was rehashed several times.
	x := parentIndex{head: make(map[string]int32, n), entryRow: make([]int32, 0, n), next: make([]int32, 0, n)}
	var kb []byte
	for i, r := range rows {
		for _, cols := range wanted[r.q] {
			var ok bool
			if kb, ok = appendRefKey(kb[:0], r.q, cols, r, cols); ok {
				x.next = append(x.next, x.head[string(kb)]-1)
				x.entryRow = append(x.entryRow, int32(i))
				x.head[string(kb)] = int32(len(x.entryRow))
			}
		}
	}
	return x
}

// link sets g.children from the rows' foreign keys: the edges in child
// order, then grouped by parent (stable), so each parent's children are in
// seq order, all in one array.
func (g *group) link(x parentIndex, qn names) {
	rows := g.rows
	var edges [][2]int32 // parent, child
	last := make([]int32, len(rows))
	for i := range last {
		last[i] = -1
	}
	counts := make([]int32, len(rows)+1)
	var kb []byte
	for i, r := range rows {
		for _, f := range r.Refs {
			if len(f.Columns) == 0 || len(f.Columns) != len(f.RefColumns) {
				continue
			}
			var ok bool
			if kb, ok = appendRefKey(kb[:0], qn.of(f.Schema, f.Table), f.RefColumns, r, f.Columns); !ok {
				continue
			}
			for e := x.head[string(kb)] - 1; e >= 0; e = x.next[e] {
				// A duplicate (two foreign keys to one parent) is kept once.
				if p := x.entryRow[e]; int(p) != i && last[p] != int32(i) {
					last[p] = int32(i)
					edges = append(edges, [2]int32{p, int32(i)})
					counts[p+1]++
				}
			}
		}
	}
	for p := range rows {
		counts[p+1] += counts[p]
	}
	flat := make([]int, len(edges))
	fill := slices.Clone(counts[:len(rows)])
	for _, e := range edges {
		flat[fill[e[0]]] = int(e[1])
		fill[e[0]]++
	}
	g.children = make([][]int, len(rows))
	for p := range rows {
		if counts[p] < counts[p+1] {
			g.children[p] = flat[counts[p]:counts[p+1]:counts[p+1]]
		}
	}
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
	if !m.encodable() {
		return json.Marshal(m)
	}
	w := bytes.NewBuffer(b)
	m.write(w)
	return w.Bytes(), nil
}

// encodable reports whether write can encode m: json.Marshal fails on a
// year outside 0..9999.
func (m *Meta) encodable() bool {
	for _, t := range []time.Time{m.ArchivedAt, m.CommitTime} {
		if y := t.Year(); y < 0 || y > 9999 {
			return false
		}
	}
	return true
}

// write writes what appendJSON appends for an encodable m, into w's spare
// capacity where it has some (a document's buffer is sized for it).
func (m *Meta) write(w *bytes.Buffer) {
	w.WriteString(`{"correlation_id":`)
	writeJSONString(w, m.CorrelationID)
	w.WriteString(`,"archived_at":"`)
	w.Write(m.ArchivedAt.AppendFormat(w.AvailableBuffer(), time.RFC3339Nano))
	w.WriteString(`","commit_time":"`)
	w.Write(m.CommitTime.AppendFormat(w.AvailableBuffer(), time.RFC3339Nano))
	w.WriteString(`","entity_count":`)
	w.Write(strconv.AppendInt(w.AvailableBuffer(), int64(m.EntityCount), 10))
	w.WriteString(`,"unrelated_count":`)
	w.Write(strconv.AppendInt(w.AvailableBuffer(), int64(m.UnrelatedCount), 10))
	w.WriteString(`,"transaction_rows":`)
	w.Write(strconv.AppendInt(w.AvailableBuffer(), int64(m.TransactionRows), 10))
	w.WriteByte('}')
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

// writeChildren writes the children of w's member k keyed by table, the
// tables sorted, each table's rows in walk order: what encoding a node's
// Children map wrote, without building the map.
func (g *group) writeChildren(b *bytes.Buffer, w *walk, k int) {
	lo, hi := w.first[k], w.first[k+1]
	var few [8]string
	tables := few[:0]
	for _, m := range w.members[lo:hi] {
		if t := g.rows[m].qualified(); !slices.Contains(tables, t) {
			tables = append(tables, t)
		}
	}
	slices.Sort(tables)
	b.WriteByte('{')
	for i, t := range tables {
		if i > 0 {
			b.WriteByte(',')
		}
		writeJSONString(b, t)
		b.WriteString(":[")
		n := 0
		for c := lo; c < hi; c++ {
			r := g.rows[w.members[c]]
			if r.qualified() != t {
				continue
			}
			if n > 0 {
				b.WriteByte(',')
			}
			n++
			writeNode(b, t, r.Key, r.Row)
			b.WriteString(`,"children":`)
			g.writeChildren(b, w, c)
			b.WriteByte('}')
		}
		b.WriteByte(']')
	}
	b.WriteByte('}')
}

// walkFrom walks breadth first from row root over the child edges. Each
// row is reached once, under the parent nearest the root; a row already
// reached (a cycle, or a second foreign key to a row in the document) is
// not entered again, so a cycle of self-references terminates.
func (g *group) walkFrom(root int) walk {
	if len(g.seen) < len(g.rows) {
		g.seen = make([]bool, len(g.rows))
	}
	seen := g.seen
	// queue (reused from walk to walk) is the members in walk order; a
	// member's children are enqueued together, so they are a range of it.
	seen[root] = true
	queue, first := append(g.queue[:0], root), append(g.first[:0], 1)
	for k := 0; k < len(queue); k++ {
		for _, c := range g.children[queue[k]] {
			if !seen[c] {
				seen[c] = true
				queue = append(queue, c)
			}
		}
		first = append(first, len(queue))
	}
	for _, m := range queue {
		seen[m] = false
	}
	g.queue, g.first = queue, first
	both := make([]int, len(queue)+len(first)) // one allocation for the two
	w := walk{members: both[:len(queue):len(queue)], first: both[len(queue):]}
	copy(w.members, queue)
	copy(w.first, first)
	return w
}

// subtree is the walk from root as nested nodes (the shape of a
// document's children) and the rows reached, root included.
func (g *group) subtree(root int) (map[string][]*node, []int) {
	w := g.walkFrom(root)
	nodes := make([]node, len(w.members)) // nodes[0] stands for the root
	for k := range w.members {
		for c := w.first[k]; c < w.first[k+1]; c++ {
			r := g.rows[w.members[c]]
			n := &nodes[c]
			*n = node{Table: r.qualified(), Key: orNull(r.Key), Row: orNull(r.Row)}
			if nodes[k].Children == nil { // a leaf's stays nil
				nodes[k].Children = map[string][]*node{}
			}
			nodes[k].Children[n.Table] = append(nodes[k].Children[n.Table], n)
		}
	}
	return nodes[0].Children, w.members
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
		w := g.walkFrom(r)
		if g.walked == nil {
			g.walked = map[int]walk{}
		}
		g.walked[r] = w
		for _, m := range w.members {
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
		w = g.walkFrom(root)
	}
	members := w.members
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
	var m []byte
	if !meta.encodable() {
		var err error
		if m, err = meta.appendJSON(nil); err != nil {
			return nil, fmt.Errorf("encode snapshot document: %w", err)
		}
	}
	// Sized for the rows, their framing and the meta object at once:
	// grown by doubling, a document of many rows was copied several times.
	size := len(m) + 64 + 256 + len(meta.CorrelationID)
	for _, i := range members {
		size += len(g.rows[i].Key) + len(g.rows[i].Row) + len(g.rows[i].Table) + len(g.rows[i].Schema) + 48
	}
	var b bytes.Buffer
	b.Grow(size)
	b.WriteString(`{"root":`)
	writeNode(&b, r.qualified(), r.Key, r.Row)
	b.WriteString(`},"children":`)
	g.writeChildren(&b, &w, 0)
	b.WriteString(`,"meta":`)
	if m == nil {
		meta.write(&b)
	} else {
		b.Write(m)
	}
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
