package projection_test

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/projection"
	"github.com/epitaph-dev/epitaph/quarantine"
)

// publishHoldScenario publishes, to one partition:
//
//	seq 1-2  A: notes {"id":1} with a row jsonb rejects (\u0000), commit
//	seq 3-5  B: notes {"id":1} valid; C: notes {"id":2} valid, commit
//	seq 6-7  E: notes {"id":3} in "v":2 (not decodable by this build), commit
//	seq 8-9  F: notes {"id":3} valid, commit
//
// All in the projector's first page: B and F wait behind an event of the
// same page. The caller publishes D (see publishD) after that page.
func publishHoldScenario(t *testing.T, e *env) {
	t.Helper()
	ctx := context.Background()
	pub := func(msgs []*nats.Msg) {
		for _, m := range msgs {
			_, err := e.pubMsg(ctx, m)
			require.NoError(t, err)
		}
	}
	e.publish(e.nextTx(row{schema: "public", table: "notes", key: `{"id":1}`, image: `{"id":1,"text":"A nul \u0000 here"}`}))
	e.publish(e.nextTx(
		row{schema: "public", table: "notes", key: `{"id":1}`, image: `{"id":1,"text":"B"}`},
		row{schema: "public", table: "notes", key: `{"id":2}`, image: `{"id":2,"text":"C"}`},
	))
	msgs := e.messages(e.nextTx(row{schema: "public", table: "notes", key: `{"id": 3}`, image: `{"id":3,"text":"E"}`}))
	msgs[0].Data = bytes.Replace(msgs[0].Data, []byte(`"v":1`), []byte(`"v":2`), 1)
	pub(msgs)
	e.publish(e.nextTx(row{schema: "public", table: "notes", key: `{"id":3}`, image: `{"id":3,"text":"F"}`}))
}

// publishD publishes seq 10-11, D: notes {"id":1} valid, commit: with hold
// mode it waits behind the open entries of its row in the database.
func publishD(e *env) {
	e.publish(e.nextTx(row{schema: "public", table: "notes", key: `{"id":1}`, image: `{"id":1,"text":"D"}`}))
}

type qentry struct {
	id       int64
	seq      int64
	category string
	status   string
}

func entries(t *testing.T, c *pgx.Conn) []qentry {
	t.Helper()
	rows, err := c.Query(context.Background(), `SELECT id, stream_seq, category, status FROM epitaph.quarantine ORDER BY stream_seq`)
	require.NoError(t, err)
	var out []qentry
	for rows.Next() {
		var q qentry
		require.NoError(t, rows.Scan(&q.id, &q.seq, &q.category, &q.status))
		out = append(out, q)
	}
	require.NoError(t, rows.Err())
	return out
}

func noteTexts(t *testing.T, c *pgx.Conn) []string {
	t.Helper()
	rows, err := c.Query(context.Background(), `SELECT row->>'text' FROM archive.rows WHERE table_name = 'notes' ORDER BY archived_at, commit_lsn, seq`)
	require.NoError(t, err)
	texts, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return texts
}

// Hold mode: the events of a source row behind a quarantined one (in the
// same page, or later in the database) are quarantined as held, other rows
// are archived; replay releases the held ones in stream order once the
// entry in front is resolved (replayed with fixed code, or discarded).
func TestHoldOnQuarantine(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	ctx := context.Background()
	publishHoldScenario(t, e)
	cfg := e.config("w1")
	cfg.HoldOnQuarantine = true
	s := e.start(cfg)
	c := e.conn()
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == 9 })
	publishD(e)
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == 11 })

	got := entries(t, c)
	require.Len(t, got, 5)
	var seqs []int64
	var cats []string
	for _, q := range got {
		seqs, cats = append(seqs, q.seq), append(cats, q.category)
		require.Equal(t, "open", q.status)
	}
	require.Equal(t, []int64{1, 3, 6, 8, 10}, seqs)
	require.Equal(t, []string{"incompatible", "held", "unknown_version", "held", "held"}, cats)
	require.Equal(t, []string{"C"}, noteTexts(t, c), "only the row of another key is archived")
	// The counter is added to after the page commits: it follows the rows.
	eventually(t, 20*time.Second, func() bool { return metricSum(t, s, "epitaph_projector_quarantined_events_total") == 5 })
	var heldErr string
	require.NoError(t, c.QueryRow(ctx, `SELECT error FROM epitaph.quarantine WHERE stream_seq = 3`).Scan(&heldErr))
	require.Contains(t, heldErr, "hold mode")

	pool, err := pgxpool.New(ctx, e.url)
	require.NoError(t, err)
	defer pool.Close()
	// The fixed code: a NUL in a text is dropped.
	base := projection.ReplayFunc(projection.ReplayConfig{})
	fixed := func(ctx context.Context, tx pgx.Tx, q quarantine.Entry) error {
		q.Data = bytes.ReplaceAll(q.Data, []byte(`\u0000`), nil)
		return base(ctx, tx, q)
	}
	a, b, eID, f, d := got[0].id, got[1].id, got[2].id, got[3].id, got[4].id

	// B cannot be released while A is open.
	res, err := quarantine.Replay(ctx, pool, quarantine.Selection{ID: b}, fixed)
	require.NoError(t, err)
	require.Equal(t, []int64{b}, res.Held)
	require.Empty(t, res.Replayed)

	// E is discarded (its wire version will never be known): F may follow.
	require.NoError(t, quarantine.Discard(ctx, pool, eID, "test: v2 publisher was a mistake"))
	res, err = quarantine.Replay(ctx, pool, quarantine.Selection{Filter: quarantine.Filter{Projection: "archive"}}, fixed)
	require.NoError(t, err)
	require.Equal(t, []int64{a, b, f, d}, res.Replayed, "released in stream order")
	require.Empty(t, res.Failed)
	require.Empty(t, res.Held)

	// Each replay is its own transaction: archived_at shows the order.
	require.Equal(t, []string{"C", "A nul  here", "B", "F", "D"}, noteTexts(t, c))
	require.Equal(t, 0, count(t, c, `SELECT count(*) FROM epitaph.quarantine WHERE status = 'open'`))
	res, err = quarantine.Replay(ctx, pool, quarantine.Selection{Filter: quarantine.Filter{Projection: "archive"}}, fixed)
	require.NoError(t, err)
	require.Empty(t, res.Replayed, "exactly once")
	require.Equal(t, 5, count(t, c, `SELECT count(*) FROM archive.rows`))
}

// Hold mode off (the default): only the bad events are quarantined; the
// later events of their rows are archived at once.
func TestHoldOffQuarantineOnlyTheBadEvents(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	publishHoldScenario(t, e)
	e.start(e.config("w1"))
	c := e.conn()
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == 9 })
	publishD(e)
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == 11 })

	got := entries(t, c)
	require.Len(t, got, 2)
	require.Equal(t, int64(1), got[0].seq)
	require.Equal(t, "incompatible", got[0].category)
	require.Equal(t, int64(6), got[1].seq)
	require.Equal(t, "unknown_version", got[1].category)
	require.ElementsMatch(t, []string{"B", "C", "F", "D"}, noteTexts(t, c))
}

// A large row whose object is above Config.MaxRowBytes is quarantined as
// oversized without being fetched (its bucket does not even exist); a large
// row within the limit is archived and the partition moves on.
func TestOversizedRowIsQuarantined(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	ctx := context.Background()
	obs, err := e.js.CreateObjectStore(ctx, jetstream.ObjectStoreConfig{Bucket: event.RowBucket("main")})
	require.NoError(t, err)
	small := []byte(`{"id":2,"blob":"fits"}`)
	smallRef := storeRow(t, obs, "small-2", small)

	tx := e.nextTx(
		row{schema: "public", table: "blobs", key: `{"id":1}`, image: `{"id":1}`},
		row{schema: "public", table: "blobs", key: `{"id":2}`, image: `{"id":2}`},
	)
	msgs := e.messages(tx)
	refRow(t, msgs[0], &event.ObjectRef{Bucket: "no_such_bucket", Name: "huge-1", Size: 4096})
	refRow(t, msgs[1], smallRef)
	for _, m := range msgs {
		_, err := e.pubMsg(ctx, m)
		require.NoError(t, err)
	}
	e.publish(e.nextTx(orderRows(1, 1)...))

	cfg := e.config("w1")
	cfg.MaxRowBytes = 1024
	s := e.start(cfg)
	c := e.conn()
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == 6 })

	got := entries(t, c)
	require.Len(t, got, 1)
	require.Equal(t, int64(1), got[0].seq)
	require.Equal(t, "oversized", got[0].category)
	var msg string
	require.NoError(t, c.QueryRow(ctx, `SELECT error FROM epitaph.quarantine`).Scan(&msg))
	require.Contains(t, msg, "4096 bytes")
	var image string
	require.NoError(t, c.QueryRow(ctx, `SELECT row::text FROM archive.rows WHERE table_name = 'blobs'`).Scan(&image))
	require.JSONEq(t, string(small), image)
	require.Equal(t, 3, count(t, c, `SELECT count(*) FROM archive.rows`))
	eventually(t, 10*time.Second, func() bool {
		return metricSum(t, s, "epitaph_projector_quarantined_events_total") == 1
	})
}
