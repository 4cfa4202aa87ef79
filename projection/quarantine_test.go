package projection_test

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/projection"
	"github.com/epitaph-dev/epitaph/quarantine"
)

// Bad events go to quarantine in the same transaction as the cursor
// advance, with their category, and the partition moves on: the good
// events around them (even in the same page and transaction) are applied.
func TestPermanentFailuresAreQuarantined(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	ctx := context.Background()

	// A large row kept in the object store, read back and checked.
	obs, err := e.js.CreateObjectStore(ctx, jetstream.ObjectStoreConfig{Bucket: event.RowBucket("main")})
	require.NoError(t, err)
	big := []byte(`{"id":5,"blob":"large"}`)
	bigRef := storeRow(t, obs, "big-5", big)

	publishRaw := func(subject, id string, data []byte) {
		m := nats.NewMsg(subject)
		m.Data = data
		m.Header.Set(event.HeaderMsgID, id)
		_, err := e.js.PublishMsg(ctx, m)
		require.NoError(t, err)
	}
	good := e.nextTx(orderRows(1, 1)...)
	e.publish(good)
	publishRaw(event.CommitSubject(src, 0), "garbage", []byte("not json at all"))
	publishRaw(event.CommitSubject(src, 0), "v2", []byte(`{"v":2,"op":"commit"}`))

	// One transaction: a valid row, a row jsonb refuses (\u0000), a row
	// whose object is missing, a large row whose object is there.
	tx := e.nextTx(
		row{schema: "public", table: "notes", key: `{"id":1}`, image: `{"id":1,"text":"fine"}`},
		row{schema: "public", table: "notes", key: `{"id":2}`, image: `{"id":2,"text":"nul \u0000 here"}`},
		row{schema: "public", table: "notes", key: `{"id":3}`, image: `{"id":3}`},
		row{schema: "public", table: "notes", key: `{"id":5}`, image: `{"id":5}`},
	)
	msgs := e.messages(tx)
	refRow(t, msgs[2], &event.ObjectRef{Bucket: event.RowBucket("main"), Name: "gone", Size: 10})
	refRow(t, msgs[3], bigRef)
	for _, m := range msgs {
		_, err := e.pubMsg(ctx, m)
		require.NoError(t, err)
	}
	after := e.nextTx(orderRows(2, 1)...)
	e.publish(after)

	s := e.start(e.config("w1"))
	c := e.conn()
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM epitaph.quarantine`) == 4 })
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 2+2+2 })

	rows, err := c.Query(ctx, `SELECT stream_seq, category FROM epitaph.quarantine ORDER BY stream_seq`)
	require.NoError(t, err)
	var cats []string
	var seqs []int64
	for rows.Next() {
		var seq int64
		var cat string
		require.NoError(t, rows.Scan(&seq, &cat))
		seqs = append(seqs, seq)
		cats = append(cats, cat)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, []string{"malformed", "unknown_version", "incompatible", "missing_payload"}, cats)
	require.Equal(t, []int64{4, 5, 7, 8}, seqs)

	var image string
	require.NoError(t, c.QueryRow(ctx, `SELECT row::text FROM archive.rows WHERE table_name = 'notes' AND key = '{"id":5}'`).Scan(&image))
	require.JSONEq(t, string(big), image)
	require.Equal(t, 1, count(t, c, `SELECT count(*) FROM archive.rows WHERE table_name = 'notes' AND key = '{"id":1}'`))
	require.Equal(t, 1, count(t, c, `SELECT count(*) FROM archive.rows WHERE table_name = 'orders' AND key = '{"id":2}'`))
	require.Equal(t, 13, count(t, c, `SELECT cursor FROM epitaph.progress`))
	// The counter is added to after the page commits (and is acknowledged):
	// it follows the rows the test has already seen.
	eventually(t, 20*time.Second, func() bool { return metricSum(t, s, "epitaph_projector_quarantined_events_total") == 4 })

	st, err := s.Status(ctx)
	require.NoError(t, err)
	require.Equal(t, "quarantined", st.Versions[0].Health)
	require.Equal(t, 4, st.Versions[0].QuarantineOpen)
	require.Zero(t, st.Versions[0].LagEvents)
	var ready bool
	require.NoError(t, c.QueryRow(ctx, `SELECT ready FROM archive.status`).Scan(&ready))
	require.False(t, ready, "open quarantine: the archive is not complete")
}

// A row in a wire version this build does not know is quarantined; once
// the decoder is taught the version, replaying it archives it exactly once
// and its transaction's roots are recomputed.
func TestReplayQuarantinedRow(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	ctx := context.Background()
	tx := e.nextTx(orderRows(1, 2)...)
	msgs := e.messages(tx)
	// The order row (seq 0) comes in "v":2.
	msgs[0].Data = bytes.Replace(msgs[0].Data, []byte(`"v":1`), []byte(`"v":2`), 1)
	for _, m := range msgs {
		_, err := e.pubMsg(ctx, m)
		require.NoError(t, err)
	}
	e.start(e.config("w1"))
	c := e.conn()
	eventually(t, 20*time.Second, func() bool {
		return count(t, c, `SELECT count(*) FROM epitaph.quarantine WHERE category = 'unknown_version'`) == 1 &&
			count(t, c, `SELECT count(*) FROM archive.rows WHERE is_root IS NOT NULL`) == 2
	})
	// Without their order, the lines are roots for now.
	require.Equal(t, 2, count(t, c, `SELECT count(*) FROM archive.rows WHERE is_root`))

	pool, err := pgxpool.New(ctx, e.url)
	require.NoError(t, err)
	defer pool.Close()
	apply := projection.ReplayFunc(projection.ReplayConfig{Decoder: &event.Decoder{Upgraders: map[int]func([]byte) ([]byte, error){
		2: func(b []byte) ([]byte, error) { return bytes.Replace(b, []byte(`"v":2`), []byte(`"v":1`), 1), nil },
	}}})
	res, err := quarantine.Replay(ctx, pool, quarantine.Selection{Filter: quarantine.Filter{Projection: "archive"}}, apply)
	require.NoError(t, err)
	require.Len(t, res.Replayed, 1)
	require.Empty(t, res.Failed)
	res, err = quarantine.Replay(ctx, pool, quarantine.Selection{Filter: quarantine.Filter{Projection: "archive"}}, apply)
	require.NoError(t, err)
	require.Empty(t, res.Replayed, "nothing left to replay")

	require.Equal(t, 3, count(t, c, `SELECT count(*) FROM archive.rows`))
	require.Equal(t, 1, count(t, c, `SELECT count(*) FROM archive.rows WHERE is_root`))
	require.Equal(t, 1, count(t, c, `SELECT count(*) FROM archive.rows WHERE is_root AND table_name = 'orders'`))
	require.Equal(t, 0, count(t, c, `SELECT count(*) FROM epitaph.quarantine WHERE status = 'open'`))
}
