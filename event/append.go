package event

import (
	"encoding/json"
	"fmt"
	"strconv"
	"time"
	"unicode/utf8"
)

// The fast delete encoder: the capture writes one delete event per deleted
// row, and most of each body is the same for every row of a table (source,
// schema, table, columns, refs) or of a transaction (xid, commit LSN and
// time). TableHead and DeleteTx hold those parts encoded once; AppendDelete
// writes the body around a row's own key and image, field for field what
// Encode writes for the same event (FuzzAppendDelete checks it).

// deleteOpen starts every delete body: the wire version and the op.
var deleteOpen = `{"v":` + strconv.Itoa(Version) + `,"op":"` + string(OpDelete) + `"`

// TableHead is the part of a delete event that is the same for every row of
// one table, pre-encoded. Build it with NewTableHead; it is immutable and
// may be shared.
type TableHead struct {
	fields  []byte // ,"source":..,"schema":..,"table":..
	columns []byte // [{"name":..,"type":..,"pk":true},..]
	refs    []byte // [..], or nil without refs
}

// NewTableHead encodes the table's fields of a delete event: the source,
// the table's schema and name, its columns and (none: nil) its foreign
// keys.
func NewTableHead(source, schema, table string, columns []Column, refs []Ref) (*TableHead, error) {
	h := &TableHead{}
	h.fields = append(h.fields, `,"source":`...)
	h.fields = AppendString(h.fields, []byte(source))
	h.fields = append(h.fields, `,"schema":`...)
	h.fields = AppendString(h.fields, []byte(schema))
	h.fields = append(h.fields, `,"table":`...)
	h.fields = AppendString(h.fields, []byte(table))
	var err error
	if h.columns, err = json.Marshal(columns); err != nil {
		return nil, fmt.Errorf("encode columns of %s.%s: %w", schema, table, err)
	}
	if len(refs) > 0 {
		if h.refs, err = json.Marshal(refs); err != nil {
			return nil, fmt.Errorf("encode refs of %s.%s: %w", schema, table, err)
		}
	}
	return h, nil
}

// Size is the number of bytes of the head's parts in every body
// AppendDelete writes with it.
func (h *TableHead) Size() int { return len(h.fields) + len(h.columns) + len(h.refs) }

// DeleteTx is the source transaction of delete events, with the text forms
// every row of it repeats formatted once. Build it with NewDeleteTx.
type DeleteTx struct {
	xid     uint32
	lsnText string // commit LSN, String()
	time    string // commit time in RFC 3339 with nanoseconds
}

// NewDeleteTx formats a transaction's id, commit LSN and commit time as
// Encode writes them. commitTime keeps its location (the capture passes
// UTC).
func NewDeleteTx(xid uint32, commitLSN LSN, commitTime time.Time) DeleteTx {
	return DeleteTx{xid: xid, lsnText: commitLSN.String(), time: commitTime.Format(time.RFC3339Nano)}
}

// DeleteRow is what AppendDelete writes of one row: the fields of a
// delete event that are the row's own.
type DeleteRow struct {
	Seq      int
	Identity string
	Key, Row []byte
	RowRef   *ObjectRef
}

// AppendDelete appends to dst the body of the delete event of one row:
// what Encode writes for Event{Op: OpDelete, Source, Schema, Table,
// Columns and Refs of h, XID, CommitLSN, CommitTime of tx, Seq, Identity,
// Key, Row, RowRef of r}.
//
// r.Key and r.Row must be JSON objects in the compact form Encode writes
// (no spaces, '<', '>' and '&' escaped: as AppendString writes strings); a
// nil Key leaves "key" out. With a RowRef, the row is in the object store:
// "row" is left out and "row_ref" written instead. The caller guarantees
// what Validate checks of the fields it passes (a commit LSN other than 0,
// a known identity, a schema and a table): AppendDelete does not check.
func AppendDelete(dst []byte, h *TableHead, tx *DeleteTx, r DeleteRow) []byte {
	dst = append(dst, deleteOpen...)
	dst = append(dst, h.fields...)
	if tx.xid != 0 { // as Encode, which omits it (never a committed transaction's)
		dst = append(dst, `,"xid":`...)
		dst = strconv.AppendUint(dst, uint64(tx.xid), 10)
	}
	dst = append(dst, `,"commit_lsn":"`...)
	dst = append(dst, tx.lsnText...)
	dst = append(dst, `","commit_time":"`...)
	dst = append(dst, tx.time...)
	dst = append(dst, `","seq":`...)
	dst = strconv.AppendInt(dst, int64(r.Seq), 10)
	dst = append(dst, `,"identity":`...)
	dst = AppendString(dst, []byte(r.Identity))
	dst = append(dst, `,"columns":`...)
	dst = append(dst, h.columns...)
	if r.Key != nil {
		dst = append(dst, `,"key":`...)
		dst = append(dst, r.Key...)
	}
	if r.RowRef == nil {
		dst = append(dst, `,"row":`...)
		dst = append(dst, r.Row...)
	} else {
		b, _ := json.Marshal(r.RowRef) // strings and integers: cannot fail
		dst = append(dst, `,"row_ref":`...)
		dst = append(dst, b...)
	}
	if h.refs != nil {
		dst = append(dst, `,"refs":`...)
		dst = append(dst, h.refs...)
	}
	return append(dst, '}')
}

const hexDigits = "0123456789abcdef"

// AppendString appends b as a JSON string, escaped as Encode escapes
// strings ('"', '\\', control characters, '<', '>', '&', U+2028, U+2029),
// except that '\b' and '\f' are written \u0008 and \u000c, and invalid
// UTF-8 (which cannot come from a UTF8 client encoding) is escaped
// byte-wise as \u00XX rather than replaced by U+FFFD, so nothing is
// silently changed.
func AppendString(dst []byte, b []byte) []byte {
	dst = append(dst, '"')
	start := 0
	for i := 0; i < len(b); {
		c := b[i]
		if c < utf8.RuneSelf {
			if c >= 0x20 && c != '"' && c != '\\' && c != '<' && c != '>' && c != '&' {
				i++
				continue
			}
			dst = append(dst, b[start:i]...)
			switch c {
			case '"', '\\':
				dst = append(dst, '\\', c)
			case '\n':
				dst = append(dst, '\\', 'n')
			case '\r':
				dst = append(dst, '\\', 'r')
			case '\t':
				dst = append(dst, '\\', 't')
			default:
				dst = append(dst, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xf])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRune(b[i:])
		if r == utf8.RuneError && size == 1 {
			dst = append(dst, b[start:i]...)
			dst = append(dst, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xf])
			i++
			start = i
			continue
		}
		if r == '\u2028' || r == '\u2029' {
			dst = append(dst, b[start:i]...)
			dst = append(dst, '\\', 'u', '2', '0', '2', hexDigits[r&0xf])
			i += size
			start = i
			continue
		}
		i += size
	}
	dst = append(dst, b[start:]...)
	return append(dst, '"')
}
