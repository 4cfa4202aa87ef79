package capture

import (
	"encoding/binary"
	"fmt"

	"github.com/jackc/pglogrepl"
)

// deleteDecoder decodes pgoutput Delete messages ('D') into one reused
// pglogrepl.DeleteMessage, the hot path of a drain: unlike pglogrepl.Parse
// it allocates nothing per row, and column values are slices of the
// message (valid until the next receive; encodeRow copies them).
type deleteDecoder struct {
	msg  pglogrepl.DeleteMessage
	tup  pglogrepl.TupleData
	cols []pglogrepl.TupleDataColumn
	ptrs []*pglogrepl.TupleDataColumn
}

// decode parses src, a whole pgoutput message starting with 'D'. The
// result is valid until the next call.
func (d *deleteDecoder) decode(src []byte) (*pglogrepl.DeleteMessage, error) {
	if len(src) < 8 || src[0] != byte(pglogrepl.MessageTypeDelete) {
		return nil, fmt.Errorf("delete message: %d bytes", len(src))
	}
	d.msg.RelationID = binary.BigEndian.Uint32(src[1:])
	d.msg.OldTupleType = src[5]
	if t := d.msg.OldTupleType; t != pglogrepl.DeleteMessageTupleTypeKey && t != pglogrepl.DeleteMessageTupleTypeOld {
		return nil, fmt.Errorf("delete message: tuple type %q, want K or O", t)
	}
	n := int(binary.BigEndian.Uint16(src[6:]))
	if cap(d.cols) < n {
		d.cols = make([]pglogrepl.TupleDataColumn, n)
		d.ptrs = make([]*pglogrepl.TupleDataColumn, n)
	}
	d.cols, d.ptrs = d.cols[:n], d.ptrs[:n]
	p := 8
	for i := range n {
		if p >= len(src) {
			return nil, fmt.Errorf("delete message: truncated at column %d", i)
		}
		c := &d.cols[i]
		*c = pglogrepl.TupleDataColumn{DataType: src[p]}
		p++
		switch c.DataType {
		case pglogrepl.TupleDataTypeText, pglogrepl.TupleDataTypeBinary:
			if p+4 > len(src) {
				return nil, fmt.Errorf("delete message: truncated length of column %d", i)
			}
			c.Length = binary.BigEndian.Uint32(src[p:])
			p += 4
			if uint64(c.Length) > uint64(len(src)-p) {
				return nil, fmt.Errorf("delete message: column %d: %d bytes, %d left", i, c.Length, len(src)-p)
			}
			c.Data = src[p : p+int(c.Length) : p+int(c.Length)]
			p += int(c.Length)
		case pglogrepl.TupleDataTypeNull, pglogrepl.TupleDataTypeToast:
		default:
			return nil, fmt.Errorf("delete message: column %d: kind %q", i, c.DataType)
		}
		d.ptrs[i] = c
	}
	d.tup.ColumnNum = uint16(n)
	d.tup.Columns = d.ptrs
	d.msg.OldTuple = &d.tup
	return &d.msg, nil
}
