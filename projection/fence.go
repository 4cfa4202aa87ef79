package projection

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

// Erasure fences (DESIGN section 7): every version's apply, rebuilds
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

// errFencesChanged: an erasure was recorded since the fences were loaded;
// the page is applied again with the new ones.
var errFencesChanged = errors.New("erasure fences changed")

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

// fenceSet is a worker's cache of the fences.
type fenceSet struct {
	mu      sync.Mutex
	loaded  bool
	epoch   int64
	key     []byte
	byTable map[string][]fence
	rows    map[rowIdentity]bool
}

// load reads the fences (three queries; only at start and after a change).
func (f *fenceSet) load(ctx context.Context, db progress.DB) error {
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
	f.mu.Lock()
	f.loaded, f.epoch, f.key, f.byTable, f.rows = true, epoch, key, byTable, ids
	f.mu.Unlock()
	return nil
}

// saw records that a statement read the erasure counter epoch: a cache
// older than that is reloaded on next use (the counter only grows).
func (f *fenceSet) saw(epoch int64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if epoch > f.epoch {
		f.loaded = false
	}
}

// filter returns rows without the fenced ones (and, for a fence with
// children, without the rows of the same transaction in rows that reference
// a fenced row by their foreign keys, transitively), loading the fences
// first when needed. It returns how many rows it left out and the erasure
// counter of the fences it used.
func (f *fenceSet) filter(ctx context.Context, db progress.DB, rows []*archiveRow) ([]*archiveRow, int, int64, error) {
	f.mu.Lock()
	loaded := f.loaded
	f.mu.Unlock()
	if !loaded {
		if err := f.load(ctx, db); err != nil {
			return nil, 0, 0, err
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.byTable) == 0 && len(f.rows) == 0 {
		return rows, 0, f.epoch, nil
	}
	var keep, parents []*archiveRow
	for _, r := range rows {
		fenced, children := f.fenced(r)
		switch {
		case children:
			parents = append(parents, r)
		case !fenced:
			keep = append(keep, r)
		}
	}
	dropped := len(rows) - len(keep) // so far: the fenced ones
	for len(parents) > 0 {
		var next []*archiveRow
		kept := keep[:0]
		for _, r := range keep {
			if referencesAny(r, parents) {
				next = append(next, r)
				continue
			}
			kept = append(kept, r)
		}
		keep, parents = kept, next
		dropped += len(next)
	}
	return keep, dropped, f.epoch, nil
}

// fenced says whether r is fenced, and whether by a fence with children.
func (f *fenceSet) fenced(r *archiveRow) (fenced, children bool) {
	e := r.ev
	if f.rows[rowIdentity{e.Source, e.CommitLSN, e.Seq}] {
		return true, false
	}
	for _, fc := range f.byTable[e.QualifiedTable()] {
		obj := json.RawMessage(r.row)
		if fc.mode == EraseByKey {
			obj = e.Key
		}
		d, ok := rowDigest(f.key, e.QualifiedTable(), fc.mode, fc.columns, obj)
		if ok && d == fc.digest {
			fenced, children = true, children || fc.withChildren
		}
	}
	return fenced, children
}

// referencesAny reports whether r references one of parents (same source
// transaction) by one of its foreign keys.
func referencesAny(r *archiveRow, parents []*archiveRow) bool {
	child := decodeObject(r.row)
	if child == nil {
		return false
	}
	for _, p := range parents {
		if p.ev.CommitLSN != r.ev.CommitLSN || p.ev.Source != r.ev.Source {
			continue
		}
		parent := decodeObject(p.row)
		if parent == nil {
			parent = decodeObject(p.ev.Key)
		}
		for _, ref := range r.ev.Refs {
			if ref.Schema != p.ev.Schema || ref.Table != p.ev.Table || len(ref.Columns) != len(ref.RefColumns) || parent == nil {
				continue
			}
			if sameValues(child, ref.Columns, parent, ref.RefColumns) {
				return true
			}
		}
	}
	return false
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

// unfenced leaves the fenced rows out of a page's rows (called by archiveRows)
// and returns the erasure counter of the fences it used.
func (s *Service) unfenced(ctx context.Context, v Version, rows []*archiveRow) ([]*archiveRow, int64, error) {
	keep, dropped, epoch, err := s.fences.filter(ctx, s.pool, rows)
	if err != nil {
		return nil, 0, err
	}
	if dropped > 0 {
		s.retention.fenced.WithLabelValues(v.Projection, fmt.Sprint(v.Version)).Add(float64(dropped))
		s.log.Info("erased rows not archived (erasure fence)", "version", v.Version, "rows", dropped)
	}
	return keep, epoch, nil
}
