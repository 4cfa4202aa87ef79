package capture

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// waitEnded waits for the capture loop to end on its own and returns its
// error.
func waitEnded(t *testing.T, svc *Service) error {
	t.Helper()
	select {
	case <-svc.ss.Done():
		return svc.Wait()
	case <-time.After(90 * time.Second):
		t.Fatal("capture did not stop after losing its broker/source")
		return nil
	}
}

// requireStreamsAgain waits until svc streams again with both links up
// after an outage, and requires that its loop never ended.
func requireStreamsAgain(t *testing.T, svc *Service) {
	t.Helper()
	require.Eventually(t, func() bool {
		select {
		case <-svc.ss.Done():
			t.Fatalf("the capture stopped on an outage: %v", svc.Wait())
		default:
		}
		return svc.activeState.Load() && svc.links.ready() == nil
	}, 120*time.Second, 20*time.Millisecond)
}

// TestBrokerRestartMidStream restarts JetStream while a big transaction is
// being published: the capture reconnects by itself (its loop never ends),
// and completes the stream with every row exactly once, adopting the
// rows the stream already holds in batches.
func TestBrokerRestartMidStream(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE items (id int PRIMARY KEY, pad text); ALTER TABLE items REPLICA IDENTITY FULL;
		INSERT INTO items SELECT i, repeat('p', 200) FROM generate_series(1, 40000) i`)
	cfg := func(c *Config) { c.MaxInFlight = 256 }
	svc := e.start(t, cfg)
	e.exec(t, `DELETE FROM items`)
	ctx := context.Background()
	st, err := e.js.Stream(ctx, event.StreamName("main"))
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		info, err := st.Info(ctx)
		return err == nil && info.State.Msgs > 2000
	}, 60*time.Second, 5*time.Millisecond)
	e.nats.Stop()
	require.Eventually(t, func() bool { return svc.healthy(ctx) != nil }, 30*time.Second, 5*time.Millisecond,
		"unready while the broker is down")
	require.Equal(t, 0.0, metricValue(t, svc.m.connected.WithLabelValues(linkBroker)))
	require.NoError(t, svc.live(ctx), "live while the broker is down")
	e.nats.Start()

	_, e.js = e.nats.Connect(t)
	st, err = e.js.Stream(ctx, event.StreamName("main"))
	require.NoError(t, err)
	info, err := st.Info(ctx)
	require.NoError(t, err)
	stored := info.State.Msgs
	// The restarted server counts API requests from its start: wait for
	// the whole stream counting this test's own (the two above, one stream
	// info per poll), so that what remains is the capture's.
	polls := uint64(0)
	require.Eventually(t, func() bool {
		polls++
		info, err := st.Info(ctx)
		return err == nil && info.State.Msgs >= 40000+1
	}, 180*time.Second, 50*time.Millisecond)
	after, err := e.js.AccountInfo(ctx)
	require.NoError(t, err)
	// The new session adopts the stored rows of the open transaction in
	// batches, not with one request per row: a few dozen API requests
	// (stream, object store, resume, the batches) for thousands of rows.
	requests := after.API.Total - 2 - polls
	t.Logf("the new session adopted %d stored messages with at most %d API requests", stored, requests)
	require.Greater(t, stored, uint64(2000))
	require.Less(t, requests, stored/10, "stored messages read one request each")
	requireStreamsAgain(t, svc)
	require.Equal(t, 1.0, metricValue(t, svc.m.connected.WithLabelValues(linkBroker)))
	ms := e.messages(t, "main", 40000+1)
	require.Len(t, ms, 40000+1)
	requireOnce(t, ms, 40000)
}

// TestSourceRestartMidStream restarts PostgreSQL while a big transaction is
// being published: the capture reconnects by itself (its loop never ends)
// and completes the stream with every row exactly once.
func TestSourceRestartMidStream(t *testing.T) {
	t.Parallel()
	pg := testenv.NewPostgres(t)
	db := pg.NewDatabase(t)
	e := &env{db: db, slot: "epitaph", nats: testenv.NewNATS(t), dir: t.TempDir()}
	_, e.js = e.nats.Connect(t)
	e.exec(t, `CREATE TABLE items (id int PRIMARY KEY, pad text); ALTER TABLE items REPLICA IDENTITY FULL;
		INSERT INTO items SELECT i, repeat('p', 200) FROM generate_series(1, 40000) i`)
	cfg := func(c *Config) { c.MaxInFlight = 256 }
	svc := e.start(t, cfg)
	e.exec(t, `DELETE FROM items`)
	ctx := context.Background()
	st, err := e.js.Stream(ctx, event.StreamName("main"))
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		info, err := st.Info(ctx)
		return err == nil && info.State.Msgs > 2000
	}, 60*time.Second, 5*time.Millisecond)
	require.NoError(t, pg.Stop())
	require.Eventually(t, func() bool { return svc.healthy(ctx) != nil }, 30*time.Second, 5*time.Millisecond,
		"unready while the source is down")
	require.NoError(t, svc.live(ctx), "live while the source is down")
	require.NoError(t, pg.Start())

	requireStreamsAgain(t, svc)
	ms := e.messages(t, "main", 40000+1)
	require.Len(t, ms, 40000+1)
	requireOnce(t, ms, 40000)
}

// TestRefusedUnacknowledgedMessageKeepsAPrefix: most row messages are
// published without asking for an acknowledgement. When the stream refuses
// one of them (here: at most 500 messages per subject, new ones discarded,
// so the 501st row of table a is refused while table b's subject would
// still take messages), every later message is refused on its expected last
// message id, the next acknowledged one fails and the capture stops with an
// error naming what it covered: the stream holds exactly the first 500
// messages, in order, and none of b's. Once the limit is lifted a restarted
// capture completes the stream with every row exactly once.
func TestRefusedUnacknowledgedMessageKeepsAPrefix(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE a (id int PRIMARY KEY, pad text); ALTER TABLE a REPLICA IDENTITY FULL;
		CREATE TABLE b (id int PRIMARY KEY, pad text); ALTER TABLE b REPLICA IDENTITY FULL;
		INSERT INTO a SELECT i, repeat('p', 50) FROM generate_series(1, 600) i;
		INSERT INTO b SELECT i, repeat('p', 50) FROM generate_series(1, 400) i`)
	ctx := context.Background()
	sc := jetstream.StreamConfig{
		Name:                 event.StreamName("main"),
		Subjects:             []string{event.StreamSubjects("main")},
		Storage:              jetstream.FileStorage,
		Duplicates:           2 * time.Minute,
		MaxMsgsPerSubject:    500,
		Discard:              jetstream.DiscardNew,
		DiscardNewPerSubject: true,
		Metadata:             map[string]string{MetaPartitions: "4", MetaSource: "main", MetaWireVersion: "1"},
	}
	st, err := e.js.CreateStream(ctx, sc)
	require.NoError(t, err)

	svc := e.start(t, nil)
	e.exec(t, `BEGIN; DELETE FROM a; DELETE FROM b; COMMIT`) // one transaction: 1000 rows and a commit
	err = waitEnded(t, svc)
	require.Error(t, err)
	t.Logf("capture stopped with: %v", err)
	// Either the acknowledged message that covered the refused one fails
	// on the broken chain, and names what it covered; or (the broken chain
	// looks like another writer's message, so the capture starts a new
	// session, adopts the stored prefix and publishes one at a time) the
	// refused message itself fails with the limit.
	require.Regexp(t, `acknowledging it and the \d+ messages before it|maximum messages per subject exceeded`, err.Error())

	info, err := st.Info(ctx)
	require.NoError(t, err)
	require.Equal(t, uint64(500), info.State.Msgs, "nothing after the refused message, not even b's rows")
	ms := e.messages(t, "main", 500)
	require.Len(t, ms, 500)
	for i, m := range ms {
		require.Equal(t, uint64(i+1), m.seq)
		require.Equal(t, "public.a", m.ev.QualifiedTable())
		require.Equal(t, i, m.ev.Seq, "the stream is a prefix of what was sent, in order")
	}

	sc.MaxMsgsPerSubject = -1
	sc.DiscardNewPerSubject = false
	sc.Discard = jetstream.DiscardOld
	sc.DenyPurge = true // the capture set it, and it cannot be cancelled
	_, err = e.js.UpdateStream(ctx, sc)
	require.NoError(t, err)
	e.start(t, nil)
	ms = e.messages(t, "main", 1000+1)
	require.Len(t, ms, 1000+1)
	requireOnce(t, ms, 1000)
	for i, m := range ms[:1000] {
		require.Equal(t, i, m.ev.Seq)
	}
	require.Equal(t, event.OpCommit, ms[1000].ev.Op)
}
