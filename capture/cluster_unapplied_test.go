package capture

import (
	"context"
	"encoding/json"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// A capture stopped while the stream's leader holds publishes it cannot
// store yet (two of three nodes down), and started again before the nodes
// come back: the leader still answers what the stream holds, without those
// publishes, and stores them once a quorum answers it again. The new
// session waits until the stream has stored or dropped everything its
// leader holds before it reads where to resume, so every row is in the
// stream once (the stream's dedupe window, 100 ms by default, is long gone).
func TestSessionStartedWhileTheLeaderHoldsUnstoredPublishesStoresEveryRowOnce(t *testing.T) {
	t.Parallel()
	e, c := clusterEnv(t)
	e.exec(t, `CREATE TABLE items (id int PRIMARY KEY, pad text); ALTER TABLE items REPLICA IDENTITY FULL;
		INSERT INTO items SELECT i, repeat('p', 100) FROM generate_series(1, 300) i`)
	cfg := e.config()
	cfg.NATSURL, cfg.Replicas, cfg.HeartbeatInterval = c.URL, 3, time.Hour
	first := newService(t, cfg)
	ctx := context.Background()
	require.NoError(t, first.Start(ctx))
	e.exec(t, `DELETE FROM items WHERE id <= 100`)
	clusterDeletes(t, e.js, 100, 30*time.Second)
	// One node leads both the stream and the row bucket, so that a
	// capture can start while the other two are down.
	leader, _, err := testenv.StreamCluster(ctx, e.js, event.StreamName("main"))
	require.NoError(t, err)
	moveStreamLeader(t, e.js, "OBJ_"+event.RowBucket("main"), leader)
	var stopped []*testenv.ClusterNode
	for _, n := range c.Nodes {
		if n.Name != leader {
			n.Stop()
			stopped = append(stopped, n)
		}
	}
	require.Len(t, stopped, 2)
	// Published to the leader, which cannot store them without a quorum.
	e.exec(t, `DELETE FROM items WHERE id > 100 AND id <= 200`)
	time.Sleep(time.Second)
	// Stopped without waiting for the answers (as a SIGKILL would).
	stopCtx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	_ = first.Stop(stopCtx)
	<-first.ss.Done()

	started := make(chan error, 1)
	go func() {
		deadline := time.Now().Add(2 * time.Minute)
		for {
			err := newService(t, cfg).Start(ctx)
			if err == nil || time.Now().After(deadline) {
				started <- err
				return
			}
			t.Logf("start: %v", err)
			time.Sleep(100 * time.Millisecond)
		}
	}()
	time.Sleep(2 * time.Second)
	for _, n := range stopped {
		n.Start()
	}
	require.NoError(t, <-started)
	e.exec(t, `DELETE FROM items WHERE id > 200`)
	ms := clusterAll(t, e.js, clusterDeletes(t, e.js, 300, 3*time.Minute))
	require.Contains(t, ops(ms), "commit")
	for _, m := range ms {
		require.NotEqual(t, event.SettleSubject("main"), m.subject, "a settle probe was stored")
	}
	requireOnce(t, ms, 300)
}

// moveStreamLeader makes node to the leader of stream (a step-down with a
// preferred placement).
func moveStreamLeader(t *testing.T, js jetstream.JetStream, stream, to string) {
	t.Helper()
	ctx := context.Background()
	require.Eventually(t, func() bool {
		leader, _, err := testenv.StreamCluster(ctx, js, stream)
		if err != nil || leader == to {
			return err == nil
		}
		req, _ := json.Marshal(map[string]any{"placement": map[string]string{"preferred": to}})
		_, err = js.Conn().Request("$JS.API.STREAM.LEADER.STEPDOWN."+stream, req, 5*time.Second)
		if err != nil {
			t.Logf("step down %s: %v", stream, err)
		}
		return false
	}, time.Minute, 500*time.Millisecond, "stream %s led by %s", stream, to)
}

// On a single server, which stores what it takes at once, a session's
// start waits for nothing: the settle probe is refused at once, and never
// stored, at every start.
func TestSettleProbeIsRefusedAtOnceOnASingleServer(t *testing.T) {
	t.Parallel()
	e := setup(t)
	itemsTable(t, e, 10)
	ctx := context.Background()
	for i := 0; i < 2; i++ {
		svc := e.start(t, nil)
		e.exec(t, `DELETE FROM items WHERE id = `+strconv.Itoa(i+1))
		require.NoError(t, svc.Stop(ctx))
	}
	st, err := e.js.Stream(ctx, event.StreamName("main"))
	require.NoError(t, err)
	began := time.Now()
	stored, err := settle(ctx, e.js, st, "main")
	require.NoError(t, err)
	require.False(t, stored)
	require.Less(t, time.Since(began), time.Second)
	_, err = st.GetLastMsgForSubject(ctx, event.SettleSubject("main"))
	require.ErrorIs(t, err, jetstream.ErrMsgNotFound, "a settle probe was stored")
}

// A server older than 2.12 stores the settle probe (it does not refuse
// its invalid header): the resume skips such messages, without counting
// them as foreign, and every row is stored once after them.
func TestStoredSettleProbesAreSkippedAtResume(t *testing.T) {
	t.Parallel()
	e := setup(t)
	itemsTable(t, e, 30)
	ctx := context.Background()
	svc := e.start(t, nil)
	e.exec(t, `DELETE FROM items WHERE id <= 10`)
	e.messages(t, "main", 11)
	require.NoError(t, svc.Stop(ctx))
	// What an older server keeps of two session starts.
	for range 2 {
		_, err := e.js.Publish(ctx, event.SettleSubject("main"), nil)
		require.NoError(t, err)
	}
	svc = e.start(t, nil)
	e.exec(t, `DELETE FROM items WHERE id > 10`)
	var raw []*jetstream.RawStreamMsg
	require.Eventually(t, func() bool {
		raw = e.rawMsgs(t, "main")
		return len(raw) >= 11+2+21
	}, time.Minute, 50*time.Millisecond)
	var mine []msg
	for _, m := range raw {
		if m.Subject == event.SettleSubject("main") {
			continue
		}
		ev, err := event.Decode(m.Data)
		require.NoError(t, err)
		mine = append(mine, msg{seq: m.Sequence, subject: m.Subject, msgID: m.Header.Get(event.HeaderMsgID), ev: ev})
	}
	requireOnce(t, mine, 30)
	require.Equal(t, 0.0, counterValue(t, svc.m.foreign), "a stored probe counted as foreign")
}
