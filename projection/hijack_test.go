package projection_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/projection"
)

// A holder of the projector's credentials deletes a running target's
// consumer and makes it anew under the same name, filter, ack policy and
// limits, but delivering headers only: the worker sees the body-less
// deliveries (and the configuration) are not its consumer's, resets it at
// the cursor, and the archive stays exact row by row, nothing quarantined
// as malformed.
func TestHijackedHeadersOnlyConsumerIsReset(t *testing.T) {
	t.Parallel()
	h := startHeadersOnlyRun(t)
	hijack := h.cfg
	hijack.HeadersOnly = true
	hijack.DeliverPolicy, hijack.OptStartSeq = jetstream.DeliverAllPolicy, 0
	require.NoError(t, h.st.DeleteConsumer(h.ctx, h.name))
	_, err := h.st.CreateConsumer(h.ctx, hijack)
	require.NoError(t, err)
	h.requireReset(t)
}

// A consumer switched to headers only in place (a consumer update, which
// the projector's credentials may make): the worker's consumer keeps its
// name and its pull requests, and the next deliveries come without a
// body. A delivery without a body is a reset, never a quarantine: the
// worker makes its consumer anew at the cursor, the archive stays exact
// row by row and nothing is quarantined as malformed.
func TestConsumerSwitchedToHeadersOnlyInPlaceIsReset(t *testing.T) {
	t.Parallel()
	h := startHeadersOnlyRun(t)
	cfg := h.cfg
	cfg.HeadersOnly = true
	updated, err := h.st.UpdateConsumer(h.ctx, cfg)
	require.NoError(t, err)
	require.True(t, updated.CachedInfo().Config.HeadersOnly, "the server switched the running consumer in place")
	h.requireReset(t)
}

// headersOnlyRun is a one-partition target whose worker has applied three
// transactions, with the configuration of its consumer as the worker made
// it (full bodies).
type headersOnlyRun struct {
	ctx  context.Context
	e    *env
	svc  *projection.Service
	c    *pgx.Conn
	txs  []*txn
	st   jetstream.Stream
	name string
	cfg  jetstream.ConsumerConfig
}

func startHeadersOnlyRun(t *testing.T) *headersOnlyRun {
	t.Helper()
	h := &headersOnlyRun{ctx: context.Background(), e: newEnv(t, 1)}
	h.svc = h.e.start(h.e.config("w1"))
	h.c = h.e.conn()
	h.publish(1, 3)
	eventually(t, 20*time.Second, func() bool { return count(t, h.c, `SELECT cursor FROM epitaph.progress`) == 9 })

	var err error
	h.st, err = h.e.js.Stream(h.ctx, event.StreamName(src))
	require.NoError(t, err)
	h.name = h.e.consumerName(1, 0)
	cons, err := h.st.Consumer(h.ctx, h.name)
	require.NoError(t, err)
	h.cfg = cons.CachedInfo().Config
	require.False(t, h.cfg.HeadersOnly)
	return h
}

// publish publishes one transaction of one order for each id in [from, to].
func (h *headersOnlyRun) publish(from, to int) {
	for i := from; i <= to; i++ {
		tx := h.e.nextTx(orderRows(i, 1)...)
		h.e.publish(tx)
		h.txs = append(h.txs, tx)
	}
}

// requireReset publishes three more transactions after the consumer was
// tampered with and requires the worker to have made its consumer anew
// (full bodies again, a reset counted for the configuration) with the
// archive exact row by row and nothing quarantined.
func (h *headersOnlyRun) requireReset(t *testing.T) {
	t.Helper()
	h.publish(4, 6)
	eventually(t, 30*time.Second, func() bool { return count(t, h.c, `SELECT cursor FROM epitaph.progress`) == 18 })
	require.Equal(t, expectedArchive(t, h.txs), archiveOf(t, h.c))
	require.Empty(t, quarantined(t, h.c), "nothing quarantined as malformed")
	cons, err := h.st.Consumer(h.ctx, h.name)
	require.NoError(t, err)
	require.False(t, cons.CachedInfo().Config.HeadersOnly, "the worker made its consumer anew")
	require.Positive(t, metricSumLabel(t, h.svc, "epitaph_projector_consumer_resets_total", "reason", "config"))
}
