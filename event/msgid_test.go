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

// Commit, mark (and heartbeat) and gap ids are tagged too: the plain id
// (readable by an operator, and what UntaggedMsgID gives back) plus a tag
// that is the same for the same key, differs for another key, and differs
// between any two of the capture's ids of one key.
func TestSignedMessageIDsAreTagged(t *testing.T) {
	t.Parallel()
	_, k1, err := ed25519.GenerateKey(rand.Reader)
	require.NoError(t, err)
	_, k2, err := ed25519.GenerateKey(rand.Reader)
	require.NoError(t, err)
	a, again, other := event.NewMsgIDTagger(k1), event.NewMsgIDTagger(k1), event.NewMsgIDTagger(k2)
	type idFunc struct {
		name   string
		plain  func(lsn event.LSN, p int) string
		tagged func(t *event.MsgIDTagger, lsn event.LSN, p int) string
	}
	funcs := []idFunc{
		{"commit", func(lsn event.LSN, _ int) string { return event.CommitMsgID("main", lsn) },
			func(t *event.MsgIDTagger, lsn event.LSN, _ int) string { return t.CommitMsgID("main", lsn) }},
		{"mark", func(lsn event.LSN, p int) string { return event.MarkMsgID("main", lsn, p) },
			func(t *event.MsgIDTagger, lsn event.LSN, p int) string { return t.MarkMsgID("main", lsn, p) }},
		{"gap", func(lsn event.LSN, p int) string { return event.GapMsgID("main", lsn/2, lsn, p) },
			func(t *event.MsgIDTagger, lsn event.LSN, p int) string { return t.GapMsgID("main", lsn/2, lsn, p) }},
		{"table gap", func(lsn event.LSN, p int) string {
			return event.TableGapMsgID("main", "public", "order.lines", lsn, lsn, p)
		},
			func(t *event.MsgIDTagger, lsn event.LSN, p int) string {
				return t.TableGapMsgID("main", "public", "order.lines", lsn, lsn, p)
			}},
	}
	seen := map[string]string{}
	for _, f := range funcs {
		for _, lsn := range []event.LSN{1, 0x1A2B3C8, 0xFFFFFFFFFFFFFFFF} {
			for _, p := range []int{0, 1, 7} {
				plain, id := f.plain(lsn, p), f.tagged(a, lsn, p)
				require.Regexp(t, `/t[0-9a-f]{16}$`, id, f.name)
				require.Equal(t, plain+id[len(id)-18:], id, "%s: the plain id, then the tag", f.name)
				require.Equal(t, plain, event.UntaggedMsgID(id), f.name)
				require.Equal(t, id, f.tagged(again, lsn, p), "%s: deterministic per key", f.name)
				require.NotEqual(t, id, f.tagged(other, lsn, p), "%s: another key, another tag", f.name)
				base, n := event.BaseMsgID(event.RepublishedMsgID(id, 2))
				require.Equal(t, []any{id, 2}, []any{base, n}, f.name)
				require.Equal(t, plain, event.UntaggedMsgID(base), f.name)
				tag := id[len(id)-16:]
				if was, ok := seen[tag]; ok {
					require.Equal(t, plain, was, "%s: every id its own tag", f.name)
				}
				seen[tag] = plain
				require.Equal(t, a.Tag(plain), id, f.name)
			}
		}
	}
	// A row's and a commit's tags of one transaction differ, so neither
	// predicts the other.
	row, commit := a.RowMsgID("main", 0x1A2B3C8, 0), a.CommitMsgID("main", 0x1A2B3C8)
	require.NotEqual(t, row[len(row)-16:], commit[len(commit)-16:])
}
