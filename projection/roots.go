package projection

import (
	"bytes"
	"encoding/json"
	"strings"

	"github.com/tidwall/gjson"

	"github.com/epitaph-dev/epitaph/event"
)

// rootsInPage computes is_root in memory for every transaction whose
// commit and all of whose rows are in this page, with the same rule as
// markRootsSQL: a row is a root unless another row of its transaction is
// its parent by one of its refs (all key values present, non-null and
// equal to the parent's referenced columns). It returns the commit LSNs it
// settled; the others are marked in SQL when their commit is applied.
func rootsInPage(rows []*archiveRow, commits []*item) map[event.LSN]bool {
	settled := map[event.LSN]bool{}
	if len(commits) == 0 {
		return settled
	}
	byTx := map[event.LSN][]*archiveRow{}
	for _, r := range rows {
		byTx[r.ev.CommitLSN] = append(byTx[r.ev.CommitLSN], r)
	}
	for _, c := range commits {
		txRows := byTx[c.ev.CommitLSN]
		if !completeTx(txRows, c.ev.Rows) {
			continue
		}
		markRootsInMemory(txRows)
		settled[c.ev.CommitLSN] = true
	}
	return settled
}

// completeTx says whether rows are exactly seqs 0..n-1 of a transaction.
func completeTx(rows []*archiveRow, n int) bool {
	if len(rows) != n || n == 0 {
		return false
	}
	seen := make([]bool, n)
	for _, r := range rows {
		if r.ev.Seq < 0 || r.ev.Seq >= n || seen[r.ev.Seq] {
			return false
		}
		seen[r.ev.Seq] = true
	}
	return true
}

// markRootsInMemory sets is_root on the rows of one complete transaction
// (rootsInPage): rows without refs are roots; the others are matched
// against the candidate parents indexed by parentIndex.
func markRootsInMemory(rows []*archiveRow) {
	yes, no := true, false
	if !anyRefs(rows) {
		for _, r := range rows {
			r.isRoot = &yes
		}
		return
	}
	wanted, cols := refSpecs(rows)
	values := make([]map[string]json.RawMessage, len(rows))
	for i, r := range rows {
		values[i] = columnValues(r.row, cols) // unreadable: no values, so neither parent nor child
	}
	parents, blind := parentIndex(rows, values, wanted)
	for i, r := range rows {
		switch root, known := rootOf(r, values[i], parents, blind); {
		case !root:
			r.isRoot = &no
		case !known:
			r.isRoot = nil // cannot be told: NULL, never a guess
		default:
			r.isRoot = &yes
		}
	}
}

func anyRefs(rows []*archiveRow) bool {
	for _, r := range rows {
		if len(r.ev.Refs) > 0 {
			return true
		}
	}
	return false
}

// refSpecs returns the (table, columns) specs some ref of rows points at,
// and the columns some ref names: only those are read from the rows.
func refSpecs(rows []*archiveRow) (wanted, cols map[string]bool) {
	wanted, cols = map[string]bool{}, map[string]bool{}
	for _, r := range rows {
		for _, f := range r.ev.Refs {
			wanted[specKey(f.Schema, f.Table, f.RefColumns)] = true
			for _, c := range f.Columns {
				cols[c] = true
			}
			for _, c := range f.RefColumns {
				cols[c] = true
			}
		}
	}
	return wanted, cols
}

// parentIndex indexes the candidate parents under every spec of wanted
// (spec + "\x01" + key -> seqs). blind: specs some candidate parent's image
// lacks a referenced column of (a key-only row): whether a child of that
// spec has a parent there cannot be told.
func parentIndex(rows []*archiveRow, values []map[string]json.RawMessage, wanted map[string]bool) (parents map[string][]int, blind map[string]bool) {
	parents, blind = map[string][]int{}, map[string]bool{}
	for i, r := range rows {
		for spec := range wanted {
			schema, table, cols := splitSpec(spec)
			if schema != r.ev.Schema || table != r.ev.Table {
				continue
			}
			if values[i] != nil && !hasAll(values[i], cols) {
				blind[spec] = true
			}
			if k, ok := keyOf(values[i], cols); ok {
				parents[spec+"\x01"+k] = append(parents[spec+"\x01"+k], r.ev.Seq)
			}
		}
	}
	return parents, blind
}

// rootOf says whether row r is a root: not when another row of its
// transaction is its parent by one of its refs; known is false when that
// cannot be told (a key-only row on either side).
func rootOf(r *archiveRow, values map[string]json.RawMessage, parents map[string][]int, blind map[string]bool) (root, known bool) {
	root, unknown := true, false
	for _, f := range r.ev.Refs {
		if values != nil && !hasAll(values, f.Columns) {
			unknown = true // a key-only row: its foreign key was not captured
			continue
		}
		k, ok := keyOf(values, f.Columns)
		if !ok {
			continue
		}
		spec := specKey(f.Schema, f.Table, f.RefColumns)
		if blind[spec] {
			unknown = true
		}
		for _, seq := range parents[spec+"\x01"+k] {
			if seq != r.ev.Seq {
				root = false
			}
		}
	}
	return root, !unknown
}

// hasAll says whether every column of cols is in values (NULL included).
func hasAll(values map[string]json.RawMessage, cols []string) bool {
	for _, c := range cols {
		if _, ok := values[c]; !ok {
			return false
		}
	}
	return true
}

func specKey(schema, table string, cols []string) string {
	return schema + "\x00" + table + "\x00" + strings.Join(cols, "\x00")
}

func splitSpec(spec string) (schema, table string, cols []string) {
	parts := strings.Split(spec, "\x00")
	return parts[0], parts[1], parts[2:]
}

// columnValues returns the raw values of the columns in want of a row image
// (a JSON object), reading only its top level; nil when row is not a JSON
// object. As with encoding/json, a repeated name keeps its last value.
func columnValues(row []byte, want map[string]bool) map[string]json.RawMessage {
	s := string(row)
	if !gjson.Valid(s) {
		return nil
	}
	obj := gjson.Parse(s)
	if !obj.IsObject() {
		return nil
	}
	values := make(map[string]json.RawMessage, len(want))
	obj.ForEach(func(k, v gjson.Result) bool {
		if want[k.Str] {
			values[k.Str] = json.RawMessage(v.Raw)
		}
		return true
	})
	return values
}

// keyOf is the values of cols in compact JSON, and false when one is
// missing or null (a NULL foreign key references nothing).
func keyOf(values map[string]json.RawMessage, cols []string) (string, bool) {
	if values == nil || len(cols) == 0 {
		return "", false
	}
	var b strings.Builder
	for _, c := range cols {
		v, ok := values[c]
		if !ok {
			return "", false
		}
		var buf bytes.Buffer
		if err := json.Compact(&buf, v); err != nil || buf.String() == "null" {
			return "", false
		}
		b.Write(buf.Bytes())
		b.WriteByte(0)
	}
	return b.String(), true
}

// openTx remembers, across pages, the primary keys of the rows already
// applied of the partition's transaction that is not committed yet, so a
// child whose parent came earlier is known to be no root when inserted. It
// is an optimization only: what is not decided on insert (is_root NULL) is
// decided in SQL when the commit is applied. It is dropped on any failure.
type openTx struct {
	lsn  event.LSN
	keys map[string]struct{}
	// full: decisions made so far may be wrong (a row of the transaction
	// was quarantined); recompute every row at the commit.
	full bool
}

// maxOpenKeys bounds the memory of one open transaction's keys.
const maxOpenKeys = 200_000

// decideEarly sets is_root on the rows of transactions not settled in the
// page where that is already certain: true for a row without foreign keys,
// false for a row whose parent (by primary key) came earlier in its
// transaction. It returns the open transaction after the page (nil when the
// page ends with a commit).
func decideEarly(rows []*archiveRow, settled map[event.LSN]bool, open *openTx) *openTx {
	yes, no := true, false
	for _, r := range rows {
		lsn := r.ev.CommitLSN
		if settled[lsn] {
			continue
		}
		if open == nil || open.lsn != lsn {
			// Joined after the transaction's first row (another worker,
			// or this one before a failure, applied the beginning): what
			// was decided then is unknown (a quarantined parent makes its
			// children's early decisions wrong), so every row is decided
			// again at the commit.
			open = &openTx{lsn: lsn, keys: map[string]struct{}{}, full: r.ev.Seq != 0}
		}
		if len(r.ev.Refs) == 0 {
			r.isRoot = &yes
		} else if parentSeen(r, open) {
			r.isRoot = &no
		}
		if len(open.keys) < maxOpenKeys {
			if k, ok := pkKey(r); ok {
				open.keys[k] = struct{}{}
			}
		}
	}
	return open
}

// pkKey is the row's identity under its primary key columns, in the form a
// child's foreign key is looked up with.
func pkKey(r *archiveRow) (string, bool) {
	var cols []string
	want := map[string]bool{}
	for _, c := range r.ev.Columns {
		if c.PK {
			cols = append(cols, c.Name)
			want[c.Name] = true
		}
	}
	if len(cols) == 0 || len(r.ev.Key) == 0 {
		return "", false
	}
	k, ok := keyOf(columnValues(r.ev.Key, want), cols)
	if !ok {
		return "", false
	}
	return specKey(r.ev.Schema, r.ev.Table, cols) + "\x01" + k, true
}

func parentSeen(r *archiveRow, open *openTx) bool {
	if len(open.keys) == 0 {
		return false
	}
	cols := map[string]bool{}
	for _, f := range r.ev.Refs {
		for _, c := range f.Columns {
			cols[c] = true
		}
	}
	values := columnValues(r.row, cols)
	if values == nil {
		return false
	}
	own, _ := pkKey(r)
	for _, f := range r.ev.Refs {
		k, ok := keyOf(values, f.Columns)
		if !ok {
			continue
		}
		pk := specKey(f.Schema, f.Table, f.RefColumns) + "\x01" + k
		if _, found := open.keys[pk]; found && pk != own {
			return true
		}
	}
	return false
}
