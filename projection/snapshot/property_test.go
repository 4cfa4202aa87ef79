package snapshot

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
)

// countNodes counts the nodes of a decoded document and checks no row
// appears twice.
func countNodes(t *testing.T, kids map[string][]*node, seen map[string]bool) int {
	n := 0
	for table, list := range kids {
		for _, c := range list {
			id := table + string(c.Key)
			require.False(t, seen[id], "row %s appears twice", id)
			seen[id] = true
			n += 1 + countNodes(t, c.Children, seen)
		}
	}
	return n
}

// Random self-referencing and cross-referencing graphs (cycles, self-loops,
// several parents, dangling references): every document terminates, holds
// each row at most once, counts what it holds, and the unrelated count is
// what no root reaches.
func TestAssemblyOnRandomGraphs(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(42, 7))
	for round := range 300 {
		nodes := 1 + rng.IntN(30)
		var rows []*archiveRow
		for i := range nodes {
			table := []string{"a", "b"}[rng.IntN(2)]
			vals := map[string]any{"id": i}
			var refs []event.Ref
			for _, fk := range []string{"pa", "pb"} {
				if rng.IntN(3) > 0 {
					vals[fk] = rng.IntN(nodes + 3) // may dangle
				} else {
					vals[fk] = nil
				}
				refs = append(refs, event.Ref{Columns: []string{fk}, Schema: "s", Table: map[string]string{"pa": "a", "pb": "b"}[fk], RefColumns: []string{"id"}})
			}
			row, _ := json.Marshal(vals)
			rows = append(rows, &archiveRow{Schema: "s", Table: table, Key: json.RawMessage(fmt.Sprintf(`{"id":%d}`, i)),
				Row: row, Refs: refs, CommitLSN: 1, Seq: i})
		}
		g := newGroup("c", rows)
		var roots []int
		for i := range rows {
			if rng.IntN(4) == 0 {
				roots = append(roots, i)
			}
		}
		reached := map[int]bool{}
		for _, r := range roots {
			kids, members := g.subtree(r)
			seen := map[string]bool{g.rows[r].qualified() + string(g.rows[r].Key): true}
			require.Equal(t, len(members)-1, countNodes(t, kids, seen), "round %d", round)
			for _, m := range members {
				reached[m] = true
			}
			b, err := g.document(r, 0)
			require.NoError(t, err)
			require.True(t, json.Valid(b))
		}
		require.Equal(t, len(rows)-len(reached), g.unrelated(roots), "round %d", round)
	}
}
