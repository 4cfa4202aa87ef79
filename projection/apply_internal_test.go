package projection

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
)

func TestSplitAtCommit(t *testing.T) {
	t.Parallel()
	del := func() *item { return &item{ev: &event.Event{Op: event.OpDelete}} }
	commit := func() *item { return &item{ev: &event.Event{Op: event.OpCommit}} }
	bad := func() *item { return &item{} } // undecodable
	big := func(n int) *item { return &item{ev: &event.Event{Op: event.OpDelete}, data: make([]byte, n)} }
	many := func(n int, f func() *item) []*item {
		out := make([]*item, n)
		for i := range out {
			out[i] = f()
		}
		return out
	}
	for _, tc := range []struct {
		name         string
		items        []*item
		apply, carry int
	}{
		{"ends with a commit", []*item{del(), del(), commit()}, 3, 0},
		{"tail after the last commit is carried", []*item{del(), commit(), del(), bad(), del()}, 2, 3},
		{"no commit: applied as it is", many(10, del), 10, 0},
		{"tail longer than the carry limit: applied as it is",
			append([]*item{del(), commit()}, many(maxCarry+1, del)...), maxCarry + 3, 0},
		{"tail at the carry limit is carried",
			append([]*item{del(), commit()}, many(maxCarry, del)...), 2, maxCarry},
		{"empty", nil, 0, 0},
		{"tail larger than the carry byte limit: applied as it is",
			[]*item{del(), commit(), big(maxCarryBytes / 2), big(maxCarryBytes/2 + 1)}, 4, 0},
		{"tail at the carry byte limit is carried",
			[]*item{del(), commit(), big(maxCarryBytes / 2), big(maxCarryBytes / 2)}, 2, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			apply, carry := splitAtCommit(tc.items)
			require.Len(t, apply, tc.apply)
			require.Len(t, carry, tc.carry)
			require.Equal(t, len(tc.items), len(apply)+len(carry))
			for i, it := range append(append([]*item{}, apply...), carry...) {
				require.Same(t, tc.items[i], it, "nothing lost or reordered")
			}
		})
	}
}
