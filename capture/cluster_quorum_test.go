package capture

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// clusterMu runs this package's cluster tests one at a time: several
// three-node clusters in one process under -race on two cores miss their
// Raft heartbeats and re-elect for minutes, which is the machine, not what
// these tests look at.
var clusterMu sync.Mutex

// clusterEnv is a source database and a three-node JetStream cluster.
func clusterEnv(t *testing.T) (*env, *testenv.Cluster) {
	t.Helper()
	clusterMu.Lock()
	t.Cleanup(clusterMu.Unlock) // registered first: runs after the cluster stopped
	c := testenv.StartCluster(t, testenv.ClusterConfig{})
	e := &env{db: testenv.NewDatabase(t), dir: t.TempDir(), nats: &testenv.NATS{URL: c.URL}}
	e.slot = dbName(t, e.db)
	nc, err := nats.Connect(c.URL, nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	e.js, err = jetstream.New(nc)
	require.NoError(t, err)
	ctx := context.Background()
	require.Eventually(t, func() bool {
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		_, err := e.js.AccountInfo(cctx)
		return err == nil
	}, time.Minute, 200*time.Millisecond, "meta leader")
	return e, c
}

func (e *env) clusterStart(t *testing.T, url string, mod func(*Config)) *Service {
	t.Helper()
	cfg := e.config()
	cfg.NATSURL = url
	cfg.Replicas = 3
	if mod != nil {
		mod(&cfg)
	}
	svc := newService(t, cfg)
	require.NoError(t, svc.Start(context.Background()))
	return svc
}

// clusterDeletes waits until the stream holds n delete events and returns
// every message, read message by message (a read through a consumer can
// race the stream's leader elections).
func clusterDeletes(t *testing.T, js jetstream.JetStream, n int, bound time.Duration) []msg {
	t.Helper()
	ctx := context.Background()
	deadline := time.Now().Add(bound)
	var out []msg
	var next uint64 = 1
	deletes := 0
	var lastErr error
	for deletes < n {
		require.True(t, time.Now().Before(deadline), "stream holds %d of %d deletes after %s (last read error: %v)", deletes, n, bound, lastErr)
		st, err := js.Stream(ctx, event.StreamName("main"))
		if err != nil {
			lastErr = err
			time.Sleep(100 * time.Millisecond)
			continue
		}
		m, err := st.GetMsg(ctx, next)
		if err != nil {
			lastErr = err
			time.Sleep(100 * time.Millisecond)
			continue
		}
		ev, err := event.Decode(m.Data)
		require.NoError(t, err)
		if ev.Op == event.OpDelete {
			deletes++
		}
		out = append(out, msg{seq: m.Sequence, subject: m.Subject, msgID: m.Header.Get(event.HeaderMsgID), pos: m.Header.Get(HeaderPosition), ev: ev})
		next++
	}
	return out
}

// clusterAll returns ms (read by clusterDeletes) and every message after
// them to the stream's end.
func clusterAll(t *testing.T, js jetstream.JetStream, ms []msg) []msg {
	t.Helper()
	ctx := context.Background()
	st, err := js.Stream(ctx, event.StreamName("main"))
	require.NoError(t, err)
	info, err := st.Info(ctx)
	require.NoError(t, err)
	for seq := ms[len(ms)-1].seq + 1; seq <= info.State.LastSeq; seq++ {
		m, err := st.GetMsg(ctx, seq)
		require.NoError(t, err)
		ev, err := event.Decode(m.Data)
		require.NoError(t, err)
		ms = append(ms, msg{seq: m.Sequence, subject: m.Subject, msgID: m.Header.Get(event.HeaderMsgID), pos: m.Header.Get(HeaderPosition), ev: ev})
	}
	return ms
}

// A stream leader step-down (JetStream's API; the old leader stays up)
// while the capture publishes a transaction: the publishes the old leader
// had in flight are never answered. The capture says the broker is
// unavailable instead of healthy, ends the session once it sees another
// leader (instead of waiting out the acknowledgements' one-minute
// timeout), resumes with the new one after what it holds, and every row
// and every message is stored once.
func TestStreamLeaderStepDownIsReportedAndStoresEveryRowOnce(t *testing.T) {
	t.Parallel()
	e, c := clusterEnv(t)
	const rows = 3000
	e.exec(t, `CREATE TABLE items (id int PRIMARY KEY, pad text); ALTER TABLE items REPLICA IDENTITY FULL;
		INSERT INTO items SELECT i, repeat('p', 100) FROM generate_series(1, 3000) i`)
	svc := e.clusterStart(t, c.URL, func(c *Config) { c.MaxInFlight = 64 })
	ctx := context.Background()
	e.exec(t, `DELETE FROM items`)
	stream := event.StreamName("main")
	var st jetstream.Stream
	require.Eventually(t, func() bool {
		var err error
		st, err = e.js.Stream(ctx, stream)
		if err != nil {
			return false
		}
		info, err := st.Info(ctx)
		return err == nil && info.State.Msgs >= 1000
	}, 30*time.Second, 5*time.Millisecond)
	_, err := e.js.Conn().Request("$JS.API.STREAM.LEADER.STEPDOWN."+stream, nil, 10*time.Second)
	require.NoError(t, err)
	stepped := time.Now()
	// The capture never reports healthy while the stream has not moved for
	// 5 s (since the step-down, or since a new session started): a new
	// leader is elected in a few seconds, and the capture goes on with it
	// or says the broker is unavailable.
	var last uint64
	progressed := stepped
	healthyStalled, wasHealthy := false, true
	for time.Since(stepped) < 15*time.Second {
		info, err := st.Info(ctx)
		if err == nil {
			if info.State.Msgs > last {
				last, progressed = info.State.Msgs, time.Now()
			}
			if info.State.Msgs >= rows+1 {
				break
			}
		}
		healthy := svc.healthy(ctx) == nil
		if healthy && !wasHealthy {
			// A new session: healthy while it skips what the stream
			// holds, judged from its start.
			progressed = time.Now()
		}
		wasHealthy = healthy
		if time.Since(progressed) > 5*time.Second && healthy {
			healthyStalled = true
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("stream at %d messages; last progress %.1fs after the step-down", last, progressed.Sub(stepped).Seconds())
	require.False(t, healthyStalled, "the capture reported healthy while the stream had not moved for 5s after a leader step-down")
	// A loaded machine may take a while to elect the new leader.
	ms := clusterDeletes(t, e.js, rows, 3*time.Minute)
	complete := time.Since(stepped)
	t.Logf("complete %.1fs after the step-down", complete.Seconds())
	require.Less(t, complete, 45*time.Second, "the capture waited out the dropped publishes' one-minute timeout")
	// Every message to the stream's end (the transaction's commit too).
	ms = clusterAll(t, e.js, ms)
	require.Contains(t, ops(ms), "commit", "the transaction's commit is stored")
	requireOnce(t, ms, rows)
}

// Two of three nodes stopped (no quorum; the stream's leader is the one
// left) while rows are deleted: within seconds the capture says the broker
// is unavailable (/readyz, epitaph_capture_connected), keeps running, and
// once the quorum is back every row is in the stream once.
func TestCaptureRidesOutLostQuorum(t *testing.T) {
	t.Parallel()
	e, c := clusterEnv(t)
	e.exec(t, `CREATE TABLE items (id int PRIMARY KEY, pad text); ALTER TABLE items REPLICA IDENTITY FULL;
		INSERT INTO items SELECT i, repeat('p', 100) FROM generate_series(1, 400) i`)
	svc := e.clusterStart(t, c.URL, func(c *Config) { c.HeartbeatInterval = time.Second })
	ctx := context.Background()
	e.exec(t, `DELETE FROM items WHERE id <= 100`)
	clusterDeletes(t, e.js, 100, 30*time.Second)
	// The stream's leader is left running: it goes on calling itself the
	// leader for a while, without a quorum to store anything.
	leader, _, err := testenv.StreamCluster(ctx, e.js, event.StreamName("main"))
	require.NoError(t, err)
	var stopped []*testenv.ClusterNode
	for _, n := range c.Nodes {
		if n.Name != leader {
			n.Stop()
			stopped = append(stopped, n)
		}
	}
	require.Len(t, stopped, 2)
	e.exec(t, `DELETE FROM items WHERE id > 100 AND id <= 200`)
	lost := time.Now()
	require.Eventually(t, func() bool { return svc.healthy(ctx) != nil }, 15*time.Second, 20*time.Millisecond,
		"unready while the cluster has no quorum")
	t.Logf("unready %.1fs after the quorum was lost", time.Since(lost).Seconds())
	require.Equal(t, 0.0, metricValue(t, svc.m.connected.WithLabelValues(linkBroker)))
	require.NoError(t, svc.live(ctx))
	time.Sleep(3 * time.Second)
	select {
	case <-svc.ss.Done():
		t.Fatalf("the capture stopped on a lost quorum: %v", svc.Wait())
	default:
	}
	for _, n := range stopped {
		n.Start()
	}
	e.exec(t, `DELETE FROM items WHERE id > 200`)
	requireStreamsAgain(t, svc)
	ms := clusterDeletes(t, e.js, 400, 60*time.Second)
	requireOnce(t, ms, 400)
}

// A capture configured for a replicated stream (--replicas 3) that
// confirms without trailing the broker (--broker-sync-interval=-1, as
// docs/capture.md says for a 3-replica stream) refuses to start on an
// existing 1-replica stream (made by an earlier start with the default
// replicas): there one server's power loss could take acknowledged
// messages whose positions the slot was already told to forget.
func TestReplicatedCaptureRefusesAnExistingSingleReplicaStream(t *testing.T) {
	t.Parallel()
	e, c := clusterEnv(t)
	e.exec(t, `CREATE TABLE items (id int PRIMARY KEY); ALTER TABLE items REPLICA IDENTITY FULL; INSERT INTO items VALUES (1)`)
	first := e.clusterStart(t, c.URL, func(c *Config) { c.Replicas = 1; c.BrokerSyncInterval = time.Minute })
	require.NoError(t, first.Stop(context.Background()))
	st, err := e.js.Stream(context.Background(), event.StreamName("main"))
	require.NoError(t, err)
	require.Equal(t, 1, st.CachedInfo().Config.Replicas)
	cfg := e.config()
	cfg.NATSURL, cfg.Replicas, cfg.BrokerSyncInterval = c.URL, 3, -1
	svc := newService(t, cfg)
	err = svc.Start(context.Background())
	require.Error(t, err, "started on a 1-replica stream, confirming without the trail")
	var ce *ConfigError
	require.ErrorAs(t, err, &ce)
	require.Contains(t, err.Error(), "replica")
}
