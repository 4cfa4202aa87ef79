package event_test

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
)

func TestEscapeToken(t *testing.T) {
	t.Parallel()
	cases := []struct{ in, want string }{
		{"orders", "orders"},
		{"order.lines", "order%2Elines"},
		{"a*b>c", "a%2Ab%3Ec"},
		{"with space", "with%20space"},
		{"tab\there", "tab%09here"},
		{"50%", "50%25"},
		{"Ünïcode", "%C3%9Cn%C3%AFcode"},
		{"CamelCase_1-x", "CamelCase_1-x"},
	}
	for _, c := range cases {
		got := event.EscapeToken(c.in)
		require.Equal(t, c.want, got, c.in)
		require.NotContains(t, got, ".")
		require.NotContains(t, got, " ")
		back, err := event.UnescapeToken(got)
		require.NoError(t, err)
		require.Equal(t, c.in, back)
	}
	_, err := event.UnescapeToken("bad%2")
	require.Error(t, err)
	_, err = event.UnescapeToken("bad%ZZ")
	require.Error(t, err)
}

func TestSubjects(t *testing.T) {
	t.Parallel()
	require.Equal(t, "epitaph.main.3.delete.public.order%2Elines", event.DeleteSubject("main", 3, "public", "order.lines"))
	require.Equal(t, "epitaph.main.0.truncate.s%20x.t", event.TruncateSubject("main", 0, "s x", "t"))
	require.Equal(t, "epitaph.main.7.commit", event.CommitSubject("main", 7))
	require.Equal(t, "epitaph.main.7.mark", event.MarkSubject("main", 7))
	require.Equal(t, "epitaph.main.7.gap", event.GapSubject("main", 7))
	require.Equal(t, "epitaph.main.7.>", event.PartitionFilter("main", 7))
	require.Equal(t, "EPITAPH_SHOP-EU", event.StreamName("shop-eu"))
	p, err := event.PartitionOf(event.DeleteSubject("main", 5, "a", "b"))
	require.NoError(t, err)
	require.Equal(t, 5, p)
	_, err = event.PartitionOf("other.main.1.commit")
	require.Error(t, err)
	require.NoError(t, event.ValidateSourceName("main"))
	require.Error(t, event.ValidateSourceName("has.dot"))
	require.Error(t, event.ValidateSourceName(""))
}

func TestLSN(t *testing.T) {
	t.Parallel()
	cases := []struct {
		text string
		v    event.LSN
	}{
		{"0/0", 0}, {"0/1A2B3C8", 0x1A2B3C8}, {"16/B374D848", 0x16_B374D848}, {"FFFFFFFF/FFFFFFFF", ^event.LSN(0)},
	}
	for _, c := range cases {
		got, err := event.ParseLSN(c.text)
		require.NoError(t, err)
		require.Equal(t, c.v, got)
		require.Equal(t, c.text, c.v.String())
	}
	for _, bad := range []string{"", "12", "x/1", "1/", "100000000/0"} {
		_, err := event.ParseLSN(bad)
		require.Error(t, err, bad)
	}
}

func TestPartitionIsStableAndSpread(t *testing.T) {
	t.Parallel()
	counts := make([]int, 8)
	for i := 0; i < 8000; i++ {
		lsn := event.LSN(0x1000000 + i*0x58)
		p := event.Partition(lsn, 8)
		require.Equal(t, p, event.Partition(lsn, 8))
		counts[p]++
	}
	for p, n := range counts {
		require.Greater(t, n, 700, "partition %d gets too few transactions: %v", p, counts)
	}
	require.Equal(t, 0, event.Partition(12345, 1))
	// Fixed value (FNV-1a of 00 00 00 00 01 A2 B3 C8, computed independently):
	// other implementations must agree on the hash.
	require.Equal(t, 1, event.Partition(0x1A2B3C8, 8))
}

func TestRoundTrip(t *testing.T) {
	t.Parallel()
	ct := time.Date(2026, 11, 30, 9, 0, 0, 123456000, time.UTC)
	in := &event.Event{
		Op: event.OpDelete, Source: "main", Schema: "public", Table: "orders", XID: 7431,
		CommitLSN: 0x1A2B3C8, CommitTime: ct, Seq: 0, Identity: event.IdentityFull,
		Columns: []event.Column{{Name: "id", Type: "bigint", PK: true}, {Name: "total", Type: "numeric"}},
		Key:     json.RawMessage(`{"id":42}`), Row: json.RawMessage(`{"id":42,"total":"12.50"}`),
		Refs: []event.Ref{{Columns: []string{"customer_id"}, Schema: "public", Table: "customers", RefColumns: []string{"id"}}},
	}
	b, err := event.Encode(in)
	require.NoError(t, err)
	require.Contains(t, string(b), `"v":1`)
	require.Contains(t, string(b), `"commit_lsn":"0/1A2B3C8"`)
	require.Contains(t, string(b), `"commit_time":"2026-11-30T09:00:00.123456Z"`)
	out, err := event.Decode(b)
	require.NoError(t, err)
	require.Equal(t, in, out)
	require.Equal(t, "main:7431:0/1A2B3C8", out.CorrelationID())
	require.Equal(t, "main/0/1A2B3C8/0", event.MsgID("main", out.CommitLSN, out.Seq))
}

func TestDecodeClassifies(t *testing.T) {
	t.Parallel()
	valid := `{"v":1,"op":"delete","source":"main","schema":"public","table":"t","commit_lsn":"0/10","seq":0,"identity":"full","row":{"id":1}}`
	cases := []struct {
		name string
		in   string
		cat  event.Category
	}{
		{"garbage", "not json at all", event.CategoryMalformed},
		{"array", `[1,2]`, event.CategoryMalformed},
		{"truncated", valid[:40], event.CategoryMalformed},
		{"empty", ``, event.CategoryMalformed},
		{"no version", `{"op":"commit"}`, event.CategoryInvalid},
		{"string version", `{"v":"1"}`, event.CategoryInvalid},
		{"future version", strings.Replace(valid, `"v":1`, `"v":2`, 1), event.CategoryUnknownVersion},
		{"bad lsn", strings.Replace(valid, `"0/10"`, `"nope"`, 1), event.CategoryInvalid},
		{"xid type", strings.Replace(valid, `"seq":0`, `"seq":0,"xid":"abc"`, 1), event.CategoryInvalid},
		{"row not object", strings.Replace(valid, `{"id":1}`, `[1]`, 1), event.CategoryInvalid},
		{"unknown op", strings.Replace(valid, `"delete"`, `"update"`, 1), event.CategoryInvalid},
		{"seq beyond int32", strings.Replace(valid, `"seq":0`, `"seq":4294967296`, 1), event.CategoryInvalid},
		{"negative seq", strings.Replace(valid, `"seq":0`, `"seq":-1`, 1), event.CategoryInvalid},
		{"bad identity", strings.Replace(valid, `"full"`, `"most"`, 1), event.CategoryInvalid},
		{"commit sums", `{"v":1,"op":"commit","source":"m","commit_lsn":"0/1","rows":3,"tables":{"a.b":1}}`, event.CategoryInvalid},
	}
	for _, c := range cases {
		_, err := event.Decode([]byte(c.in))
		require.Error(t, err, c.name)
		cat, ok := event.CategoryOf(err)
		require.True(t, ok, c.name)
		require.Equal(t, c.cat, cat, c.name)
	}
	e, err := event.Decode([]byte(valid))
	require.NoError(t, err)
	require.Equal(t, "public.t", e.QualifiedTable())
}

func TestGapEvents(t *testing.T) {
	t.Parallel()
	// A gap from a capture that predates kinds: lost upstream, every table.
	old := `{"v":1,"op":"gap","source":"main","seq":0,"partition":1,"from_lsn":"0/60","to_lsn":"0/9000","reason":"slot invalidated"}`
	e, err := event.Decode([]byte(old))
	require.NoError(t, err)
	require.Equal(t, event.GapLostUpstream, e.GapKind())
	require.Empty(t, e.Schema)
	require.Empty(t, e.Table)

	// A gap for one table (it lost its replica identity) round-trips.
	in := &event.Event{Op: event.OpGap, Source: "main", Kind: event.GapLostUpstream, Schema: "public", Table: "order.lines",
		Partition: 3, FromLSN: 0x60, ToLSN: 0x9000, LSN: 0x9000, Reason: "replica identity lost"}
	b, err := event.Encode(in)
	require.NoError(t, err)
	require.Contains(t, string(b), `"kind":"lost_upstream"`)
	require.Contains(t, string(b), `"schema":"public","table":"order.lines"`)
	out, err := event.Decode(b)
	require.NoError(t, err)
	require.Equal(t, in, out)
	_, fast := event.DecodeFast(b)
	require.True(t, fast, "the fast path takes a table gap")

	bad := map[string]string{
		"to before from":      strings.Replace(old, `"0/9000"`, `"0/50"`, 1),
		"removal from stream": strings.Replace(old, `"seq":0`, `"seq":0,"kind":"removed_from_stream"`, 1),
		"truncate kind":       strings.Replace(old, `"seq":0`, `"seq":0,"kind":"truncate"`, 1),
		"unknown kind":        strings.Replace(old, `"seq":0`, `"seq":0,"kind":"mystery"`, 1),
		"schema alone":        strings.Replace(old, `"seq":0`, `"seq":0,"schema":"public"`, 1),
		"table alone":         strings.Replace(old, `"seq":0`, `"seq":0,"table":"t"`, 1),
	}
	for name, body := range bad {
		_, err := event.Decode([]byte(body))
		cat, ok := event.CategoryOf(err)
		require.True(t, ok, "%s: %v", name, err)
		require.Equal(t, event.CategoryInvalid, cat, name)
	}

	require.Equal(t, "main/gap/0/60-0/9000/3", event.GapMsgID("main", 0x60, 0x9000, 3))
	require.Equal(t, "main/gap/public.order%2Elines/0/60-0/9000/3", event.TableGapMsgID("main", "public", "order.lines", 0x60, 0x9000, 3))
	require.NotEqual(t, event.TableGapMsgID("main", "a", "b.c", 1, 2, 0), event.TableGapMsgID("main", "a.b", "c", 1, 2, 0))
}

func TestDecodeErrorsCarryNoRowValues(t *testing.T) {
	t.Parallel()
	secret := "s3cr3t-value"
	in := `{"v":1,"op":"delete","source":"main","schema":"public","table":"t","commit_lsn":"0/10","seq":"` + secret + `","identity":"full","row":{}}`
	_, err := event.Decode([]byte(in))
	require.Error(t, err)
	require.NotContains(t, err.Error(), secret)
}

func TestUpgraderTeachesNewVersion(t *testing.T) {
	t.Parallel()
	v2 := []byte(`{"v":2,"op":"commit","source":"main","commit_lsn":"0/20","rows":0}`)
	_, err := event.Decode(v2)
	cat, _ := event.CategoryOf(err)
	require.Equal(t, event.CategoryUnknownVersion, cat)
	d := &event.Decoder{Upgraders: map[int]func([]byte) ([]byte, error){
		2: func(b []byte) ([]byte, error) { return []byte(strings.Replace(string(b), `"v":2`, `"v":1`, 1)), nil },
	}}
	e, err := d.Decode(v2)
	require.NoError(t, err)
	require.Equal(t, event.OpCommit, e.Op)
}

func BenchmarkDecodeDelete(b *testing.B) {
	in := &event.Event{
		Op: event.OpDelete, Source: "main", Schema: "public", Table: "order_lines", XID: 7431,
		CommitLSN: 0x1A2B3C8, CommitTime: time.Now().UTC(), Seq: 3, Identity: event.IdentityFull,
		Columns: []event.Column{{Name: "id", Type: "bigint", PK: true}, {Name: "order_id", Type: "bigint"},
			{Name: "sku", Type: "text"}, {Name: "qty", Type: "integer"}, {Name: "unit_price", Type: "numeric(12,2)"},
			{Name: "weight", Type: "double precision"}, {Name: "gen", Type: "integer"}},
		Key:  json.RawMessage(`{"id":42}`),
		Row:  json.RawMessage(`{"id":42,"order_id":7,"sku":"SKU-42","qty":3,"unit_price":"10.50","weight":1.25,"gen":0}`),
		Refs: []event.Ref{{Columns: []string{"order_id"}, Schema: "public", Table: "orders", RefColumns: []string{"id"}}},
	}
	data, err := event.Encode(in)
	require.NoError(b, err)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := event.Decode(data); err != nil {
			b.Fatal(err)
		}
	}
}

// TestGeneratedColumn: a generated column is marked in the event's columns
// and survives decode and re-encode, on both decode paths; an event without
// the flag decodes as before.
func TestGeneratedColumn(t *testing.T) {
	t.Parallel()
	body := []byte(`{"v":1,"op":"delete","source":"main","schema":"public","table":"items","xid":7,"commit_lsn":"0/1A","commit_time":"2026-11-30T09:00:00Z","seq":0,"identity":"full",` +
		`"columns":[{"name":"id","type":"integer","pk":true},{"name":"price","type":"numeric"},{"name":"total","type":"numeric","generated":true}],` +
		`"key":{"id":1},"row":{"id":1,"price":"2.50"}}`)
	e, err := event.Decode(body)
	require.NoError(t, err)
	require.Equal(t, []event.Column{{Name: "id", Type: "integer", PK: true}, {Name: "price", Type: "numeric"}, {Name: "total", Type: "numeric", Generated: true}}, e.Columns)
	slow, err := event.DecodeSlow(body)
	require.NoError(t, err)
	require.Equal(t, e.Columns, slow.Columns)
	enc, err := event.Encode(e)
	require.NoError(t, err)
	require.Contains(t, string(enc), `{"name":"total","type":"numeric","generated":true}`)
	require.Contains(t, string(enc), `{"name":"price","type":"numeric"}`, "the flag is omitted when false")

	plain, err := event.Decode([]byte(strings.Replace(string(body), `,"generated":true`, ``, 1)))
	require.NoError(t, err)
	require.False(t, plain.Columns[2].Generated)
}
