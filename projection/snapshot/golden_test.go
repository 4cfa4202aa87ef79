package snapshot

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
)

// assemblyOutput writes what assembly makes of fixed inputs: the shop
// transaction's jobs (outcomes, payloads, fingerprints) with two root
// tables, and 500 random graphs (three tables, cycles, dangling, NULL and
// absent foreign keys) with their unrelated counts, fingerprints, key-only
// verdicts and documents.
func assemblyOutput(t *testing.T, w io.Writer) {
	cfg := Config{Schema: "x"}
	cfg.setDefaults()
	for _, n := range []int{1, 3, 100} {
		gr, tables := shopGroup(n)
		jobs, lg, ok := assemble(gr, tables, []string{"public.orders", "public.lines"})
		fmt.Fprintln(w, ok, len(jobs), lg.fp, lg.unrelated)
		for _, j := range jobs {
			out := lg.outcome(j, &cfg)
			fmt.Fprintln(w, out.status, string(out.payload))
		}
	}
	rng := rand.New(rand.NewPCG(9, 7))
	for round := range 500 {
		nodes := 1 + rng.IntN(40)
		var rows []*archiveRow
		for i := range nodes {
			table := []string{"a", "b", "c"}[rng.IntN(3)]
			vals := map[string]any{"id": i, "x": "v\"<"}
			var refs []event.Ref
			for _, fk := range []string{"pa", "pb", "pc"} {
				if rng.IntN(3) > 0 {
					vals[fk] = rng.IntN(nodes + 3)
				} else if rng.IntN(2) == 0 {
					vals[fk] = nil
				}
				refs = append(refs, event.Ref{Columns: []string{fk}, Schema: "s", Table: map[string]string{"pa": "a", "pb": "b", "pc": "c"}[fk], RefColumns: []string{"id"}})
			}
			row, err := json.Marshal(vals)
			require.NoError(t, err)
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
		u := g.unrelated(roots)
		fmt.Fprintln(w, round, u, g.fingerprint(), keyOnlyRefs(g.rows))
		for _, r := range roots {
			b, err := g.document(r, u)
			fmt.Fprintln(w, string(b), err)
		}
	}
}

// Assembly's output is byte for byte what the build before the allocation
// cuts (5c8a662) wrote for the same inputs: stored documents and
// fingerprints are compared across versions (compare, invalidation), so
// making assembly cheaper must not change one byte. The digest is that
// build's; a deliberate change of the document format changes it here.
func TestAssemblyOutputAsBefore(t *testing.T) {
	t.Parallel()
	h := sha256.New()
	assemblyOutput(t, h)
	require.Equal(t, "855be5cb8a692898f6113abe7ae3d9eaaccfbc1f9d57e10a5caf7090660fc035", hex.EncodeToString(h.Sum(nil)))
}
