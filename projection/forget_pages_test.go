package projection_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/projection"
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
	rc, err := projection.Erase(ctx, pool, projection.EraseOptions{Table: "public.customers",
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

	rc, err = projection.Erase(ctx, pool, projection.EraseOptions{Table: "public.customers", Key: json.RawMessage(key44), Actor: "dpo"})
	require.NoError(t, err)
	require.Equal(t, 1, rc.Removed["epitaph.quarantine"])
	require.Equal(t, map[string]int{"epitaph.quarantine": 4}, rc.Unchecked)
	require.Equal(t, []string{"3", "4", "5", "7"},
		keysOf(t, c, `SELECT stream_seq::text FROM epitaph.quarantine WHERE length(data) > 0 ORDER BY 1`))
	list, err := projection.ListErasures(ctx, pool)
	require.NoError(t, err)
	require.Len(t, list, 2)
	require.Equal(t, map[string]int{"epitaph.quarantine": 5}, list[0].Unchecked)
}
