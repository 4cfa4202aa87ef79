package projection_test

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
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
