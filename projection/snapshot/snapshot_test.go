package snapshot_test

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/projection/snapshot"
)

var orderRoots = []string{"public.orders"}

// seedOrder inserts order id with n lines, a note per line (two on line 1)
// and a shipment.
func (e *env) seedOrder(t *testing.T, id int, lines int) {
	t.Helper()
	e.exec(t, `INSERT INTO orders VALUES ($1, 'Zoë "the" customer', 12.50, 9007199254740993, '2026-11-30 09:00:00.123456+01',
		true, 'NaN', '{"gift": true, "n": 1.10}', '{a,"b c",NULL}', '\x00ff10', 'sad', repeat('long ', 5000))`, id)
	for l := 1; l <= lines; l++ {
		e.exec(t, `INSERT INTO lines VALUES ($1, $2::int, 'SKU-'||$2::int, $2::int * 2, 3.333)`, id, l)
		e.exec(t, `INSERT INTO line_notes (order_id, line_no, body) VALUES ($1, $2::int, 'note for '||$2::int)`, id, l)
	}
	e.exec(t, `INSERT INTO line_notes (order_id, line_no, body) VALUES ($1, 1, 'second note')`, id)
	e.exec(t, `INSERT INTO shipments VALUES ($1::int * 10, $1, 'DHL')`, id)
}

// deleteOrder deletes order id bottom-up in tx s.
func (s *sourceTx) deleteOrder(t *testing.T, id int) {
	t.Helper()
	s.del(t, "public.line_notes", "order_id = $1", id)
	s.del(t, "public.lines", "order_id = $1", id)
	s.del(t, "public.shipments", "order_id = $1", id)
	s.del(t, "public.orders", "id = $1", id)
}

func TestDocumentNestsEveryTableByForeignKey(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.seedOrder(t, 1, 2)
	e.exec(t, `INSERT INTO audit (what) VALUES ('unrelated')`)

	s := e.begin(t)
	s.deleteOrder(t, 1)
	s.del(t, "public.audit", "true")
	require.Equal(t, 1, s.apply(t, orderRoots))

	res := e.batch(t, snapshot.Config{})
	require.Equal(t, snapshot.Result{Claimed: 1, Completed: 1}, res)

	snaps := e.show(t, s.correlationID())
	require.Len(t, snaps, 1)
	got := snaps[`{"id":1}`]
	require.Equal(t, "public.orders", got.RootTable)
	require.NotEmpty(t, got.Fingerprint)
	require.NotNil(t, got.CompletedAt)
	d := decodeDoc(t, got)

	require.Equal(t, "public.orders", d.Root.Table)
	require.Equal(t, `{"id":1}`, compact(t, d.Root.Key))
	require.ElementsMatch(t, []string{"public.lines", "public.shipments"}, mapKeys(d.Children))
	lines := d.Children["public.lines"]
	require.Equal(t, []string{`{"line_no":1,"order_id":1}`, `{"line_no":2,"order_id":1}`}, keys(t, lines))
	require.Len(t, lines[0].Children["public.line_notes"], 2, "line 1 has two notes (composite foreign key)")
	require.Len(t, lines[1].Children["public.line_notes"], 1)
	require.Empty(t, lines[1].Children["public.line_notes"][0].Children)
	require.Equal(t, []string{`{"id":10}`}, keys(t, d.Children["public.shipments"]))
	require.Equal(t, s.correlationID(), d.Meta.CorrelationID)
	require.Equal(t, 1+2+3+1, d.Meta.EntityCount)
	require.Equal(t, 1, d.Meta.UnrelatedCount, "the audit row belongs to no order")
	require.Equal(t, 8, d.Meta.TransactionRows)
	require.False(t, d.Meta.ArchivedAt.IsZero())

	// Every node's row is the archived row, and restores to the deleted row.
	byTable := map[string]*archived{}
	for _, a := range s.rows {
		byTable[a.Table+" "+compact(t, a.Key)] = a
	}
	var check func(n docNode)
	check = func(n docNode) {
		a := byTable[n.Table+" "+compact(t, n.Key)]
		require.NotNil(t, a, "%s %s is not an archived row", n.Table, n.Key)
		require.JSONEq(t, string(a.Row), string(n.Row))
		var restored string
		require.NoError(t, e.pool.QueryRow(e.ctx,
			"SELECT jsonb_populate_record(NULL::"+a.Table+", $1::jsonb)::text", string(n.Row)).Scan(&restored))
		require.Equal(t, a.Original, restored, "%s %s restores to the deleted row", n.Table, n.Key)
		for _, kids := range n.Children {
			for _, k := range kids {
				check(k)
			}
		}
	}
	check(docNode{Table: d.Root.Table, Key: d.Root.Key, Row: d.Root.Row, Children: d.Children})
	// Spot-check the value encoding survived the jsonb round trip.
	require.Contains(t, string(d.Root.Row), `9007199254740993`)
	require.Contains(t, string(d.Root.Row), `"12.50"`)
	require.Contains(t, string(d.Root.Row), `"NaN"`)
	require.True(t, strings.Contains(a0(s).Original, "long long"))
}

func a0(s *sourceTx) *archived {
	for _, a := range s.rows {
		if a.Table == "public.orders" {
			return a
		}
	}
	return nil
}

func mapKeys[V any](m map[string]V) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}

// TestKeyOnlyGroupFails: rows archived with a key-only identity lack the
// foreign key columns (a shipment's key is its id, not its order_id), so
// the document cannot be nested honestly: the job fails at once with a
// reason that says why, instead of a complete document without children.
func TestKeyOnlyGroupFails(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.seedOrder(t, 1, 1)
	s := e.begin(t)
	s.deleteOrder(t, 1)
	for _, a := range s.rows {
		a.Row = a.Key // what a REPLICA IDENTITY DEFAULT table archives
	}
	require.Equal(t, 1, s.apply(t, orderRoots))
	res := e.batch(t, snapshot.Config{})
	require.Equal(t, snapshot.Result{Claimed: 1, Failed: 1}, res, "failed at once, not retried")
	got := e.show(t, s.correlationID())[`{"id":1}`]
	require.Equal(t, snapshot.StatusFailed, got.Status)
	require.Equal(t, snapshot.ReasonKeyOnly, got.FailureReason)
	require.Equal(t, "key-only identity: foreign keys not captured", got.FailureReason)
	require.Empty(t, got.Payload)

	// Key-only rows whose keys hold the foreign keys still nest: an order
	// with lines keyed (order_id, line_no), all other tables whole.
	e.seedOrder(t, 2, 2)
	s = e.begin(t)
	s.deleteOrder(t, 2)
	for _, a := range s.rows {
		if a.Table == "public.lines" {
			a.Row = a.Key
		}
	}
	require.Equal(t, 1, s.apply(t, orderRoots))
	res = e.batch(t, snapshot.Config{})
	require.Equal(t, snapshot.Result{Claimed: 1, Completed: 1}, res)
	d := decodeDoc(t, e.show(t, s.correlationID())[`{"id":2}`])
	require.Len(t, d.Children["public.lines"], 2)
	require.Len(t, d.Children["public.lines"][0].Children["public.line_notes"], 2)
}
