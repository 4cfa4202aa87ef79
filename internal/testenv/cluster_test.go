package testenv_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// The cluster forms (a three-replica stream is placed on all nodes), a
// stopped leader's node is replaced by a new leader with every message,
// and the node comes back with its store and catches up.
func TestClusterSurvivesItsLeader(t *testing.T) {
	t.Parallel()
	c := testenv.StartCluster(t, testenv.ClusterConfig{})
	nc, err := nats.Connect(c.URL, nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	require.Eventually(t, func() bool {
		cctx, ccancel := context.WithTimeout(ctx, 5*time.Second)
		defer ccancel()
		_, err = js.CreateStream(cctx, jetstream.StreamConfig{Name: "R3", Subjects: []string{"r3.>"}, Storage: jetstream.FileStorage, Replicas: 3})
		return err == nil
	}, time.Minute, 250*time.Millisecond, "three-replica stream: %v", err)
	for i := range 5 {
		_, err := js.Publish(ctx, "r3.a", fmt.Appendf(nil, "%d", i))
		require.NoError(t, err)
	}
	leader, replicas, err := testenv.StreamCluster(ctx, js, "R3")
	require.NoError(t, err)
	require.Len(t, replicas, 2)
	c.Node(leader).Stop()
	require.False(t, c.Node(leader).Running())
	require.Eventually(t, func() bool {
		cctx, ccancel := context.WithTimeout(ctx, 5*time.Second)
		defer ccancel()
		l, _, err := testenv.StreamCluster(cctx, js, "R3")
		if err != nil || l == "" || l == leader {
			return false
		}
		_, err = js.Publish(cctx, "r3.a", []byte("5"))
		return err == nil
	}, time.Minute, 250*time.Millisecond, "a new leader takes writes")
	c.Node(leader).Start()
	require.Eventually(t, func() bool {
		_, rs, err := testenv.StreamCluster(ctx, js, "R3")
		if err != nil || len(rs) != 2 {
			return false
		}
		for _, r := range rs {
			if !r.Current {
				return false
			}
		}
		return true
	}, time.Minute, 250*time.Millisecond, "the node is back and current")
	s, err := js.Stream(ctx, "R3")
	require.NoError(t, err)
	info, err := s.Info(ctx)
	require.NoError(t, err)
	require.Equal(t, uint64(6), info.State.Msgs)
}
