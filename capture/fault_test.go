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

// TestBrokerRestartMidStream restarts JetStream while a big transaction is
// being published: the capture stops with an error (never skips), and a
// restarted capture completes the stream with every row exactly once.
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
	e.nats.Restart()
	err = waitEnded(t, svc)
	require.Error(t, err)
	t.Logf("capture stopped with: %v", err)

	_, e.js = e.nats.Connect(t)
	st, err = e.js.Stream(ctx, event.StreamName("main"))
	require.NoError(t, err)
	info, err := st.Info(ctx)
	require.NoError(t, err)
	stored := info.State.Msgs
	before, err := e.js.AccountInfo(ctx)
	require.NoError(t, err)
	e.start(t, cfg)
	// Wait for the whole stream counting this test's own API requests
	// (one stream info per poll), so that what remains is the capture's.
	polls := uint64(0)
	require.Eventually(t, func() bool {
		polls++
		info, err := st.Info(ctx)
		return err == nil && info.State.Msgs >= 40000+1
	}, 180*time.Second, 50*time.Millisecond)
	after, err := e.js.AccountInfo(ctx)
	require.NoError(t, err)
	// The restarted capture adopts the stored rows of the open transaction
	// in batches, not with one request per row: a few dozen API requests
	// (stream, object store, resume, the batches) for thousands of rows.
	requests := after.API.Total - before.API.Total - polls - 1
	t.Logf("the restart adopted %d stored messages with %d API requests", stored, requests)
	require.Greater(t, stored, uint64(2000))
	require.Less(t, requests, stored/10, "stored messages read one request each")
	ms := e.messages(t, "main", 40000+1)
	require.Len(t, ms, 40000+1)
	requireOnce(t, ms, 40000)
}

// TestSourceRestartMidStream restarts PostgreSQL while a big transaction is
// being published: the capture stops with an error, and a restarted capture
// completes the stream with every row exactly once.
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
	require.NoError(t, pg.Restart())
	err = waitEnded(t, svc)
	require.Error(t, err)
	t.Logf("capture stopped with: %v", err)

	e.start(t, cfg)
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
