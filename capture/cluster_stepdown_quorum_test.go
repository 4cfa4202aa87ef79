package capture

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// A stream leader step-down while nothing is in flight (the session goes
// on with the new leader), then two of three nodes stopped (the new
// leader left without a quorum) while rows are deleted: the capture waits
// for the quorum as it does without the step-down, and once it is back
// every row is in the stream once.
func TestLostQuorumAfterAStepDownStoresEveryRowOnce(t *testing.T) {
	t.Parallel()
	e, c := clusterEnv(t)
	e.exec(t, `CREATE TABLE items (id int PRIMARY KEY, pad text); ALTER TABLE items REPLICA IDENTITY FULL;
		INSERT INTO items SELECT i, repeat('p', 100) FROM generate_series(1, 400) i`)
	svc := e.clusterStart(t, c.URL, func(c *Config) { c.HeartbeatInterval = time.Hour })
	ctx := context.Background()
	e.exec(t, `DELETE FROM items WHERE id <= 100`)
	clusterDeletes(t, e.js, 100, 30*time.Second)
	stream := event.StreamName("main")
	old, _, err := testenv.StreamCluster(ctx, e.js, stream)
	require.NoError(t, err)
	_, err = e.js.Conn().Request("$JS.API.STREAM.LEADER.STEPDOWN."+stream, nil, 10*time.Second)
	require.NoError(t, err)
	var leader string
	require.Eventually(t, func() bool {
		leader, _, err = testenv.StreamCluster(ctx, e.js, stream)
		return err == nil && leader != "" && leader != old
	}, 30*time.Second, 50*time.Millisecond)
	e.exec(t, `DELETE FROM items WHERE id > 100 AND id <= 150`)
	clusterDeletes(t, e.js, 150, 60*time.Second)

	var stopped []*testenv.ClusterNode
	for _, n := range c.Nodes {
		if n.Name != leader {
			n.Stop()
			stopped = append(stopped, n)
		}
	}
	require.Len(t, stopped, 2)
	e.exec(t, `DELETE FROM items WHERE id > 150 AND id <= 250`)
	time.Sleep(8 * time.Second)
	for _, n := range stopped {
		n.Start()
	}
	e.exec(t, `DELETE FROM items WHERE id > 250`)
	requireStreamsAgain(t, svc)
	ms := clusterDeletes(t, e.js, 400, 3*time.Minute)
	requireOnce(t, ms, 400)
}
