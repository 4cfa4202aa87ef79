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
	// InsertRows tries each without its conflict clause first.
	for _, q := range []string{insertRowsSQL, insertStagedRowsSQL} {
		require.Equal(t, 1, strings.Count(q, onConflict))
		require.NotContains(t, strings.Replace(q, onConflict, "", 1), "ON CONFLICT")
	}
}

// jsonSet numbers equal texts alike, from 1, whether they come in the same
// string or in equal ones, and keeps each text once.
func TestJSONSetNumbersDistinctTexts(t *testing.T) {
	t.Parallel()
	var set jsonSet
	a, b, a2 := `{"a":1}`, `{"b":2}`, `{"a":1}`
	var got []int32
	for _, s := range []*string{&a, &a, &b, nil, &a2, &b, &a} {
		n := set.index(s)
		if s == nil {
			require.Nil(t, n)
			continue
		}
		got = append(got, *n)
	}
	require.Equal(t, []int32{1, 1, 2, 1, 2, 1}, got)
	require.Equal(t, []string{a, b}, set.values)
}
