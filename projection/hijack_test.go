package projection_test

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
)

// A holder of the projector's credentials deletes a running target's
// consumer and makes it anew under the same name, filter, ack policy and
// limits, but delivering headers only: the worker sees the body-less
// deliveries (and the configuration) are not its consumer's, resets it at
// the cursor, and the archive stays exact row by row, nothing quarantined
// as malformed.
func TestHijackedHeadersOnlyConsumerIsReset(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	cfg := e.config("w1")
	svc := e.start(cfg)
	c := e.conn()
	var txs []*txn
	for i := 1; i <= 3; i++ {
		tx := e.nextTx(orderRows(i, 1)...)
		e.publish(tx)
		txs = append(txs, tx)
	}
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == 9 })

	ctx := context.Background()
	st, err := e.js.Stream(ctx, event.StreamName(src))
	require.NoError(t, err)
	name := e.consumerName(1, 0)
	cons, err := st.Consumer(ctx, name)
	require.NoError(t, err)
	hijack := cons.CachedInfo().Config
	require.False(t, hijack.HeadersOnly)
	hijack.HeadersOnly = true
	hijack.DeliverPolicy, hijack.OptStartSeq = jetstream.DeliverAllPolicy, 0
	require.NoError(t, st.DeleteConsumer(ctx, name))
	_, err = st.CreateConsumer(ctx, hijack)
	require.NoError(t, err)

	for i := 4; i <= 6; i++ {
		tx := e.nextTx(orderRows(i, 1)...)
		e.publish(tx)
		txs = append(txs, tx)
	}
	eventually(t, 30*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == 18 })
	require.Equal(t, expectedArchive(t, txs), archiveOf(t, c))
	require.Empty(t, quarantined(t, c), "nothing quarantined as malformed")
	cons, err = st.Consumer(ctx, name)
	require.NoError(t, err)
	require.False(t, cons.CachedInfo().Config.HeadersOnly, "the worker made its consumer anew")
	require.Positive(t, metricSumLabel(t, svc, "epitaph_projector_consumer_resets_total", "reason", "config"))
}

// A consumer switched to headers only in place (a consumer update, which
// the projector's credentials may make): the worker's consumer keeps its
// name and its pull requests, and the next deliveries come without a
// body. A delivery without a body is a reset, never a quarantine: the
// worker makes its consumer anew at the cursor, the archive stays exact
// row by row and nothing is quarantined as malformed.
func TestConsumerSwitchedToHeadersOnlyInPlaceIsReset(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	svc := e.start(e.config("w1"))
	c := e.conn()
	var txs []*txn
	for i := 1; i <= 3; i++ {
		tx := e.nextTx(orderRows(i, 1)...)
		e.publish(tx)
		txs = append(txs, tx)
	}
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == 9 })

	ctx := context.Background()
	st, err := e.js.Stream(ctx, event.StreamName(src))
	require.NoError(t, err)
	name := e.consumerName(1, 0)
	cons, err := st.Consumer(ctx, name)
	require.NoError(t, err)
	cfg := cons.CachedInfo().Config
	require.False(t, cfg.HeadersOnly)
	cfg.HeadersOnly = true
	updated, err := st.UpdateConsumer(ctx, cfg)
	require.NoError(t, err)
	require.True(t, updated.CachedInfo().Config.HeadersOnly, "the server switched the running consumer in place")

	for i := 4; i <= 6; i++ {
		tx := e.nextTx(orderRows(i, 1)...)
		e.publish(tx)
		txs = append(txs, tx)
	}
	eventually(t, 30*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == 18 })
	require.Equal(t, expectedArchive(t, txs), archiveOf(t, c))
	require.Empty(t, quarantined(t, c), "nothing quarantined as malformed")
	cons, err = st.Consumer(ctx, name)
	require.NoError(t, err)
	require.False(t, cons.CachedInfo().Config.HeadersOnly, "the worker made its consumer anew")
	require.Positive(t, metricSumLabel(t, svc, "epitaph_projector_consumer_resets_total", "reason", "config"))
}
