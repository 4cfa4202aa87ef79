package capture

import (
	"io"

	"github.com/jackc/pglogrepl"

	"github.com/epitaph-dev/epitaph/event"
)

// A row too large for a message goes to the object store. Its image is not
// built in memory beside the WAL message it comes from: encodeRow (with
// rowImage.stream) builds it without its large values, and imageReader
// reads the whole image, encoding those values from the message in pieces
// as the object store takes them. A row of S bytes then costs the capture
// the message (S) and the pieces in flight, not a second S.

// largeImage is the row size (the column values, without escapes) from
// which a row is streamed; the streamer also lets go of reused buffers
// above it (releaseLarge).
const largeImage = 1 << 20

// streamValueAbove is the value size left out of a streamed image.
const streamValueAbove = 64 << 10

// streamPiece is how much of a value one read encodes at most.
const streamPiece = 64 << 10

// streamedValue is a value left out of rowImage.row: it goes at offset at,
// from column col of the tuple.
type streamedValue struct {
	at  int
	col int
}

// appendValue appends column col's value to the image being built, or,
// streaming, leaves a large one out and notes where it goes.
func (img *rowImage) appendValue(row []byte, typeOID uint32, col int, c *pglogrepl.TupleDataColumn) []byte {
	if img.stream && len(c.Data) > streamValueAbove {
		img.streamed = append(img.streamed, streamedValue{at: len(row), col: col})
		return row
	}
	return appendColumn(row, typeOID, c)
}

// imageSize is the size of the row's JSON image without escapes: the
// column values, their labels and the punctuation.
func (r *relation) imageSize(tup *pglogrepl.TupleData) int {
	n := 2
	for i, c := range tup.Columns {
		n += len(r.cols[i].label) + len(c.Data) + 8
	}
	return n
}

// valuesSize is the size of the tuple's values: at most the size of its
// image (which adds labels, quotes and escapes; a column not in the image
// has no value in the tuple).
func valuesSize(tup *pglogrepl.TupleData) int {
	n := 0
	for _, c := range tup.Columns {
		n += len(c.Data)
	}
	return n
}

// imageReader reads the image encodeRow would have built: img.row with
// each streamed value encoded in its place. The tuple's data must stay
// valid while it is read (until the next receive).
type imageReader struct {
	r    *relation
	tup  *pglogrepl.TupleData
	img  *rowImage
	next int    // the next streamed value
	off  int    // read position in img.row
	val  []byte // the value being encoded; nil between values
	str  bool   // the value goes in a JSON string (escaped)
	out  []byte // to be read: a part of img.row or of buf
	buf  []byte // pieces of values, encoded
}

func newImageReader(r *relation, tup *pglogrepl.TupleData, img *rowImage) *imageReader {
	return &imageReader{r: r, tup: tup, img: img}
}

func (ir *imageReader) Read(p []byte) (int, error) {
	n := 0
	for n < len(p) {
		if len(ir.out) == 0 && !ir.fill() {
			break
		}
		c := copy(p[n:], ir.out)
		ir.out = ir.out[c:]
		n += c
	}
	if n == 0 && len(p) > 0 {
		return 0, io.EOF
	}
	return n, nil
}

// fill makes the next output: a part of img.row, or a piece of a value.
// False at the end.
func (ir *imageReader) fill() bool {
	if ir.val != nil {
		ir.buf = ir.piece(ir.buf[:0])
		ir.out = ir.buf
		return true
	}
	end := len(ir.img.row)
	if ir.next < len(ir.img.streamed) {
		end = ir.img.streamed[ir.next].at
	}
	if ir.off < end {
		ir.out = ir.img.row[ir.off:end]
		ir.off = end
		return true
	}
	if ir.next == len(ir.img.streamed) {
		return false
	}
	sv := ir.img.streamed[ir.next]
	ir.next++
	c := ir.tup.Columns[sv.col]
	typeOID := ir.r.cols[sv.col].typeOID
	ir.val, ir.str = c.Data, !rawValue(typeOID, c.Data)
	if ir.buf == nil {
		ir.buf = make([]byte, 0, 6*streamPiece+8) // the most a piece escapes to
	}
	if ir.str {
		ir.buf = append(ir.buf[:0], '"')
	} else {
		ir.buf = ir.piece(ir.buf[:0])
	}
	ir.out = ir.buf
	return true
}

// piece encodes the next piece of the current value into dst. A string is
// cut only before the first byte of a UTF-8 sequence, so each piece escapes
// as it would in the whole (event.AppendString decodes rune by rune).
func (ir *imageReader) piece(dst []byte) []byte {
	v := ir.val
	j := min(len(v), streamPiece)
	if ir.str {
		for j < len(v) && j > 0 && v[j]&0xC0 == 0x80 {
			j--
		}
		if j == 0 { // no sequence start in the first 64 KiB: invalid bytes, cut forward
			j = min(len(v), streamPiece)
			for j < len(v) && v[j]&0xC0 == 0x80 {
				j++
			}
		}
		q := event.AppendString(dst, v[:j])
		dst = append(dst, q[len(dst)+1:len(q)-1]...) // without its quotes
	} else {
		dst = append(dst, v[:j]...)
	}
	ir.val = v[j:]
	if len(ir.val) == 0 {
		ir.val = nil
		if ir.str {
			dst = append(dst, '"')
		}
	}
	return dst
}
