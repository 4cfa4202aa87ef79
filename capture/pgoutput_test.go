package capture

import (
	"crypto/ed25519"
	"crypto/rand"
	"encoding/binary"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
)

// deleteMsg builds a pgoutput Delete message; a nil value is NULL, "\x00u"
// an unchanged TOAST value.
func deleteMsg(rel uint32, kind byte, vals ...*string) []byte {
	b := []byte{'D'}
	b = binary.BigEndian.AppendUint32(b, rel)
	b = append(b, kind)
	b = binary.BigEndian.AppendUint16(b, uint16(len(vals)))
	for _, v := range vals {
		switch {
		case v == nil:
			b = append(b, 'n')
		case *v == "\x00u":
			b = append(b, 'u')
		default:
			b = append(b, 't')
			b = binary.BigEndian.AppendUint32(b, uint32(len(*v)))
			b = append(b, *v...)
		}
	}
	return b
}

func sp(s string) *string { return &s }

func TestDeleteDecoderMatchesPglogrepl(t *testing.T) {
	t.Parallel()
	var d deleteDecoder
	for _, src := range [][]byte{
		deleteMsg(16384, 'O', sp("1"), nil, sp("héllo \"world\""), sp(""), sp("\x00u")),
		deleteMsg(7, 'K', sp("42")),
		deleteMsg(99, 'O'),
		deleteMsg(16384, 'O', sp("2"), sp("x"), nil, sp("y"), sp("z"), sp("{\"a\":1}")),
	} {
		want, err := pglogrepl.Parse(src)
		require.NoError(t, err)
		got, err := d.decode(src)
		require.NoError(t, err)
		w := want.(*pglogrepl.DeleteMessage)
		require.Equal(t, w.RelationID, got.RelationID)
		require.Equal(t, w.OldTupleType, got.OldTupleType)
		require.Equal(t, w.OldTuple.ColumnNum, got.OldTuple.ColumnNum)
		require.Len(t, got.OldTuple.Columns, len(w.OldTuple.Columns))
		for i, c := range w.OldTuple.Columns {
			g := got.OldTuple.Columns[i]
			require.Equal(t, c.DataType, g.DataType, "column %d", i)
			require.Equal(t, c.Length, g.Length, "column %d", i)
			require.Equal(t, string(c.Data), string(g.Data), "column %d", i)
		}
	}
	// Every truncation of a message is an error, never a panic or a short row.
	full := deleteMsg(5, 'O', sp("abc"), nil, sp("defg"))
	for n := 0; n < len(full); n++ {
		_, err := d.decode(full[:n])
		require.Error(t, err, "truncated to %d bytes", n)
	}
	_, err := d.decode(deleteMsg(5, 'X', sp("1")))
	require.ErrorContains(t, err, "tuple type")
}

func TestTxInfoTextMatchesEvent(t *testing.T) {
	t.Parallel()
	_, priv, err := ed25519.GenerateKey(rand.Reader)
	require.NoError(t, err)
	tagger := event.NewMsgIDTagger(priv)
	for _, lsn := range []event.LSN{0, 1, 0x1A2B3C8, 0xFFFFFFFF, 0x100000000, 0xABCDEF0123456789} {
		ct := time.Date(2026, 11, 30, 9, 0, 0, 120000000, time.UTC)
		tx := newTxInfo("main", 9, lsn, ct, nil)
		tagged := newTxInfo("main", 9, lsn, ct, tagger)
		for _, n := range []int{0, 1, 7, 12345} {
			require.Equal(t, event.MsgID("main", lsn, n), tx.msgID(n))
			require.Equal(t, tagger.RowMsgID("main", lsn, n), tagged.msgID(n))
			require.Equal(t, event.MsgID("main", lsn, n), event.UntaggedMsgID(tagged.msgID(n)))
			require.Equal(t, position{lsn: lsn, n: n}.String(), tx.position(n))
		}
	}
}
