package projection_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// clusterProjEnv is an env on a three-node cluster, its stream on three
// replicas, with one partition.
func clusterProjEnv(t *testing.T) (*env, *testenv.Cluster, *nats.Conn) {
	t.Helper()
	c := testenv.StartCluster(t, testenv.ClusterConfig{})
	e := &env{t: t, url: testenv.NewDatabase(t), nats: &testenv.NATS{URL: c.URL}, partitions: 1, signer: testenv.NewSigner()}
	e.lsn.Store(0x1000000)
	nc, err := nats.Connect(c.URL, nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	e.js, err = jetstream.New(nc)
	require.NoError(t, err)
	ctx := context.Background()
	require.Eventually(t, func() bool {
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		_, err = e.js.CreateStream(cctx, jetstream.StreamConfig{
			Name: event.StreamName(src), Subjects: []string{event.StreamSubjects(src)},
			Storage: jetstream.FileStorage, Replicas: 3,
			Metadata: map[string]string{event.MetaPartitions: strconv.Itoa(e.partitions), event.MetaSource: src, event.MetaWireVersion: "1"},
		})
		return err == nil
	}, time.Minute, 250*time.Millisecond, "three-replica stream: %v", err)
	return e, c, nc
}

// The consumer of a partition changes its leader (JetStream's step-down)
// again and again while a projector fetches, applies and acknowledges
// pages of a three-replica stream: redeliveries after an apply whose
// acknowledgement was lost are skipped, and every row is archived once.
func TestConsumerLeaderStepDownsArchiveEveryRowOnce(t *testing.T) {
	t.Parallel()
	e, _, nc := clusterProjEnv(t)
	e.start(e.config("w1"))
	const txs = 120
	for i := 0; i < 10; i++ {
		e.publish(e.nextTx(orderRows(i+1, 2)...))
	}
	consumer := e.consumerName(1, 0)
	db := e.conn()
	eventually(t, 20*time.Second, func() bool { return count(t, db, `SELECT count(*) FROM archive.rows`) == 30 })
	steps := 0
	for i := 10; i < txs; i++ {
		e.publish(e.nextTx(orderRows(i+1, 2)...))
		if i%20 == 0 {
			_, err := nc.Request("$JS.API.CONSUMER.LEADER.STEPDOWN."+event.StreamName(src)+"."+consumer, nil, 5*time.Second)
			t.Logf("consumer step-down at tx %d: %v", i, err)
			steps++
		}
	}
	eventually(t, 45*time.Second, func() bool { return count(t, db, `SELECT count(*) FROM archive.rows`) >= 3*txs },
		"rows: %d", count(t, db, `SELECT count(*) FROM archive.rows`))
	time.Sleep(2 * time.Second) // redeliveries would land now
	require.Equal(t, 3*txs, count(t, db, `SELECT count(*) FROM archive.rows`))
	require.Equal(t, txs, count(t, db, `SELECT count(*) FROM archive.rows WHERE is_root`))
	require.Equal(t, 3*txs, count(t, db, `SELECT count(DISTINCT (table_name, key)) FROM archive.rows`))
}

// Two of three nodes stopped (no quorum; the stream's leader left
// running) under an idle, caught-up projector: archive.status stops being
// ready (deploy/README.md, "Two nodes down"); with the quorum back it is
// ready again and every row published after is archived once.
func TestProjectorNotReadyWithoutQuorum(t *testing.T) {
	t.Parallel()
	e, c, _ := clusterProjEnv(t)
	e.start(e.config("w1"))
	for i := 0; i < 5; i++ {
		e.publish(e.nextTx(orderRows(i+1, 2)...))
	}
	e.heartbeat()
	db := e.conn()
	eventually(t, 20*time.Second, func() bool { return readyNow(db) }, "ready when caught up")
	leader, _, err := testenv.StreamCluster(context.Background(), e.js, event.StreamName(src))
	require.NoError(t, err)
	var stopped []*testenv.ClusterNode
	for _, n := range c.Nodes {
		if n.Name != leader {
			n.Stop()
			stopped = append(stopped, n)
		}
	}
	eventually(t, 30*time.Second, func() bool { return !readyNow(db) }, "not ready without a quorum")
	for _, n := range stopped {
		n.Start()
	}
	require.NoError(t, c.WaitHealthy(context.Background(), 45*time.Second))
	eventually(t, 45*time.Second, func() bool {
		l, rs, err2 := testenv.StreamCluster(context.Background(), e.js, event.StreamName(src))
		return err2 == nil && l != "" && len(rs) == 2 && rs[0].Current && rs[1].Current
	}, "the stream has a leader and current replicas again")
	for i := 5; i < 10; i++ {
		e.publish(e.nextTx(orderRows(i+1, 2)...))
	}
	e.heartbeat()
	eventually(t, 45*time.Second, func() bool { return readyNow(db) && count(t, db, `SELECT count(*) FROM archive.rows`) == 30 },
		"rows: %d", count(t, db, `SELECT count(*) FROM archive.rows`))
	require.Equal(t, 10, count(t, db, `SELECT count(*) FROM archive.rows WHERE is_root`))
}
