package projection_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
)

// A consumer that has messages pending but delivers none (here: paused
// behind the worker's back, as one was left stuck by a JetStream cluster
// that lost the node leading it) is recreated at the cursor after a few
// idle fetches, and the partition goes on.
func TestStalledConsumerIsRecreated(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	s := e.start(e.config("w1"))
	c := e.conn()
	e.publish(e.nextTx(orderRows(1, 1)...))
	eventually(t, 10*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 2 })
	ctx := context.Background()
	_, err := e.js.PauseConsumer(ctx, event.StreamName(src), e.consumerName(1, 0), time.Now().Add(time.Hour))
	require.NoError(t, err)
	e.publish(e.nextTx(orderRows(2, 1)...))
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 4 },
		"the rows published after the pause are archived")
	require.GreaterOrEqual(t, metricSum(t, s, "epitaph_projector_consumer_resets_total"), 1.0)
	info, err := e.js.Consumer(ctx, event.StreamName(src), e.consumerName(1, 0))
	require.NoError(t, err)
	require.False(t, info.CachedInfo().Paused, "the recreated consumer is not paused")
}
