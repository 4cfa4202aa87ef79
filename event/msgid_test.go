package event_test

import (
	"crypto/ed25519"
	"crypto/rand"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
)

// A row's tagged id is the plain id plus a tag that depends on the key,
// the commit LSN and the seq: the same for the same key (so JetStream still
// drops a re-publish), different for another key or another row, and
// UntaggedMsgID gives the plain form back (also of a republished id's base).
func TestMsgIDTagger(t *testing.T) {
	t.Parallel()
	_, k1, err := ed25519.GenerateKey(rand.Reader)
	require.NoError(t, err)
	_, k2, err := ed25519.GenerateKey(rand.Reader)
	require.NoError(t, err)
	a, again, other := event.NewMsgIDTagger(k1), event.NewMsgIDTagger(k1), event.NewMsgIDTagger(k2)
	seen := map[string]bool{}
	for _, lsn := range []event.LSN{0, 1, 0x1A2B3C8, 0xFFFFFFFFFFFFFFFF} {
		for _, seq := range []int{0, 1, 2, 99999} {
			id := a.RowMsgID("main", lsn, seq)
			require.Regexp(t, `^main/[0-9A-F]+/[0-9A-F]+/[0-9]+/t[0-9a-f]{16}$`, id)
			require.Equal(t, id, again.RowMsgID("main", lsn, seq), "deterministic per key")
			require.NotEqual(t, id, other.RowMsgID("main", lsn, seq), "another key, another tag")
			require.Equal(t, event.MsgID("main", lsn, seq), event.UntaggedMsgID(id))
			base, n := event.BaseMsgID(event.RepublishedMsgID(id, 3))
			require.Equal(t, []any{id, 3}, []any{base, n})
			require.False(t, seen[id], "every row its own id")
			seen[id] = true
		}
	}
	for _, plain := range []string{"main/0/1A/3", "main/0/1A/commit", "main/0/1A/3/tXYZ", "main/0/1A/3/t0123456789abcdeg"} {
		require.Equal(t, plain, event.UntaggedMsgID(plain), "not a tag: unchanged")
	}
}
