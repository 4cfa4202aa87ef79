package projection

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
)

func mkRow(seq int, table, key, image string, refs ...event.Ref) *archiveRow {
	ev := &event.Event{Op: event.OpDelete, Source: "main", Schema: "public", Table: table, CommitLSN: 0x100, Seq: seq,
		Columns: []event.Column{{Name: "id", Type: "bigint", PK: true}}, Key: json.RawMessage(key), Refs: refs}
	return &archiveRow{ev: ev, row: json.RawMessage(image)}
}

func fk(cols []string, table string, refCols []string) event.Ref {
	return event.Ref{Columns: cols, Schema: "public", Table: table, RefColumns: refCols}
}

func roots(rows []*archiveRow) []any {
	out := make([]any, len(rows))
	for i, r := range rows {
		if r.isRoot == nil {
			out[i] = nil
		} else {
			out[i] = *r.isRoot
		}
	}
	return out
}

func TestRootsInMemory(t *testing.T) {
	t.Parallel()
	toOrder := fk([]string{"order_id"}, "orders", []string{"id"})
	toParent := fk([]string{"parent_id"}, "categories", []string{"id"})
	composite := fk([]string{"a", "b"}, "pairs", []string{"x", "y"})
	for _, tc := range []struct {
		name string
		rows []*archiveRow
		want []any
	}{
		{"cascade", []*archiveRow{
			mkRow(0, "orders", `{"id":1}`, `{"id":1}`),
			mkRow(1, "lines", `{"id":10}`, `{"id":10,"order_id":1}`, toOrder),
		}, []any{true, false}},
		{"child first", []*archiveRow{
			mkRow(0, "lines", `{"id":10}`, `{"id":10,"order_id":1}`, toOrder),
			mkRow(1, "orders", `{"id":1}`, `{"id":1}`),
		}, []any{false, true}},
		{"parent not deleted", []*archiveRow{
			mkRow(0, "lines", `{"id":10}`, `{"id":10,"order_id":2}`, toOrder),
			mkRow(1, "orders", `{"id":1}`, `{"id":1}`),
		}, []any{true, true}},
		{"null fk", []*archiveRow{
			mkRow(0, "categories", `{"id":1}`, `{"id":1,"parent_id":null}`, toParent),
			mkRow(1, "categories", `{"id":2}`, `{"id":2,"parent_id":1}`, toParent),
		}, []any{true, false}},
		{"self reference is not a parent", []*archiveRow{
			mkRow(0, "categories", `{"id":1}`, `{"id":1,"parent_id":1}`, toParent),
		}, []any{true}},
		{"cycle", []*archiveRow{
			mkRow(0, "categories", `{"id":1}`, `{"id":1,"parent_id":2}`, toParent),
			mkRow(1, "categories", `{"id":2}`, `{"id":2,"parent_id":1}`, toParent),
		}, []any{false, false}},
		{"composite", []*archiveRow{
			mkRow(0, "pairs", `{"id":1}`, `{"id":1,"x":"a","y":2}`),
			mkRow(1, "kids", `{"id":5}`, `{"id":5,"a":"a","b":2}`, composite),
			mkRow(2, "kids", `{"id":6}`, `{"id":6,"a":"a","b":3}`, composite),
		}, []any{true, false, true}},
		{"key-only child lacks the fk: cannot be told", []*archiveRow{
			mkRow(0, "orders", `{"id":1}`, `{"id":1}`),
			mkRow(1, "lines", `{"id":10}`, `{"id":10}`, toOrder),
		}, []any{true, nil}},
		{"key-only child with a null fk: references nothing", []*archiveRow{
			mkRow(0, "lines", `{"id":10}`, `{"id":10,"order_id":null}`, toOrder),
		}, []any{true}},
		{"key-only parent lacks the referenced column", []*archiveRow{
			mkRow(0, "pairs", `{"id":1}`, `{"id":1}`),
			mkRow(1, "kids", `{"id":5}`, `{"id":5,"a":"a","b":2}`, composite),
		}, []any{true, nil}},
		{"a known parent decides, whatever else is unknown", []*archiveRow{
			mkRow(0, "pairs", `{"id":1}`, `{"id":1}`),
			mkRow(1, "pairs", `{"id":2}`, `{"id":2,"x":"a","y":2}`),
			mkRow(2, "kids", `{"id":5}`, `{"id":5,"a":"a","b":2}`, composite),
		}, []any{true, true, false}},
	} {
		commit := &item{ev: &event.Event{Op: event.OpCommit, CommitLSN: 0x100, Rows: len(tc.rows)}}
		settled := rootsInPage(tc.rows, []*item{commit})
		require.True(t, settled[0x100], tc.name)
		require.Equal(t, tc.want, roots(tc.rows), tc.name)
	}
}

// Early decisions on a transaction spanning pages are only the certain
// ones: no refs -> root, parent seen before -> not; the rest wait (nil).
func TestDecideEarly(t *testing.T) {
	t.Parallel()
	toOrder := fk([]string{"order_id"}, "orders", []string{"id"})
	toCustomer := fk([]string{"customer_id"}, "customers", []string{"id"})
	page1 := []*archiveRow{
		mkRow(0, "orders", `{"id":1}`, `{"id":1,"customer_id":7}`, toCustomer),
		mkRow(1, "lines", `{"id":10}`, `{"id":10,"order_id":1}`, toOrder),
		mkRow(2, "lines", `{"id":11}`, `{"id":11,"order_id":2}`, toOrder),
	}
	open := decideEarly(page1, map[event.LSN]bool{}, nil)
	require.Equal(t, []any{nil, false, nil}, roots(page1))
	require.NotNil(t, open)
	page2 := []*archiveRow{
		mkRow(3, "lines", `{"id":12}`, `{"id":12,"order_id":1}`, toOrder),
		mkRow(4, "notes", `{"id":99}`, `{"id":99}`),
	}
	open2 := decideEarly(page2, map[event.LSN]bool{}, open)
	require.Same(t, open, open2, "same transaction continues")
	require.Equal(t, []any{false, true}, roots(page2))
}
