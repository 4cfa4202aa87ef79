package projection

import (
	"fmt"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
)

// chooseCandidates finds the signed transaction among two candidates for
// each of its 30 seqs (2^30 combinations, far past maxChoices) when the
// real rows are all the last copies (a capture's replay after a stale
// prefix) or all the first ones (copies added after them), in one or two
// digests; a mix of both, beyond the budget, is refused, never guessed.
// The window's stream order is what decides first and last, not the
// seq order.
func TestChooseCandidatesTriesTheLastThenTheFirstCopies(t *testing.T) {
	const lsn, rows = event.LSN(0x5000), 30
	mk := func(seq int, body string) *item {
		data := []byte(fmt.Sprintf(`{"seq":%d,"body":%q}`, seq, body))
		return &item{ev: &event.Event{CommitLSN: lsn, Seq: seq},
			headers: map[string][]string{event.HeaderPartitionSeq: {strconv.Itoa(100 + seq)}}, data: data}
	}
	real, other := make([]*item, rows), make([]*item, rows)
	for s := range rows {
		real[s], other[s] = mk(s, "real"), mk(s, "other")
	}
	signed := func(pick []*item) string {
		d := event.NewDigest()
		d.ResetAlg(true)
		for _, it := range pick {
			d.Add(partSeqOf(it), it.data)
		}
		return d.Sum()
	}
	want := signed(real)
	requireChosen := func(window []*item, what string) {
		t.Helper()
		got, absent, err := chooseCandidates(window, lsn, rows, want, true, nil)
		require.NoError(t, err)
		require.Empty(t, absent)
		require.Len(t, got, rows, what)
		for _, it := range real {
			require.True(t, got[it], "%s: seq %d is the real row", what, it.ev.Seq)
		}
	}
	requireChosen(append(append([]*item{}, other...), real...), "the real rows last (a replay after a stale prefix)")
	requireChosen(append(append([]*item{}, real...), other...), "the real rows first (copies added after them)")
	var interleaved []*item
	for s := range rows {
		interleaved = append(interleaved, other[s], real[s])
	}
	requireChosen(interleaved, "each real row after its other copy")

	var mixed []*item // real rows first for half the seqs, last for the rest
	for s := range rows {
		if s%2 == 0 {
			mixed = append(mixed, real[s], other[s])
		} else {
			mixed = append(mixed, other[s], real[s])
		}
	}
	got, _, err := chooseCandidates(mixed, lsn, rows, want, true, nil)
	require.NoError(t, err)
	require.Nil(t, got, "2^30 combinations and neither all-first nor all-last: refused")

	// Within the budget the mix is found by the enumeration.
	few := 8
	realFew, mixedFew := real[:few], []*item{}
	for s := range few {
		if s%2 == 0 {
			mixedFew = append(mixedFew, realFew[s], other[s])
		} else {
			mixedFew = append(mixedFew, other[s], realFew[s])
		}
	}
	want = signed(realFew)
	got, _, err = chooseCandidates(mixedFew, lsn, few, want, true, nil)
	require.NoError(t, err)
	require.Len(t, got, few)
	for _, it := range realFew {
		require.True(t, got[it], "seq %d is the real row", it.ev.Seq)
	}
}
