package projection_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/erasure"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// Quarantine entries whose message cannot be decoded are matched by what
// can be read of them: the raw bytes (table and selected values), the
// source key, the message id of an erased child; the rest are counted on
// the receipt as unchecked, never silently passed over.
func TestEraseUndecodableQuarantine(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	e.start(retentionConfig(e, "w1"))
	ann := customerTx(e, 42, "ann@example.com", 1)
	e.publish(ann)
	c := e.conn()
	ctx := context.Background()
	eventually(t, 30*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 4 })

	quarantine := func(seq int, data string, headers map[string][]string, srcKey *string) {
		t.Helper()
		h, err := json.Marshal(headers)
		require.NoError(t, err)
		var table *string
		if srcKey != nil {
			s := "customers"
			table = &s
		}
		_, err = c.Exec(ctx, `INSERT INTO epitaph.quarantine (projection, version, partition, stream_seq, subject, headers, data, category, error,
			source_schema, source_table, source_key) VALUES ('archive', 1, 0, $1, 'x', $2, $3, 'malformed', 'x', 'public', $4, $5::jsonb)`,
			seq, string(h), []byte(data), table, srcKey)
		require.NoError(t, err)
	}
	key44 := `{"id":44}`
	// Matched: Ann's row cut short (raw bytes), spaced differently.
	quarantine(1, `{"op":"delete","schema":"public","table":"customers","key":{"id":42},"row":{"id":42, "email" : "ann@example.com"`, nil, nil)
	// Matched: an erased child's message (its id), its body unreadable.
	orderID := event.MsgID(src, ann.lsn, 1) + "/t0123456789abcdef"
	quarantine(2, "\x1f\x8b\x08garbage", map[string][]string{event.HeaderMsgID: {orderID}}, nil)
	// Unchecked: another customer cut short; a longer address; bytes that
	// are no JSON at all.
	quarantine(3, `{"op":"delete","table":"customers","row":{"id":43,"email":"bob@example.com"`, nil, nil)
	quarantine(4, `{"op":"delete","table":"customers","row":{"id":45,"email":"ann@example.com.au"`, nil, nil)
	quarantine(5, "\x00\x01\x02", nil, nil)
	// For the erasure by key: matched by its source key; not matched by a
	// longer number.
	quarantine(6, "\xff\xfe", nil, &key44)
	quarantine(7, `{"op":"delete","table":"customers","key":{"id":440}`, nil, nil)

	pool := newPool(t, e.url)
	rc, err := erasure.Erase(ctx, pool, erasure.EraseOptions{Table: "public.customers",
		Match: json.RawMessage(`{"email":"ann@example.com"}`), WithChildren: true, Actor: "dpo"})
	require.NoError(t, err)
	require.Equal(t, 4, rc.Removed["archive_v1.rows"])
	require.Equal(t, 2, rc.Removed["epitaph.quarantine"])
	require.Equal(t, map[string]int{"epitaph.quarantine": 5}, rc.Unchecked, "3, 4, 5, 6 and 7 could not be ruled out")
	require.Equal(t, []string{"3", "4", "5", "6", "7"},
		keysOf(t, c, `SELECT stream_seq::text FROM epitaph.quarantine WHERE length(data) > 0 ORDER BY 1`))
	require.Equal(t, 2, count(t, c, `SELECT count(*) FROM epitaph.quarantine WHERE length(data) = 0 AND headers = '{}'
		AND status = 'discarded' AND resolution_reason = 'erased'`))
	require.Equal(t, 0, count(t, c, `SELECT count(*) FROM epitaph.quarantine WHERE position(convert_to('"ann@example.com"', 'UTF8') IN data) > 0`))
	require.Equal(t, 0, count(t, c, `SELECT count(*) FROM archive_v1.rows WHERE strpos(row::text, 'ann@example.com') > 0`))

	rc, err = erasure.Erase(ctx, pool, erasure.EraseOptions{Table: "public.customers", Key: json.RawMessage(key44), Actor: "dpo"})
	require.NoError(t, err)
	require.Equal(t, 1, rc.Removed["epitaph.quarantine"])
	require.Equal(t, map[string]int{"epitaph.quarantine": 4}, rc.Unchecked)
	require.Equal(t, []string{"3", "4", "5", "7"},
		keysOf(t, c, `SELECT stream_seq::text FROM epitaph.quarantine WHERE length(data) > 0 ORDER BY 1`))
	list, err := erasure.ListErasures(ctx, pool)
	require.NoError(t, err)
	require.Len(t, list, 2)
	require.Equal(t, map[string]int{"epitaph.quarantine": 5}, list[0].Unchecked)
}

// A fence with children holds for the whole source transaction: with pages
// of two messages, an erased customer's orders and lines in later pages than
// hers (and, the reverse, in earlier pages) are in no version, also after a
// rebuild; another customer's transaction of the same shape is archived
// whole.
func TestEraseWithChildrenAcrossPages(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	cfg := retentionConfig(e, "w1")
	cfg.BatchSize = 2
	s := e.start(cfg)
	c := e.conn()
	ctx := context.Background()
	pool := newPool(t, e.url)
	// The fence first: nothing archived yet, every row of Ann's comes later.
	rc, err := erasure.Erase(ctx, pool, erasure.EraseOptions{Table: "public.customers",
		Match: json.RawMessage(`{"email":"ann@example.com"}`), WithChildren: true, Actor: "dpo"})
	require.NoError(t, err)
	require.Empty(t, rc.Removed)

	forward := customerTx(e, 42, "ann@example.com", 1, 2) // customer, order 1, its lines, order 2, its lines
	reverse := customerTx(e, 42, "ann@example.com", 3, 4)
	for i, j := 0, len(reverse.rows)-1; i < j; i, j = i+1, j-1 {
		reverse.rows[i], reverse.rows[j] = reverse.rows[j], reverse.rows[i] // lines and orders first, the customer last
	}
	bob := customerTx(e, 43, "bob@example.com", 5, 6)
	for _, tx := range []*txn{forward, reverse, bob} {
		require.GreaterOrEqual(t, len(tx.rows)+1, 3*cfg.BatchSize, "spans at least three pages")
		e.publish(tx)
	}
	marker := e.nextTx(row{schema: "public", table: "markers", key: `{"id":1}`, image: `{}`})
	e.publish(marker)
	bobs := []string{"customers:43", "order_lines:5000", "order_lines:5001", "order_lines:6000", "order_lines:6001", "orders:5", "orders:6"}
	archived := func(schema string) func() bool {
		return func() bool {
			return count(t, c, `SELECT count(*) FROM `+schema+`.rows WHERE table_name = 'markers' AND verified`) == 1
		}
	}
	eventually(t, 30*time.Second, archived("archive_v1"))
	check := func(schema string) {
		t.Helper()
		require.Equal(t, bobs, keysOf(t, c, `SELECT table_name || ':' || (key->>'id') FROM `+schema+`.rows
			WHERE table_name <> 'markers' ORDER BY 1`), schema)
		require.Equal(t, 0, count(t, c, `SELECT count(*) FROM `+schema+`.rows WHERE commit_lsn IN ($1::pg_lsn, $2::pg_lsn)`,
			forward.lsn.String(), reverse.lsn.String()), schema)
	}
	check("archive_v1")
	require.Equal(t, 0, count(t, c, `SELECT count(*) FROM archive.rows WHERE row::text LIKE '%ann@example.com%'`))

	// A rebuild applies the same pages: the same rows, none of Ann's.
	v2, err := version.CreateVersion(ctx, s.Pool(), e.js, version.RebuildOptions{Projection: archive.Projection})
	require.NoError(t, err)
	eventually(t, 60*time.Second, archived(v2.Schema))
	check(v2.Schema)
	requireNowhere(t, c, "ann@example.com")
}

// An erase that runs between the pages of a transaction (its customer
// archived, not yet visible; her orders still to come) erases the orders of
// the later pages too.
func TestEraseBetweenPages(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	cfg := retentionConfig(e, "w1")
	cfg.BatchSize = 2
	e.start(cfg)
	c := e.conn()
	ctx := context.Background()
	ann := customerTx(e, 42, "ann@example.com", 1, 2)
	msgs := e.messages(ann)
	for _, m := range msgs[:2] { // the customer and order 1
		_, err := e.pubMsg(ctx, m)
		require.NoError(t, err)
	}
	eventually(t, 30*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive_v1.rows`) == 2 })
	rc, err := erasure.Erase(ctx, newPool(t, e.url), erasure.EraseOptions{Table: "public.customers",
		Match: json.RawMessage(`{"email":"ann@example.com"}`), WithChildren: true, Actor: "dpo"})
	require.NoError(t, err)
	require.Equal(t, 2, rc.Removed["archive_v1.rows"])
	for _, m := range msgs[2:] {
		_, err := e.pubMsg(ctx, m)
		require.NoError(t, err)
	}
	e.publish(e.nextTx(row{schema: "public", table: "markers", key: `{"id":1}`, image: `{}`}))
	eventually(t, 30*time.Second, func() bool {
		return count(t, c, `SELECT count(*) FROM archive.rows WHERE table_name = 'markers'`) == 1
	})
	require.Equal(t, []string{"markers:1"}, keysOf(t, c, `SELECT table_name || ':' || (key->>'id') FROM archive_v1.rows ORDER BY 1`))
	requireNowhere(t, c, "ann@example.com")
}

// An entry whose body is whole JSON naming the erased table and key, but
// undecodable as an event (here a bad commit_lsn), is scrubbed like a
// decodable one, whatever the spacing or the order of its fields; so is one
// naming the table by schema and name. Only an entry that cannot be read
// as JSON, and that nothing else matches, counts as unchecked.
func TestEraseScrubsQuarantinedJSONNamingTheKey(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	e.start(retentionConfig(e, "w1"))
	c := e.conn()
	ctx := context.Background()
	e.publish(customerTx(e, 87, "eve@example.com"))
	eventually(t, 30*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 1 })

	quarantine := func(seq int, data string) {
		t.Helper()
		_, err := c.Exec(ctx, `INSERT INTO epitaph.quarantine (projection, version, partition, stream_seq, subject, headers, data, category, error)
			VALUES ('archive', 1, 0, $1, 'x', '{}', $2, 'malformed', 'x')`, seq, []byte(data))
		require.NoError(t, err)
	}
	// Matched: customer 88's whole event with a commit_lsn no decoder takes.
	quarantine(1, `{"v":1,"op":"delete","source":"main","schema":"public","table":"customers","xid":9,`+
		`"commit_lsn":"not-an-lsn","commit_time":"2026-11-30T09:00:00Z","seq":0,"identity":"full",`+
		`"columns":[{"name":"id","type":"int8","pk":true},{"name":"email","type":"text"}],`+
		`"key":{"id":88},"row":{"id":88,"email":"carol@example.com"}}`)
	// Matched: fields in another order, the key spaced out, the row first.
	quarantine(2, `{"row":{"email":"carol@example.com","id":88},"key":{ "id" : 88 },"table":"customers","schema":"public","op":"delete","v":"1"}`)
	// Not matched, and readable: another table's row 88, customer 880.
	quarantine(3, `{"v":1,"op":"delete","schema":"public","table":"orders","commit_lsn":"x","key":{"id":88},"row":{"id":88,"customer_id":1}}`)
	quarantine(4, `{"v":1,"op":"delete","schema":"public","table":"customers","commit_lsn":"x","key":{"id":880},"row":{"id":880,"email":"x@example.com"}}`)
	// Not JSON at all: unchecked.
	quarantine(5, "\x00\x01 customers 88")

	pool := newPool(t, e.url)
	rc, err := erasure.Erase(ctx, pool, erasure.EraseOptions{Table: "public.customers",
		Key: json.RawMessage(`{"id":88}`), Actor: "dpo"})
	require.NoError(t, err)
	require.Equal(t, 2, rc.Removed["epitaph.quarantine"])
	require.Equal(t, map[string]int{"epitaph.quarantine": 1}, rc.Unchecked, "only the entry that is no JSON")
	require.Equal(t, []string{"3", "4", "5"},
		keysOf(t, c, `SELECT stream_seq::text FROM epitaph.quarantine WHERE length(data) > 0 ORDER BY 1`))
	require.Equal(t, 0, count(t, c, `SELECT count(*) FROM epitaph.quarantine WHERE position(convert_to('carol@example.com', 'UTF8') IN data) > 0`))
}
