package erasure

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sort"
	"sync"

	"github.com/jackc/pgx/v5"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/progress"
)

// Erasure fences: every version's apply, rebuilds
// included, skips the rows an erasure fenced, so erased data never returns.
//
// A fence holds no erased value: the table, the sorted names of the matched
// columns and an HMAC-SHA256 (key in epitaph.erasure_secret) of the
// canonical JSON array of their values. Apply hashes the same columns of
// each row of a fenced table; rows of tables without fences cost a map
// look-up. Children erased with --with-children are fenced by identity
// (epitaph.erased_rows).
//
// The fences are cached; the insert statement of every page reads the
// erasure counter under the erasure lock (epitaph.erasure_epoch(), no extra
// round trip), and a page that read a counter other than the cache's is
// rolled back, the fences reloaded and the page applied again.

// Erasure modes.
const (
	EraseByKey   = "key"
	EraseByMatch = "match"
)

// ErrFencesChanged: an erasure was recorded since the fences were loaded;
// the page is applied again with the new ones.
var ErrFencesChanged = errors.New("erasure fences changed")

type fence struct {
	id           int64
	mode         string
	columns      []string
	digest       string
	withChildren bool
}

type rowIdentity struct {
	source string
	lsn    event.LSN
	seq    int
}

// txKey is a source transaction.
type txKey struct {
	source string
	lsn    event.LSN
}

// erasedParent is a row erased with its children (epitaph.erased_parents):
// its table and the digest of each of its columns' values.
type erasedParent struct {
	table   string
	seq     int
	erasure int64
	cols    map[string]string
}

// FenceSet is a worker's cache of the fences.
type FenceSet struct {
	mu      sync.Mutex
	loaded  bool
	epoch   int64
	key     []byte
	byTable map[string][]fence
	rows    map[rowIdentity]bool
	parents map[txKey][]erasedParent
}

// Load reads the fences (three queries; only at start and after a change).
func (f *FenceSet) Load(ctx context.Context, db progress.DB) error {
	var epoch int64
	var key []byte
	err := db.QueryRow(ctx, `SELECT (SELECT epoch FROM epitaph.erasure_epoch), (SELECT key FROM epitaph.erasure_secret)`).Scan(&epoch, &key)
	if err != nil {
		return fmt.Errorf("load erasure fences: %w", err)
	}
	rows, err := db.Query(ctx, `SELECT id, schema_name || '.' || table_name, mode, columns, digest, with_children FROM epitaph.erasures`)
	if err != nil {
		return fmt.Errorf("load erasure fences: %w", err)
	}
	byTable := map[string][]fence{}
	var tbl string
	var fc fence
	_, err = pgx.ForEachRow(rows, []any{&fc.id, &tbl, &fc.mode, &fc.columns, &fc.digest, &fc.withChildren}, func() error {
		c := fc
		c.columns = slices.Clone(fc.columns)
		byTable[tbl] = append(byTable[tbl], c)
		return nil
	})
	if err != nil {
		return fmt.Errorf("load erasure fences: %w", err)
	}
	ids := map[rowIdentity]bool{}
	rows, err = db.Query(ctx, `SELECT source, commit_lsn::text, seq FROM epitaph.erased_rows`)
	if err != nil {
		return fmt.Errorf("load erased rows: %w", err)
	}
	var id rowIdentity
	var lsn string
	_, err = pgx.ForEachRow(rows, []any{&id.source, &lsn, &id.seq}, func() error {
		l, err := event.ParseLSN(lsn)
		if err != nil {
			return err
		}
		id.lsn = l
		ids[id] = true
		return nil
	})
	if err != nil {
		return fmt.Errorf("load erased rows: %w", err)
	}
	parents, err := loadErasedParents(ctx, db)
	if err != nil {
		return err
	}
	f.mu.Lock()
	f.loaded, f.epoch, f.key, f.byTable, f.rows, f.parents = true, epoch, key, byTable, ids, parents
	f.mu.Unlock()
	return nil
}

// loadErasedParents reads epitaph.erased_parents.
func loadErasedParents(ctx context.Context, db progress.DB) (map[txKey][]erasedParent, error) {
	rows, err := db.Query(ctx, `SELECT source, commit_lsn::text, seq, schema_name || '.' || table_name, erasure_id,
		jsonb_object_agg(column_name, digest) FROM epitaph.erased_parents GROUP BY 1, 2, 3, 4, 5`)
	if err != nil {
		return nil, fmt.Errorf("load erased parents: %w", err)
	}
	out := map[txKey][]erasedParent{}
	var k txKey
	var lsn string
	var p erasedParent
	_, err = pgx.ForEachRow(rows, []any{&k.source, &lsn, &p.seq, &p.table, &p.erasure, &p.cols}, func() error {
		l, err := event.ParseLSN(lsn)
		if err != nil {
			return err
		}
		k.lsn = l
		out[k] = append(out[k], p)
		p.cols = nil
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("load erased parents: %w", err)
	}
	return out, nil
}

// Saw records that a statement read the erasure counter epoch: a cache
// older than that is reloaded on next use (the counter only grows).
func (f *FenceSet) Saw(epoch int64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if epoch > f.epoch {
		f.loaded = false
	}
}

// FilterRows returns rows without the fenced ones (and, for a fence with
// children, without the rows of the same transaction that reference a
// fenced row by their foreign keys, transitively: in rows, or erased before
// in another page, epitaph.erased_parents), loading the fences first when
// needed. It returns how many rows it left out, the erasure counter of the
// fences it used, and the rows it left out as erased with their children
// (to be recorded, FenceSet.Record). A generic function, not a method:
// the kept rows are returned as the caller's own row type.
func FilterRows[R Row](f *FenceSet, ctx context.Context, db progress.DB, rows []R) ([]R, int, int64, []ErasedWith, error) {
	f.mu.Lock()
	loaded := f.loaded
	f.mu.Unlock()
	if !loaded {
		if err := f.Load(ctx, db); err != nil {
			return nil, 0, 0, nil, err
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.byTable) == 0 && len(f.rows) == 0 && len(f.parents) == 0 {
		return rows, 0, f.epoch, nil, nil
	}
	var keep []R
	var parents []ErasedWith
	for _, r := range rows {
		fenced, children := f.fenced(r)
		if children == 0 {
			children = f.childOfErased(r) // also of a row fenced alone: its children go too
		}
		switch {
		case children != 0:
			parents = append(parents, ErasedWith{r, children})
		case !fenced:
			keep = append(keep, r)
		}
	}
	dropped := len(rows) - len(keep) // so far: the fenced ones
	all := parents
	for len(parents) > 0 {
		var next []ErasedWith
		kept := keep[:0]
		for _, r := range keep {
			if id := referencesAny(r, parents); id != 0 {
				next = append(next, ErasedWith{r, id})
				continue
			}
			kept = append(kept, r)
		}
		keep, parents = kept, next
		dropped += len(next)
		all = append(all, next...)
	}
	return keep, dropped, f.epoch, all, nil
}

// Row is a row the fences judge: its delete event and its row image.
type Row interface {
	Event() *event.Event
	Image() json.RawMessage
}

// ErasedWith is a row erased with its children by erasure id.
type ErasedWith struct {
	r  Row
	id int64
}

// childOfErased returns the erasure of a row erased before (another page of
// r's transaction) that r references by a foreign key, or 0.
func (f *FenceSet) childOfErased(r Row) int64 {
	ps := f.parents[txKey{r.Event().Source, r.Event().CommitLSN}]
	if len(ps) == 0 || len(r.Event().Refs) == 0 {
		return 0
	}
	child := decodeObject(r.Image())
	if child == nil {
		return 0
	}
	for _, ref := range r.Event().Refs {
		if len(ref.Columns) == 0 || len(ref.Columns) != len(ref.RefColumns) {
			continue
		}
		table := ref.Schema + "." + ref.Table
		for _, p := range ps {
			if p.table == table && f.sameDigests(table, child, ref.Columns, p.cols, ref.RefColumns) {
				return p.erasure
			}
		}
	}
	return 0
}

// sameDigests: child's columns cc have the values whose digests parent's
// columns pc have.
func (f *FenceSet) sameDigests(table string, child map[string]json.RawMessage, cc []string, parent map[string]string, pc []string) bool {
	for i := range cc {
		v, ok := child[cc[i]]
		want, ok2 := parent[pc[i]]
		if !ok || !ok2 || bytes.Equal(bytes.TrimSpace(v), []byte("null")) {
			return false
		}
		d, ok := columnDigest(f.key, table, pc[i], v)
		if !ok || d != want {
			return false
		}
	}
	return true
}

// columnDigest is the digest of one column's value of a row of table, as
// epitaph.erased_parents keeps it.
func columnDigest(key []byte, table, column string, v json.RawMessage) (string, bool) {
	cv, err := canonicalJSON(v)
	if err != nil {
		return "", false
	}
	return digestOf(key, table, "column", []string{column}, []json.RawMessage{cv}), true
}

// fenced says whether r is fenced, and by which fence with children (0:
// none).
func (f *FenceSet) fenced(r Row) (fenced bool, children int64) {
	e := r.Event()
	if f.rows[rowIdentity{e.Source, e.CommitLSN, e.Seq}] {
		return true, 0
	}
	for _, fc := range f.byTable[e.QualifiedTable()] {
		obj := json.RawMessage(r.Image())
		if fc.mode == EraseByKey {
			obj = e.Key
		}
		d, ok := rowDigest(f.key, e.QualifiedTable(), fc.mode, fc.columns, obj)
		if ok && d == fc.digest {
			fenced = true
			if fc.withChildren && children == 0 {
				children = fc.id
			}
		}
	}
	return fenced, children
}

// referencesAny returns the erasure of the one of parents (same source
// transaction) that r references by one of its foreign keys, or 0.
func referencesAny(r Row, parents []ErasedWith) int64 {
	child := decodeObject(r.Image())
	if child == nil {
		return 0
	}
	for _, pw := range parents {
		p := pw.r
		if p.Event().CommitLSN != r.Event().CommitLSN || p.Event().Source != r.Event().Source {
			continue
		}
		parent := decodeObject(p.Image())
		if parent == nil {
			parent = decodeObject(p.Event().Key)
		}
		for _, ref := range r.Event().Refs {
			if ref.Schema != p.Event().Schema || ref.Table != p.Event().Table || len(ref.Columns) != len(ref.RefColumns) || parent == nil {
				continue
			}
			if sameValues(child, ref.Columns, parent, ref.RefColumns) {
				return pw.id
			}
		}
	}
	return 0
}

func sameValues(a map[string]json.RawMessage, ac []string, b map[string]json.RawMessage, bc []string) bool {
	for i := range ac {
		x, ok1 := a[ac[i]]
		y, ok2 := b[bc[i]]
		if !ok1 || !ok2 || bytes.Equal(bytes.TrimSpace(x), []byte("null")) {
			return false
		}
		cx, err1 := canonicalJSON(x)
		cy, err2 := canonicalJSON(y)
		if err1 != nil || err2 != nil || !bytes.Equal(cx, cy) {
			return false
		}
	}
	return true
}

func decodeObject(b []byte) map[string]json.RawMessage {
	var m map[string]json.RawMessage
	if len(b) == 0 || json.Unmarshal(b, &m) != nil {
		return nil
	}
	return m
}

// canonicalJSON re-encodes a JSON value with sorted object keys and numbers
// as written, so equal values hash equally whatever their spacing.
func canonicalJSON(b []byte) ([]byte, error) {
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber()
	var v any
	if err := d.Decode(&v); err != nil {
		return nil, err
	}
	return json.Marshal(v)
}

// selectorColumns checks a --key or --match selector (a JSON object with at
// least one column; --match values must be scalars, compared for equality)
// and returns its sorted column names.
func selectorColumns(mode string, sel json.RawMessage) ([]string, error) {
	obj := decodeObject(sel)
	if len(obj) == 0 {
		return nil, fmt.Errorf("--%s must be a JSON object with at least one column, like {\"id\": 42}", mode)
	}
	cols := make([]string, 0, len(obj))
	for c, v := range obj {
		t := bytes.TrimSpace(v)
		if len(t) > 0 && (t[0] == '{' || t[0] == '[') {
			return nil, fmt.Errorf("--%s column %q: want a scalar value (numbers, strings, booleans, null)", mode, c)
		}
		cols = append(cols, c)
	}
	sort.Strings(cols)
	return cols, nil
}

// rowDigest is the fence digest of obj (an event's key for mode key, its
// row image for mode match) over columns; false when obj lacks one of them
// (or, for a key, has others).
func rowDigest(key []byte, table, mode string, columns []string, obj json.RawMessage) (string, bool) {
	m := decodeObject(obj)
	if m == nil || (mode == EraseByKey && len(m) != len(columns)) {
		return "", false
	}
	vals := make([]json.RawMessage, len(columns))
	for i, c := range columns {
		v, ok := m[c]
		if !ok {
			return "", false
		}
		cv, err := canonicalJSON(v)
		if err != nil {
			return "", false
		}
		vals[i] = cv
	}
	return digestOf(key, table, mode, columns, vals), true
}

func digestOf(key []byte, table, mode string, columns []string, vals []json.RawMessage) string {
	h := hmac.New(sha256.New, key)
	b, _ := json.Marshal(struct {
		Table   string            `json:"t"`
		Mode    string            `json:"m"`
		Columns []string          `json:"c"`
		Values  []json.RawMessage `json:"v"`
	}{table, mode, slices.Clone(columns), vals})
	h.Write(b)
	return hex.EncodeToString(h.Sum(nil))
}
