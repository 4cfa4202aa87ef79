package projection_test

import (
	"bytes"
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection"
	"github.com/epitaph-dev/epitaph/projection/erasure"
	"github.com/epitaph-dev/epitaph/quarantine"
)

// A replayed event ends exactly as the same event applied live: replay
// goes through the runtime's apply path. Order 1 is applied live; order 2
// is the same transaction with one line in a wire version this build does
// not know, quarantined and then replayed with a decoder taught the
// version: its rows (roots, verification), its snapshot and its row
// handlers' deliveries end as order 1's. Order 3's quarantined line is
// erased before the replay: its entry loses its payload (matched by its
// raw bytes) and the fence keeps the line out of the archive.
func TestReplayEndsAsLive(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	ctx := context.Background()
	pool := newPool(t, e.url)
	require.NoError(t, migrations.Apply(ctx, pool))
	addGoHandler(t, pool, "0b6f5e43-3d0e-4c2b-9a51-6f7f2a8c1e91", "order_lines", "lines", handler.PhaseImmediate)
	addGoHandler(t, pool, "7a1c3f00-0000-4000-8000-000000000002", "orders", "orders", handler.PhaseImmediate)

	live, replayed, fenced := e.nextTx(orderRows(1, 2)...), e.nextTx(orderRows(2, 2)...), e.nextTx(orderRows(3, 2)...)
	e.publish(live)
	for _, tx := range []*txn{replayed, fenced} {
		msgs := e.messages(tx)
		// The second line (seq 2) comes in "v":2.
		msgs[2].Data = bytes.Replace(msgs[2].Data, []byte(`"v":1`), []byte(`"v":2`), 1)
		e.publishAll(msgs)
	}
	cfg := e.config("w1")
	cfg.SnapshotRoots = []string{"public.orders"}
	e.start(cfg)
	c := e.conn()
	eventually(t, 20*time.Second, func() bool {
		return count(t, c, `SELECT count(*) FROM epitaph.quarantine WHERE category = 'unknown_version'`) == 2 &&
			count(t, c, `SELECT count(*) FROM archive.rows WHERE is_root IS NOT NULL`) == 3+2+2 &&
			count(t, c, `SELECT count(*) FROM archive.snapshots WHERE status = 'complete'`) == 1
	})

	// Order 3's line is erased while its event is in quarantine: the entry
	// cannot be decoded (v2) but it is JSON naming the erased key, so it
	// loses its payload and is discarded, not replayed (erasure/quarantine.go).
	rc, err := erasure.Erase(ctx, pool, erasure.EraseOptions{Table: "public.order_lines", Key: json.RawMessage(`{"id":3001}`),
		Reason: "test", Actor: "test"})
	require.NoError(t, err)
	require.Equal(t, 1, rc.Removed["epitaph.quarantine"])
	require.Empty(t, rc.Unchecked, "order 2's line: not an event this build decodes, but JSON naming another key")

	apply := projection.ReplayFunc(projection.ReplayConfig{SnapshotRoots: cfg.SnapshotRoots, Logger: testLogger(t),
		Decoder: &event.Decoder{Upgraders: map[int]func([]byte) ([]byte, error){
			2: func(b []byte) ([]byte, error) { return bytes.Replace(b, []byte(`"v":2`), []byte(`"v":1`), 1), nil },
		}}})
	res, err := quarantine.Replay(ctx, pool, quarantine.Selection{Filter: quarantine.Filter{Projection: "archive"}}, apply)
	require.NoError(t, err)
	require.Len(t, res.Replayed, 1, "order 2's line; order 3's was erased")
	require.Empty(t, res.Failed)
	require.Zero(t, count(t, c, `SELECT count(*) FROM epitaph.quarantine WHERE status = 'open'`))

	// Rows, row by row: the replayed line archived, its transaction's roots
	// decided again (the order is the root, the lines are not).
	rowsOf := func(tx *txn) []string {
		return keysOf(t, c, `SELECT concat_ws(' ', table_name, seq, is_root::text, verified::text, (expires_at IS NULL)::text)
			FROM archive.rows WHERE commit_lsn = $1::pg_lsn ORDER BY seq`, tx.lsn.String())
	}
	want := []string{"orders 0 true true true", "order_lines 1 false true true", "order_lines 2 false true true"}
	require.Equal(t, want, rowsOf(live))
	require.Equal(t, want, rowsOf(replayed))
	require.Equal(t, []string{"orders 0 true true true", "order_lines 1 false true true"}, rowsOf(fenced),
		"the erased line is not archived by the replay")

	// Deliveries: one per row and handler, released and verified, as live.
	deliveriesOf := func(tx *txn) []string {
		return keysOf(t, c, `SELECT concat_ws(' ', table_name, seq, state, (released_at IS NOT NULL)::text, verified::text)
			FROM epitaph.deliveries WHERE commit_lsn = $1::pg_lsn ORDER BY seq`, tx.lsn.String())
	}
	wantDeliveries := []string{"orders 0 pending true true", "order_lines 1 pending true true", "order_lines 2 pending true true"}
	require.Equal(t, wantDeliveries, deliveriesOf(live))
	require.Equal(t, wantDeliveries, deliveriesOf(replayed))
	require.Equal(t, wantDeliveries[:2], deliveriesOf(fenced), "the erased line gets no delivery")
	// The same rows applied live again (a re-published transaction): the
	// fence keeps the erased line out, and out of the deliveries.
	again := e.nextTx(orderRows(3, 2)...)
	e.publish(again)
	eventually(t, 20*time.Second, func() bool { return len(rowsOf(again)) == 2 })
	require.Equal(t, rowsOf(fenced), rowsOf(again))
	require.Equal(t, wantDeliveries[:2], deliveriesOf(again))

	// The snapshot: the replay invalidated the short group's job, and the
	// runtime's batcher rebuilt it with the replayed line.
	snapshotOf := func(tx *txn) []string {
		return keysOf(t, c, `SELECT concat_ws(' ', root_table, status, payload->'meta'->>'entity_count', payload->'meta'->>'transaction_rows')
			FROM archive.snapshots WHERE commit_lsn = $1::pg_lsn ORDER BY root_table`, tx.lsn.String())
	}
	require.Equal(t, []string{"public.orders complete 3 3"}, snapshotOf(live))
	eventually(t, 30*time.Second, func() bool {
		got := snapshotOf(replayed)
		return len(got) == 1 && got[0] == "public.orders complete 3 3"
	}, "the replayed transaction's snapshot is rebuilt: %v", snapshotOf(replayed))
}

// A quarantined gap event, replayed, records its gap as the live apply
// does (one lost_upstream row): what the archive misses is never hidden by
// a replay.
func TestReplayGapRecordsIt(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	ctx := context.Background()
	e.publish(e.nextTx(orderRows(1, 1)...))
	from := e.heartbeat()
	to := event.LSN(e.lsn.Add(0x10000))
	ev := &event.Event{Op: event.OpGap, Source: src, Partition: 0, FromLSN: from, ToLSN: to, LSN: to,
		Reason: "slot recreated", Time: time.Now().UTC()}
	m := e.msg(event.GapSubject(src, 0), event.GapMsgID(src, from, to, 0), ev)
	m.Data = bytes.Replace(m.Data, []byte(`"v":1`), []byte(`"v":2`), 1)
	_, err := e.pubMsg(ctx, m)
	require.NoError(t, err)
	e.start(e.config("w1"))
	c := e.conn()
	eventually(t, 20*time.Second, func() bool {
		return count(t, c, `SELECT count(*) FROM epitaph.quarantine WHERE category = 'unknown_version'`) == 1
	})
	require.Zero(t, count(t, c, `SELECT count(*) FROM archive.gaps`), "the gap event is in quarantine")

	pool := newPool(t, e.url)
	apply := projection.ReplayFunc(projection.ReplayConfig{Logger: testLogger(t), Decoder: &event.Decoder{Upgraders: map[int]func([]byte) ([]byte, error){
		2: func(b []byte) ([]byte, error) { return bytes.Replace(b, []byte(`"v":2`), []byte(`"v":1`), 1), nil },
	}}})
	res, err := quarantine.Replay(ctx, pool, quarantine.Selection{Filter: quarantine.Filter{Projection: "archive"}}, apply)
	require.NoError(t, err)
	require.Len(t, res.Replayed, 1)
	require.Equal(t, []string{"lost_upstream " + from.String() + " " + to.String()},
		keysOf(t, c, `SELECT concat_ws(' ', kind, from_lsn::text, to_lsn::text) FROM archive.gaps`))
}
