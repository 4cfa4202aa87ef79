package projection_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection"
)

func streamLast(t *testing.T, e *env) uint64 {
	t.Helper()
	s, err := e.js.Stream(context.Background(), event.StreamName(src))
	require.NoError(t, err)
	return s.CachedInfo().State.LastSeq
}

// The broker loses the tail of the stream (as after a power loss before an
// fsync) under a running projector, and the capture re-publishes from its
// confirmed position: the same events under new sequences, then new events
// whose sequences are at or below the projector's cursor. The projector must
// notice, rewind, and end with every event exactly once.
func TestStreamLosesItsTail(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	var txs []*txn
	for i := 0; i < 11; i++ {
		txs = append(txs, e.nextTx(orderRows(i+1, 3)...))
	}
	for _, tx := range txs[:8] {
		e.publish(tx)
	}
	for i := 0; i < 6; i++ {
		e.heartbeat()
	}
	e.publish(txs[8])
	require.Equal(t, uint64(8*5+6+5), streamLast(t, e))

	svc := e.start(e.config("w1"))
	c := e.conn()
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == 51 })
	require.Equal(t, 9*4, count(t, c, `SELECT count(*) FROM archive.rows`))

	// Power loss: the stream comes back holding only tx1..tx8.
	ctx := context.Background()
	require.NoError(t, e.js.DeleteStream(ctx, event.StreamName(src)))
	e.createStream()
	for _, tx := range txs[:8] {
		e.publish(tx)
	}
	// The capture re-sends tx9 and goes on with tx10 and tx11: they now
	// sit at sequences 41..55, around the old cursor 51.
	for _, tx := range txs[8:] {
		e.publish(tx)
	}
	require.Equal(t, uint64(11*5), streamLast(t, e))

	eventually(t, 30*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 11*4 },
		"rows: %d", count(t, c, `SELECT count(*) FROM archive.rows`))
	eventually(t, 10*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == 55 })
	require.Equal(t, 11*4, count(t, c, `SELECT count(DISTINCT (commit_lsn, seq)) FROM archive.rows`))
	require.Equal(t, 11, count(t, c, `SELECT count(*) FROM archive.rows WHERE is_root`))
	require.Equal(t, 0, count(t, c, `SELECT count(*) FROM archive.rows WHERE is_root IS NULL`))
	require.GreaterOrEqual(t, metricSum(t, svc, "epitaph_projector_rewinds_total"), 1.0)
}

// Messages at the end of the stream are deleted under a running projector
// and re-published (without dedupe) under new sequences, with more events
// behind them: nothing is skipped, nothing is archived twice.
func TestDeletedTailRepublished(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	var txs []*txn
	for i := 0; i < 7; i++ {
		txs = append(txs, e.nextTx(orderRows(i+1, 2)...))
	}
	for _, tx := range txs[:5] {
		e.publish(tx)
	}
	e.start(e.config("w1"))
	c := e.conn()
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == 20 })

	ctx := context.Background()
	s, err := e.js.Stream(ctx, event.StreamName(src))
	require.NoError(t, err)
	for seq := uint64(13); seq <= 20; seq++ {
		require.NoError(t, s.DeleteMsg(ctx, seq))
	}
	for _, tx := range txs[3:] {
		for _, m := range e.messages(tx) {
			m.Header.Del(event.HeaderMsgID)
			_, err := e.pubMsg(ctx, m)
			require.NoError(t, err)
		}
	}
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 7*3 },
		"rows: %d", count(t, c, `SELECT count(*) FROM archive.rows`))
	eventually(t, 10*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == int(streamLast(t, e)) })
	require.Equal(t, 7, count(t, c, `SELECT count(*) FROM archive.rows WHERE is_root`))
	_, err = s.GetMsg(ctx, 20)
	require.ErrorIs(t, err, jetstream.ErrMsgNotFound)
}

// tailScene is a stream that lost its tail inside an open transaction: a
// projector applied tx1 and tx2's rows but not tx2's commit (not
// published yet), and stopped; then the stream lost everything (it is
// empty again). other is a transaction of another partition.
type tailScene struct {
	e          *env
	c          *pgx.Conn
	tx2        *txn
	m1, m2, mo []*nats.Msg
}

// newTailScene makes the scene: other has 1 + otherLines rows; change, if
// set, alters tx2's messages before anything is published; beforeApplying,
// if set, runs before the first projector starts.
func newTailScene(t *testing.T, otherLines int, change func(m2 []*nats.Msg), beforeApplying func(e *env)) *tailScene {
	t.Helper()
	e := newEnv(t, 2)
	tx1 := e.nextTx(orderRows(1, 3)...)
	tx2 := e.nextTx(orderRows(2, 7)...)
	for tx2.partition != tx1.partition {
		tx2 = e.nextTx(orderRows(2, 7)...)
	}
	other := e.nextTx(orderRows(3, otherLines)...)
	for other.partition == tx1.partition {
		other = e.nextTx(orderRows(3, otherLines)...)
	}
	sc := &tailScene{e: e, tx2: tx2, m1: e.messages(tx1), m2: e.messages(tx2), mo: e.messages(other)}
	if change != nil {
		change(sc.m2)
	}
	ctx := context.Background()
	require.NoError(t, migrations.Apply(ctx, e.pool()))
	if beforeApplying != nil {
		beforeApplying(e)
	}
	for _, m := range append(append([]*nats.Msg{}, sc.m1...), sc.m2[:len(sc.m2)-1]...) { // tx2 without its commit
		_, err := e.pubMsg(ctx, m)
		require.NoError(t, err)
	}
	svc, err := projection.New(e.config("w1"), projection.WithLogger(testLogger(t)), projection.WithRegistry(prometheus.NewRegistry()))
	require.NoError(t, err)
	require.NoError(t, svc.Start(ctx))
	sc.c = e.conn()
	eventually(t, 20*time.Second, func() bool {
		return count(t, sc.c, `SELECT max(cursor) FROM epitaph.progress`) == len(sc.m1)+len(sc.m2)-1
	})
	require.NoError(t, svc.Stop(ctx))
	require.NoError(t, e.js.DeleteStream(ctx, event.StreamName(src)))
	e.createStream()
	return sc
}

// resend publishes what the capture sends again after the loss: other's
// transaction first (so another message sits at the old cursor), then tx1
// and the whole of tx2, each message as the capture signed it.
func (sc *tailScene) resend(t *testing.T) {
	t.Helper()
	for _, m := range append(append(append([]*nats.Msg{}, sc.mo...), sc.m1...), sc.m2...) {
		sc.e.signer.Sign(m) // signed already, except tx2's commit
		_, err := sc.e.js.PublishMsg(context.Background(), m)
		require.NoError(t, err)
	}
}

// all is how many messages the re-sent stream holds.
func (sc *tailScene) all() int { return len(sc.mo) + len(sc.m1) + len(sc.m2) }

// The stream loses its tail in the middle of a transaction whose rows the
// projector had archived (invisible, waiting for the commit), and the
// capture re-sends the lost rows and the commit: after the rewind the whole
// transaction is one page. Its rows must become visible, each once.
func TestTailLostInsideAnOpenTransaction(t *testing.T) {
	t.Parallel()
	var disp *handler.Dispatcher
	rec := &recorder{}
	sc := newTailScene(t, 1, nil, func(e *env) {
		pool := e.pool()
		addGoHandler(t, pool, "7a1c3f00-0000-4000-8000-0000000000a1", "orders", "rec", handler.PhaseImmediate)
		addGoHandler(t, pool, "7a1c3f00-0000-4000-8000-0000000000a2", "order_lines", "rec", handler.PhaseImmediate)
		reg := handler.NewRegistry()
		require.NoError(t, reg.Register("rec", rec))
		var err error
		disp, err = handler.NewDispatcher(pool, handler.Config{Registry: reg, Logger: testLogger(t)})
		require.NoError(t, err)
	})
	c := sc.c
	require.Equal(t, 4, count(t, c, `SELECT count(*) FROM archive.rows`))
	require.Equal(t, 8, count(t, c, `SELECT count(*) FROM archive_v1.rows WHERE NOT verified`), "tx2's rows wait for its commit")
	require.Equal(t, 8, count(t, c, `SELECT count(*) FROM epitaph.deliveries WHERE released_at IS NULL`), "so do their deliveries")

	// The capture re-sends what it had not confirmed, another partition's
	// transaction first, so another message sits at the cursor. The
	// projector rewinds and finds the whole of tx2 in one page.
	sc.resend(t)
	sc.e.start(sc.e.config("w1"))
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT max(cursor) FROM epitaph.progress`) == sc.all() })
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 4+8+2 },
		"rows: %d, unverified: %d", count(t, c, `SELECT count(*) FROM archive.rows`), count(t, c, `SELECT count(*) FROM archive_v1.rows WHERE NOT verified`))
	require.Equal(t, 0, count(t, c, `SELECT count(*) FROM archive_v1.rows WHERE NOT verified`))
	require.Equal(t, 3, count(t, c, `SELECT count(*) FROM archive.rows WHERE is_root`))
	// Every row's delivery runs, once.
	require.Zero(t, flushAll(t, disp))
	require.Equal(t, 14, rec.count())
	require.Equal(t, 14, count(t, c, `SELECT count(*) FROM epitaph.deliveries WHERE state = 'done'`))
	require.Equal(t, 14, count(t, c, `SELECT count(*) FROM epitaph.deliveries`))
}
