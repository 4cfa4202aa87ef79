package snapshot

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/tidwall/gjson"

	"github.com/epitaph-dev/epitaph/event"
)

func TestMatchForm(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		in   string
		want string
		ok   bool
	}{
		{`42`, `42`, true},
		{`9007199254740993`, `9007199254740993`, true},
		{`"42"`, `42`, true}, // numeric text form matches an integer
		{`"a\"b"`, `a"b`, true},
		{`true`, `true`, true},
		{`{"b": 1, "a": [1, 2]}`, `{"b":1,"a":[1,2]}`, true},
		{`null`, ``, false},
		{``, ``, false},
	} {
		got, ok := matchForm(gjson.Parse(tc.in))
		require.Equal(t, tc.ok, ok, tc.in)
		require.Equal(t, tc.want, got, tc.in)
	}
}

func row(table string, seq int, key, values string, refs ...event.Ref) *archiveRow {
	schema, name := "public", table
	return &archiveRow{Schema: schema, Table: name, Key: json.RawMessage(key), Row: json.RawMessage(values),
		Refs: refs, CommitLSN: 0x10, Seq: seq, ArchivedAt: time.Unix(int64(seq), 0)}
}

func ref(cols []string, table string, refCols []string) event.Ref {
	return event.Ref{Columns: cols, Schema: "public", Table: table, RefColumns: refCols}
}

func TestGroupEdges(t *testing.T) {
	t.Parallel()
	lineRef := ref([]string{"o", "n"}, "lines", []string{"order_id", "line_no"})
	orderRef := ref([]string{"order_id"}, "orders", []string{"id"})
	rows := []*archiveRow{
		row("notes", 5, `{"id":1}`, `{"id":1,"o":1,"n":2}`, lineRef),
		row("notes", 4, `{"id":2}`, `{"id":2,"o":1,"n":null}`, lineRef), // NULL part: references nothing
		row("notes", 6, `{"id":3}`, `{"id":3,"o":2,"n":1}`, lineRef),    // other order's line 1 is absent
		row("lines", 2, `{"order_id":1,"line_no":2}`, `{"order_id":1,"line_no":2}`, orderRef),
		row("lines", 1, `{"order_id":1,"line_no":1}`, `{"order_id":1,"line_no":1}`, orderRef),
		row("lines", 3, `{"order_id":2,"line_no":2}`, `{"order_id":"2","line_no":2}`, orderRef), // numeric text
		row("orders", 0, `{"id":1}`, `{"id":1}`),
		row("orders", 7, `{"id":2}`, `{"id":2}`),
	}
	g := newGroup("main:1:0/10", rows)
	// Sorted by seq: 0 orders1, 1 line1, 2 line2, 3 line(2,2), 4 note2, 5 note1, 6 note3, 7 orders2.
	require.Equal(t, []int{1, 2}, g.children[0])
	require.Equal(t, []int{3}, g.children[7])
	require.Equal(t, []int{5}, g.children[2], "composite foreign key (1,2)")
	require.Empty(t, g.children[1])
	require.Equal(t, 2, g.unrelated([]int{0, 7}), "note 2 (NULL line) and note 3 (line (2,1) absent) belong to no order")

	doc, err := g.document(0, 2)
	require.NoError(t, err)
	require.JSONEq(t, `{
		"root": {"table": "public.orders", "key": {"id": 1}, "row": {"id": 1}},
		"children": {"public.lines": [
			{"table": "public.lines", "key": {"order_id": 1, "line_no": 1}, "row": {"order_id": 1, "line_no": 1}, "children": {}},
			{"table": "public.lines", "key": {"order_id": 1, "line_no": 2}, "row": {"order_id": 1, "line_no": 2}, "children": {
				"public.notes": [{"table": "public.notes", "key": {"id": 1}, "row": {"id": 1, "o": 1, "n": 2}, "children": {}}]}}]},
		"meta": {"correlation_id": "main:1:0/10", "archived_at": "1970-01-01T00:00:05Z", "commit_time": "0001-01-01T00:00:00Z",
			"entity_count": 4, "unrelated_count": 2, "transaction_rows": 8}}`, string(doc))
	require.Len(t, g.fingerprint(), 64)
	require.Equal(t, map[string]int{"public.orders": 2, "public.lines": 3, "public.notes": 3}, g.counts())
}

func TestMissingAndDelay(t *testing.T) {
	t.Parallel()
	require.Equal(t, "", missing(map[string]int{"public.a": 2}, map[string]int{"public.a": 3}))
	got := missing(map[string]int{"public.a": 2, "public.b\nx": 1, "public.c": 0}, map[string]int{"public.a": 1})
	require.Equal(t, "public.a has 1 of 2 rows; public.b x has 0 of 1 rows", got, "control characters are blanked")
	c := Config{RetryDelay: time.Second, MaxRetryDelay: 5 * time.Second}
	// RetryDelay doubling per attempt, ±20% jitter, capped at MaxRetryDelay.
	base := []time.Duration{time.Second, 2 * time.Second, 4 * time.Second, 5 * time.Second, 5 * time.Second}
	seen := map[time.Duration]bool{}
	for run := 0; run < 50; run++ {
		for i, b := range base {
			d := c.delay(i + 1)
			require.GreaterOrEqual(t, d, b*8/10, "attempt %d", i+1)
			require.LessOrEqual(t, d, min(b*12/10, c.MaxRetryDelay), "attempt %d", i+1)
			seen[d] = true
		}
	}
	require.Greater(t, len(seen), 5, "the delays are jittered")
}

// The meta object and the fingerprint are written without encoding/json
// and fmt: byte for byte what those wrote (stored fingerprints are compared
// across versions).
func TestMetaAndFingerprintAsBefore(t *testing.T) {
	for _, m := range []Meta{
		{},
		{CorrelationID: `main:7431:0/1A2B3C8`, ArchivedAt: time.Date(2026, 12, 1, 9, 0, 1, 123456000, time.UTC),
			CommitTime: time.Date(2026, 12, 1, 9, 0, 0, 0, time.UTC), EntityCount: 7, UnrelatedCount: 2, TransactionRows: 700},
		{CorrelationID: "ü\"<&>\\\n", ArchivedAt: time.Date(1, 1, 1, 0, 0, 0, 1, time.UTC), CommitTime: time.Unix(0, 999).UTC(), EntityCount: -1},
		{ArchivedAt: time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC)},
	} {
		want, werr := json.Marshal(m)
		got, err := m.appendJSON(nil)
		if werr != nil {
			require.Error(t, err)
			continue
		}
		require.NoError(t, err)
		require.Equal(t, string(want), string(got))
	}
	rows := []*archiveRow{{CommitLSN: 0x3C000000, Seq: 2}, {CommitLSN: 0x3C000000, Seq: 10}, {CommitLSN: 0x1, Seq: 0}}
	h := sha256.New()
	for _, r := range []*archiveRow{rows[2], rows[0], rows[1]} {
		fmt.Fprintf(h, "%s/%d\n", r.CommitLSN, r.Seq)
	}
	require.Equal(t, hex.EncodeToString(h.Sum(nil)), (&group{rows: rows}).fingerprint())
}

// keyIdentity makes two keys equal exactly when canonicalJSON does (the
// in-page jobs are one per distinct key, like the batch's DISTINCT ON over
// jsonb), and refuses what it refuses.
func TestKeyIdentityAgreesWithCanonicalJSON(t *testing.T) {
	keys := []string{
		`{"id":1}`, `{"id": 1}`, ` {"id":1} `, `{"id":1.0}`, `{"id":"1"}`, `{"id":2}`, `{"id":1e0}`,
		`{"a":1,"b":"x"}`, `{"b":"x","a":1}`, `{"a":1,"b":"x","c":null}`, `{"a":1,"b":"\u0078"}`,
		`{"a":true}`, `{"a":"true"}`, `{"a":false}`, `{"a":null}`, `{"a":"null"}`, `{"a":"n"}`,
		`{"ab":1}`, `{"a":"b1"}`, `{"a":1,"a":2}`, `{"a":2}`, `{"a":2,"a":1}`, `{}`, `{ }`,
		`{"a":{"x":1,"y":2}}`, `{"a":{"y":2,"x":1}}`, `{"a":[1,2]}`, `{"a":[2,1]}`,
		`1`, `"x"`, `[1]`, `null`, ``, `{`, `{"id":}`, `{"é":"ü"}`, `{"\u00e9":"\u00fc"}`,
	}
	for _, k := range keys {
		want, wantOK := canonicalJSON(json.RawMessage(k))
		got, gotOK := keyIdentity(json.RawMessage(k))
		require.Equal(t, wantOK, gotOK, "key %q", k)
		if !wantOK {
			continue
		}
		for _, other := range keys {
			w, wok := canonicalJSON(json.RawMessage(other))
			g, gok := keyIdentity(json.RawMessage(other))
			if !wok || !gok {
				continue
			}
			require.Equal(t, want == w, got == g, "keys %q and %q", k, other)
		}
	}
}
