package archive

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
)

func TestSchemaEncoderReusesOnlyEqualEncodings(t *testing.T) {
	t.Parallel()
	var enc schemaEncoder
	refsA := []event.Ref{{Columns: []string{"order_id"}, Schema: "public", Table: "orders", RefColumns: []string{"id"}}}
	refsB := []event.Ref{{Columns: []string{"order_id"}, Schema: "public", Table: "orders", RefColumns: []string{"no"}}}
	colsA := []event.Column{{Name: "id", Type: "bigint", PK: true}}
	colsB := []event.Column{{Name: "id", Type: "bigint"}}
	for _, refs := range [][]event.Ref{refsA, refsA, refsB, nil, refsA} {
		got, err := enc.refs(refs)
		require.NoError(t, err)
		if len(refs) == 0 {
			require.Nil(t, got)
			continue
		}
		want, err := json.Marshal(refs)
		require.NoError(t, err)
		require.JSONEq(t, string(want), *got)
	}
	for _, cols := range [][]event.Column{colsA, colsB, colsB, colsA, nil} {
		got, err := enc.columns(cols)
		require.NoError(t, err)
		if len(cols) == 0 {
			require.Nil(t, got)
			continue
		}
		want, err := json.Marshal(cols)
		require.NoError(t, err)
		require.JSONEq(t, string(want), *got)
	}
}

// The staged statement is insertRowsSQL with each of its three changes made
// exactly once.
func TestInsertStagedRowsSQL(t *testing.T) {
	for _, part := range []string{"COALESCE(u.row, st.row)::jsonb,", ") WITH ORDINALITY\n", "text_values, ord)\n",
		"LEFT JOIN pg_temp.epitaph_staged_rows st ON st.ord = u.ord\nON CONFLICT"} {
		require.Equal(t, 1, strings.Count(insertStagedRowsSQL, part), part)
	}
}
