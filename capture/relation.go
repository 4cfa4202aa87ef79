package capture

import (
	"context"
	"encoding/json"
	"fmt"
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
	keyIdx []int // indexes of the replica identity key columns

	name        string // schema.table
	what        string // "delete schema.table", for errors
	head        []byte // ,"source":..,"schema":..,"table":..
	columnsJSON []byte // [{"name":..,"type":..,"pk":true},..]
	refsJSON    []byte // [..] or nil
	subjects    []string
	deletes     prometheus.Counter
	truncates   prometheus.Counter
}

type relColumn struct {
	name    string
	typeOID uint32
	key     bool   // part of the replica identity
	label   []byte // "name":
}

func (r *relation) qualified() string { return r.name }

// buildRelation combines a Relation message with the catalog's primary key,
// foreign keys and type names.
func buildRelation(ctx context.Context, cat *catalog, m *pglogrepl.RelationMessage, src string, partitions int, published *prometheus.CounterVec) (*relation, error) {
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
	facts, err := cat.table(ctx, m.RelationID)
	if err != nil {
		return nil, fmt.Errorf("relation %s.%s: %w", m.Namespace, m.RelationName, err)
	}
	pk := map[string]int{}
	for i, n := range facts.pk {
		pk[n] = i
	}
	cols := make([]event.Column, len(m.Columns))
	r.pkIdx = make([]int, 0, len(facts.pk))
	pkPos := make([]int, len(facts.pk))
	found := 0
	for i, c := range m.Columns {
		label, _ := json.Marshal(c.Name)
		r.cols = append(r.cols, relColumn{name: c.Name, typeOID: c.DataType, key: c.Flags&1 != 0, label: append(label, ':')})
		_, isPK := pk[c.Name]
		cols[i] = event.Column{Name: c.Name, Type: types[i], PK: isPK}
		if isPK {
			pkPos[pk[c.Name]] = i
			found++
		}
		if c.Flags&1 != 0 {
			r.keyIdx = append(r.keyIdx, i)
		}
	}
	if found == len(facts.pk) {
		r.pkIdx = append(r.pkIdx, pkPos...)
	}
	if r.columnsJSON, err = json.Marshal(cols); err != nil {
		return nil, fmt.Errorf("relation %s: encode columns: %w", r.qualified(), err)
	}
	if len(facts.refs) > 0 {
		if r.refsJSON, err = json.Marshal(facts.refs); err != nil {
			return nil, fmt.Errorf("relation %s: encode refs: %w", r.qualified(), err)
		}
	}
	r.head = append(r.head, `,"source":`...)
	r.head = appendString(r.head, []byte(src))
	r.head = append(r.head, `,"schema":`...)
	r.head = appendString(r.head, []byte(r.schema))
	r.head = append(r.head, `,"table":`...)
	r.head = appendString(r.head, []byte(r.table))
	r.subjects = make([]string, partitions)
	for p := range r.subjects {
		r.subjects[p] = event.DeleteSubject(src, p, r.schema, r.table)
	}
	r.deletes = published.WithLabelValues(r.schema, r.table, string(event.OpDelete))
	r.truncates = published.WithLabelValues(r.schema, r.table, string(event.OpTruncate))
	return r, nil
}

// rowImage holds the JSON of one deleted row.
type rowImage struct {
	identity string
	key      []byte // nil when the table has no key
	row      []byte
}

// encodeRow turns the old tuple of a delete into key and row JSON. For a
// key-only identity the row holds the key columns only (the others are not
// in the WAL).
func (r *relation) encodeRow(img *rowImage, tupleType uint8, tup *pglogrepl.TupleData) error {
	if tup == nil {
		return fmt.Errorf("delete on %s without an old tuple", r.qualified())
	}
	if len(tup.Columns) != len(r.cols) {
		return fmt.Errorf("delete on %s: tuple has %d columns, relation %d", r.qualified(), len(tup.Columns), len(r.cols))
	}
	full := tupleType == pglogrepl.DeleteMessageTupleTypeOld
	img.identity = event.IdentityKey
	if full {
		img.identity = event.IdentityFull
	}
	row := append(img.row[:0], '{')
	first := true
	for i, c := range tup.Columns {
		if !full && !r.cols[i].key {
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
		row = appendColumn(row, r.cols[i].typeOID, c)
	}
	img.row = append(row, '}')
	idx := r.pkIdx
	if len(idx) == 0 && !full {
		idx = r.keyIdx
	}
	img.key = img.key[:0]
	if len(idx) == 0 {
		img.key = nil
		return nil
	}
	key := append(img.key, '{')
	for j, i := range idx {
		c := tup.Columns[i]
		if c.DataType == pglogrepl.TupleDataTypeToast {
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
	timeText   string // commitTime in RFC 3339 with nanoseconds
	idPrefix   string // event.MsgID(src, commitLSN, seq) without the seq
}

func newTxInfo(src string, xid uint32, commitLSN event.LSN, commitTime time.Time) txInfo {
	tx := txInfo{xid: xid, commitLSN: commitLSN, commitTime: commitTime, lsnText: commitLSN.String()}
	tx.timeText = commitTime.Format(time.RFC3339Nano)
	tx.idPrefix = src + "/" + tx.lsnText + "/"
	return tx
}

// msgID is event.MsgID(src, tx.commitLSN, seq) (tested).
func (tx *txInfo) msgID(seq int) string { return tx.idPrefix + strconv.Itoa(seq) }

// position is position{tx.commitLSN, n}.String() (tested).
func (tx *txInfo) position(n int) string { return tx.lsnText + "#" + strconv.Itoa(n) }

// encodeDelete writes a delete event, field for field what event.Encode
// would write for the same event (tested), without re-encoding the parts
// that are the same for every row of a table.
func (r *relation) encodeDelete(dst []byte, tx *txInfo, seq int, img *rowImage, ref *event.ObjectRef) []byte {
	dst = append(dst, `{"v":1,"op":"delete"`...)
	dst = append(dst, r.head...)
	dst = append(dst, `,"xid":`...)
	dst = strconv.AppendUint(dst, uint64(tx.xid), 10)
	dst = append(dst, `,"commit_lsn":"`...)
	dst = append(dst, tx.lsnText...)
	dst = append(dst, `","commit_time":"`...)
	dst = append(dst, tx.timeText...)
	dst = append(dst, `","seq":`...)
	dst = strconv.AppendInt(dst, int64(seq), 10)
	dst = append(dst, `,"identity":"`...)
	dst = append(dst, img.identity...)
	dst = append(dst, `","columns":`...)
	dst = append(dst, r.columnsJSON...)
	if img.key != nil {
		dst = append(dst, `,"key":`...)
		dst = append(dst, img.key...)
	}
	if ref == nil {
		dst = append(dst, `,"row":`...)
		dst = append(dst, img.row...)
	} else {
		b, _ := json.Marshal(ref)
		dst = append(dst, `,"row_ref":`...)
		dst = append(dst, b...)
	}
	if r.refsJSON != nil {
		dst = append(dst, `,"refs":`...)
		dst = append(dst, r.refsJSON...)
	}
	return append(dst, '}')
}
