package capture

import (
	"bytes"
	"encoding/json"
	"io"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/jackc/pglogrepl"
	"github.com/stretchr/testify/require"
)

// TestImageReaderMatchesEncodeRow: a streamed image reads byte for byte as
// the image encodeRow builds whole, for large values of every encoding
// (escapes, multi-byte and invalid UTF-8 at the piece boundaries, raw
// numbers and jsonb, NULLs and small values between them), whatever the
// reader's buffer size.
func TestImageReaderMatchesEncodeRow(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(20, 6))
	alphabet := []string{"a", "é", "€", "😀", "\"", "\\", "\n", "\x01", "<", "\u2028", "\xff", "\xe2\x82", "\x80", "z"}
	text := func(n int) []byte {
		var b strings.Builder
		for b.Len() < n {
			b.WriteString(alphabet[rng.IntN(len(alphabet))])
		}
		return []byte(b.String())
	}
	digits := func(n int) []byte {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte('1' + rng.IntN(9))
		}
		return b
	}
	col := func(b []byte) *pglogrepl.TupleDataColumn {
		return &pglogrepl.TupleDataColumn{DataType: pglogrepl.TupleDataTypeText, Data: b, Length: uint32(len(b))}
	}
	type column struct {
		name string
		oid  uint32
		val  *pglogrepl.TupleDataColumn
	}
	big := streamPiece*3 + 17
	cases := [][]column{
		{{"id", oidInt4, col([]byte("1"))}, {"body", 25, col(text(big))}},
		{{"body", 25, col(text(big))}, {"n", oidInt8, col(digits(big))}, {"t", 25, col([]byte("small"))},
			{"nul", 25, &pglogrepl.TupleDataColumn{DataType: pglogrepl.TupleDataTypeNull}}, {"b", oidBool, col([]byte("t"))}},
		{{"doc", oidJSONB, col([]byte(`{"k":"` + strings.Repeat("v", big) + `"}`))}, {"s", oidJSONB, col([]byte(`"` + strings.Repeat("w", big) + `"`))}},
		{{"cont", 25, col([]byte(strings.Repeat("\x80", big)))}, {"bin", 17, col([]byte(`\x` + strings.Repeat("ab", big)))}},
		{{"exact", 25, col([]byte(strings.Repeat("é", streamPiece)))}, {"f", oidFloat8, col(digits(big))}},
	}
	for i, cs := range cases {
		r := &relation{name: "public.t"}
		var tup pglogrepl.TupleData
		for j, c := range cs {
			label, _ := json.Marshal(c.name)
			r.cols = append(r.cols, relColumn{name: c.name, typeOID: c.oid, key: j == 0, label: append(label, ':')})
			tup.Columns = append(tup.Columns, c.val)
		}
		r.pkIdx = []int{0}
		var whole rowImage
		require.NoError(t, r.encodeRow(&whole, pglogrepl.DeleteMessageTupleTypeOld, &tup))
		for _, bufSize := range []int{1, 7, 4096, 1 << 20} {
			img := rowImage{stream: true}
			require.NoError(t, r.encodeRow(&img, pglogrepl.DeleteMessageTupleTypeOld, &tup))
			require.NotEmpty(t, img.streamed, "case %d streams a value", i)
			require.Less(t, len(img.row), 4096, "case %d: the large values are left out", i)
			require.Equal(t, string(whole.key), string(img.key))
			require.Equal(t, whole.identity, img.identity)
			got, err := io.ReadAll(io.LimitReader(&bufReader{r: newImageReader(r, &tup, &img), n: bufSize}, int64(len(whole.row))+1))
			require.NoError(t, err)
			require.Equal(t, len(whole.row), len(got), "case %d, reads of %d", i, bufSize)
			require.True(t, bytes.Equal(whole.row, got), "case %d, reads of %d: the streamed image differs", i, bufSize)
		}
		require.True(t, json.Valid(whole.row), "case %d is JSON", i)
	}
}

// bufReader reads through buffers of n bytes.
type bufReader struct {
	r io.Reader
	n int
}

func (b *bufReader) Read(p []byte) (int, error) { return b.r.Read(p[:min(len(p), b.n)]) }
