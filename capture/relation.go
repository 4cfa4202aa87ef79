package capture

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/epitaph-dev/epitaph/event"
)

// relation is what capture knows of a published table, built from a
// pgoutput Relation message plus the current catalog, with the parts of a
// delete event that are the same for every row pre-encoded.
type relation struct {
	id     uint32
	schema string
	table  string
	cols   []relColumn
	pkIdx  []int // indexes into cols of the primary key, in key order
	keyIdx []int // indexes of the replica identity key columns (the message's flags)
	// identIdx are the columns that identify a row when the table has no
	// primary key the tuple holds: the replica identity index's columns.
	identIdx []int
	// partitioned: a partitioned table published via its root, whose rows
	// come from leaves that may have a weaker replica identity than the
	// root's, while pgoutput labels every old tuple by the root's.
	partitioned bool
	weakLeaves  bool
	indexLeaves bool // a leaf identifies rows by an index of its own
	// moveIdx are the key columns (primary key, else replica identity
	// index) outside every partition key: a delete followed at once by an
	// insert equal in them is a row an UPDATE moved to another partition.
	// Nil when there are none, so no move can be told from a delete.
	moveIdx []int
	// outsidePart are the columns outside every partition key: a leaf
	// identified by an index of its own (indexLeaves) sends those of its
	// index only, which tell its moves instead.
	outsidePart []int

	name      string // schema.table
	what      string // "delete schema.table", for errors
	head      *event.TableHead
	subjects  []string
	deletes   prometheus.Counter
	truncates prometheus.Counter
}

type relColumn struct {
	name    string
	typeOID uint32
	key     bool   // part of the replica identity
	label   []byte // "name":
}

func (r *relation) qualified() string { return r.name }

// pkNames are the names of the primary key columns the relation found.
func (r *relation) pkNames() []string {
	out := make([]string, len(r.pkIdx))
	for i, j := range r.pkIdx {
		out[i] = r.cols[j].name
	}
	return out
}

// indexesOf returns the positions in m's columns of names, or nil unless
// every name is there.
func indexesOf(m *pglogrepl.RelationMessage, names []string) []int {
	if len(names) == 0 {
		return nil
	}
	out := make([]int, 0, len(names))
	for _, n := range names {
		i := slices.IndexFunc(m.Columns, func(c *pglogrepl.RelationMessageColumn) bool { return c.Name == n })
		if i < 0 {
			return nil
		}
		out = append(out, i)
	}
	return out
}

// relationEnv is what buildRelation reads besides the message: the same
// for every relation of a stream.
type relationEnv struct {
	cat        *catalog
	src        string
	partitions int
	published  *prometheus.CounterVec // the events published, by table and op
}

// buildRelation combines a Relation message with the catalog's primary key,
// foreign keys and type names. The message describes the table as it was
// when the rows that follow were deleted; where the current catalog
// disagrees (a key column renamed since, a table dropped), the message's
// own names, the catalog's column positions, and what prev (the relation
// this one replaces) knew decide the key.
func buildRelation(ctx context.Context, env relationEnv, m *pglogrepl.RelationMessage, prev *relation) (*relation, error) {
	cat, src := env.cat, env.src
	r := &relation{id: m.RelationID, schema: m.Namespace, table: m.RelationName, name: m.Namespace + "." + m.RelationName}
	r.what = "delete " + r.name
	oids := make([]uint32, len(m.Columns))
	mods := make([]int32, len(m.Columns))
	for i, c := range m.Columns {
		oids[i], mods[i] = c.DataType, c.TypeModifier
	}
	types, err := cat.typeNamesOf(ctx, oids, mods)
	if err != nil {
		return nil, fmt.Errorf("relation %s.%s: %w", m.Namespace, m.RelationName, err)
	}
	facts, before, err := cat.table(ctx, m.RelationID)
	if err != nil {
		return nil, fmt.Errorf("relation %s.%s: %w", m.Namespace, m.RelationName, err)
	}
	r.partitioned, r.weakLeaves, r.indexLeaves = facts.partitioned, facts.weakLeaves, facts.indexLeaves
	allFlagged := len(m.Columns) > 0
	for i, c := range m.Columns {
		label, _ := json.Marshal(c.Name)
		key := c.Flags&1 != 0
		r.cols = append(r.cols, relColumn{name: c.Name, typeOID: c.DataType, key: key, label: append(label, ':')})
		if key {
			r.keyIdx = append(r.keyIdx, i)
		} else {
			allFlagged = false
		}
	}
	// The primary key: by name; else by position (a column renamed since,
	// none added or dropped); else as the catalog was read before (a key
	// dropped since), or as the relation before this one knew it.
	r.pkIdx = indexesOf(m, facts.pk)
	if r.pkIdx == nil {
		r.pkIdx = pkByPosition(m, facts)
	}
	if r.pkIdx == nil {
		r.pkIdx = indexesOf(m, before.pk)
	}
	if r.pkIdx == nil && prev != nil {
		r.pkIdx = indexesOf(m, prev.pkNames())
	}
	// Without a primary key: the replica identity index's columns, which
	// the message flags itself unless the identity is FULL (every column
	// flagged).
	r.identIdx = indexesOf(m, facts.replIdx)
	if r.identIdx == nil && !allFlagged {
		r.identIdx = r.keyIdx
	}
	if r.identIdx == nil && prev != nil {
		r.identIdx = indexesOf(m, prev.identNames())
	}
	if r.partitioned {
		key := r.pkIdx
		if len(key) == 0 {
			key = r.identIdx
		}
		for _, i := range key {
			if !slices.Contains(facts.partCols, r.cols[i].name) {
				r.moveIdx = append(r.moveIdx, i)
			}
		}
		for i, c := range r.cols {
			if !slices.Contains(facts.partCols, c.name) {
				r.outsidePart = append(r.outsidePart, i)
			}
		}
	}
	isPK := make([]bool, len(m.Columns))
	for _, i := range r.pkIdx {
		isPK[i] = true
	}
	cols := make([]event.Column, 0, len(m.Columns)+len(facts.generated))
	for i, c := range m.Columns {
		cols = append(cols, event.Column{Name: c.Name, Type: types[i], PK: isPK[i]})
	}
	cols = withGenerated(cols, facts.generated)
	if r.head, err = event.NewTableHead(src, r.schema, r.table, cols, facts.refs); err != nil {
		return nil, fmt.Errorf("relation %s: %w", r.qualified(), err)
	}
	r.subjects = make([]string, env.partitions)
	for p := range r.subjects {
		r.subjects[p] = event.DeleteSubject(src, p, r.schema, r.table)
	}
	r.deletes = env.published.WithLabelValues(r.schema, r.table, string(event.OpDelete))
	r.truncates = env.published.WithLabelValues(r.schema, r.table, string(event.OpTruncate))
	return r, nil
}

// moveColumns are the columns of old, a held delete's tuple, that an
// insert must equal to be the other half of a move: the key columns
// outside the partition keys, or, for a row of a leaf identified by an
// index of its own (NULL in one of those), the columns outside the
// partition keys its tuple holds.
func (r *relation) moveColumns(old *pglogrepl.TupleData) []int {
	if !r.indexLeaves || !slices.ContainsFunc(r.moveIdx, func(i int) bool {
		return i < len(old.Columns) && old.Columns[i].DataType == pglogrepl.TupleDataTypeNull
	}) {
		return r.moveIdx
	}
	var out []int
	for _, i := range r.outsidePart {
		if i < len(old.Columns) && old.Columns[i].DataType != pglogrepl.TupleDataTypeNull {
			out = append(out, i)
		}
	}
	return out
}

// pkByPosition finds the primary key by the positions of its columns among
// the message's columns that are not generated (PostgreSQL 18 sends the
// stored generated ones too), when there are as many as the catalog has
// (a key column renamed since, none added or dropped); nil otherwise.
func pkByPosition(m *pglogrepl.RelationMessage, f tableFacts) []int {
	if len(f.pkPos) == 0 {
		return nil
	}
	plain := make([]int, 0, len(m.Columns))
	for i, c := range m.Columns {
		if !slices.ContainsFunc(f.generated, func(g generatedColumn) bool { return g.name == c.Name }) {
			plain = append(plain, i)
		}
	}
	if len(plain) != f.ncols {
		return nil
	}
	out := make([]int, len(f.pkPos))
	for j, p := range f.pkPos {
		if p < 0 || p >= len(plain) {
			return nil
		}
		out[j] = plain[p]
	}
	return out
}

func (r *relation) identNames() []string {
	out := make([]string, len(r.identIdx))
	for i, j := range r.identIdx {
		out[i] = r.cols[j].name
	}
	return out
}

// withGenerated inserts the generated columns (which pgoutput does not
// send) after the column the table has before each, or at the end when
// that column is not in the message.
func withGenerated(cols []event.Column, gen []generatedColumn) []event.Column {
	for _, g := range gen {
		if i := slices.IndexFunc(cols, func(c event.Column) bool { return c.Name == g.name }); i >= 0 {
			cols[i].Generated = true // sent after all (PostgreSQL 18 with publish_generated_columns)
			continue
		}
		at := len(cols)
		if g.after == "" {
			at = 0
		} else if i := slices.IndexFunc(cols, func(c event.Column) bool { return c.Name == g.after }); i >= 0 {
			at = i + 1
		}
		cols = slices.Insert(cols, at, event.Column{Name: g.name, Type: g.typ, Generated: true})
	}
	return cols
}

// rowImage holds the JSON of one deleted row.
type rowImage struct {
	identity string
	key      []byte // nil when the table has no key
	row      []byte
	// stream: encodeRow leaves the large values out of row, noting where
	// each goes in streamed (see largerow.go: imageReader).
	stream   bool
	streamed []streamedValue
}

// encodeRow turns the old tuple of a delete into key and row JSON.
//
// The identity is the row's own: "full" only when the tuple holds the whole
// row. pgoutput labels the tuple by the published relation's identity, and
// a partitioned table is published via its root: a row of a leaf whose
// identity is weaker than the root's FULL comes as a "full" tuple with NULL
// in every column the leaf's key does not cover. Such a row (every column
// outside the primary key NULL, or, without a primary key and with a weak
// leaf, any column NULL) cannot be told from a whole row and is labelled
// "key" with only its non-NULL columns: never a guess labelled whole.
//
// The key is the primary key when the tuple holds it, else the replica
// identity index's columns; nil when neither is known.
func (r *relation) encodeRow(img *rowImage, tupleType uint8, tup *pglogrepl.TupleData) error {
	if tup == nil {
		return fmt.Errorf("delete on %s without an old tuple", r.qualified())
	}
	if len(tup.Columns) != len(r.cols) {
		return fmt.Errorf("delete on %s: tuple has %d columns, relation %d", r.qualified(), len(tup.Columns), len(r.cols))
	}
	full := tupleType == pglogrepl.DeleteMessageTupleTypeOld
	partial := full && r.partitioned && r.leafKeyOnly(tup)
	if partial {
		full = false
	}
	img.identity = event.IdentityKey
	if full {
		img.identity = event.IdentityFull
	}
	row := append(img.row[:0], '{')
	img.streamed = img.streamed[:0]
	first := true
	for i, c := range tup.Columns {
		if !full && !partial && !r.cols[i].key {
			continue
		}
		if partial && c.DataType == pglogrepl.TupleDataTypeNull {
			continue
		}
		if c.DataType == pglogrepl.TupleDataTypeToast {
			continue // unchanged TOAST is never in a delete's old tuple; nothing to carry
		}
		if !first {
			row = append(row, ',')
		}
		first = false
		row = append(row, r.cols[i].label...)
		row = img.appendValue(row, r.cols[i].typeOID, i, c)
	}
	img.row = append(row, '}')
	idx := r.pkIdx
	if !full && !partial && !r.allKey(idx) {
		idx = r.identIdx // a key-only tuple without the primary key (USING INDEX)
	}
	if len(idx) == 0 {
		idx = r.identIdx
	}
	img.key = img.key[:0]
	if len(idx) == 0 {
		img.key = nil
		return nil
	}
	key := append(img.key, '{')
	for j, i := range idx {
		c := tup.Columns[i]
		if c.DataType == pglogrepl.TupleDataTypeToast || (partial && c.DataType == pglogrepl.TupleDataTypeNull) {
			img.key = nil
			return nil
		}
		if j > 0 {
			key = append(key, ',')
		}
		key = append(key, r.cols[i].label...)
		key = appendColumn(key, r.cols[i].typeOID, c)
	}
	img.key = append(key, '}')
	return nil
}

// allKey says whether every column of idx is in the replica identity.
func (r *relation) allKey(idx []int) bool {
	if len(idx) == 0 {
		return false
	}
	for _, i := range idx {
		if !r.cols[i].key {
			return false
		}
	}
	return true
}

// leafKeyOnly says whether a "full" tuple of a partitioned table may be a
// leaf's key-only one: NULL in a primary key column (which no whole row
// has: a leaf with REPLICA IDENTITY USING INDEX on other columns sends
// those only), NULL in every column outside the primary key (a table with
// other columns), or, without a primary key and with a leaf that is not
// FULL, or with a leaf identified by an index (whose columns may be more
// than the primary key's), NULL in any column.
func (r *relation) leafKeyOnly(tup *pglogrepl.TupleData) bool {
	if r.indexLeaves || (len(r.pkIdx) == 0 && r.weakLeaves) {
		return slices.ContainsFunc(tup.Columns, func(c *pglogrepl.TupleDataColumn) bool { return c.DataType == pglogrepl.TupleDataTypeNull })
	}
	if len(r.pkIdx) == 0 {
		return false
	}
	for _, i := range r.pkIdx {
		if tup.Columns[i].DataType == pglogrepl.TupleDataTypeNull {
			return true
		}
	}
	if len(r.pkIdx) == len(r.cols) {
		return false
	}
	for i, c := range tup.Columns {
		if c.DataType != pglogrepl.TupleDataTypeNull && !slices.Contains(r.pkIdx, i) {
			return false
		}
	}
	return true
}

func appendColumn(dst []byte, typeOID uint32, c *pglogrepl.TupleDataColumn) []byte {
	if c.DataType == pglogrepl.TupleDataTypeNull {
		return append(dst, "null"...)
	}
	return appendValue(dst, typeOID, c.Data)
}

// txInfo is the source transaction a row belongs to, with the text forms
// every row of it repeats formatted once.
type txInfo struct {
	xid        uint32
	commitLSN  event.LSN
	commitTime time.Time
	lsnText    string // commitLSN.String()
	del        event.DeleteTx
	idPrefix   string // event.MsgID(src, commitLSN, seq) without the seq
	tagger     *event.MsgIDTagger
}

// newTxInfo formats the transaction's repeated texts; tagger (nil: none,
// for tests of the plain form) tags its row message ids.
func newTxInfo(src string, xid uint32, commitLSN event.LSN, commitTime time.Time, tagger *event.MsgIDTagger) txInfo {
	tx := txInfo{xid: xid, commitLSN: commitLSN, commitTime: commitTime, lsnText: commitLSN.String(), tagger: tagger}
	tx.del = event.NewDeleteTx(xid, commitLSN, commitTime)
	tx.idPrefix = src + "/" + tx.lsnText + "/"
	return tx
}

// msgID is tagger.RowMsgID(src, tx.commitLSN, seq), or event.MsgID without
// a tagger (tested).
func (tx *txInfo) msgID(seq int) string {
	var buf [96]byte // on the stack: the string is the row's one allocation
	b := append(buf[:0], tx.idPrefix...)
	b = strconv.AppendInt(b, int64(seq), 10)
	if tx.tagger != nil {
		b = tx.tagger.AppendTag(b, tx.commitLSN, seq)
	}
	return string(b)
}

// position is position{tx.commitLSN, n}.String() (tested).
func (tx *txInfo) position(n int) string { return tx.lsnText + "#" + strconv.Itoa(n) }

// encodeDelete writes a row's delete event with event.AppendDelete.
func (r *relation) encodeDelete(dst []byte, tx *txInfo, seq int, img *rowImage, ref *event.ObjectRef) []byte {
	return event.AppendDelete(dst, r.head, &tx.del, event.DeleteRow{Seq: seq, Identity: img.identity, Key: img.key, Row: img.row, RowRef: ref})
}
