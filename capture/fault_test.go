package capture

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// waitEnded waits for the capture loop to end on its own and returns its
// error.
func waitEnded(t *testing.T, svc *Service) error {
	t.Helper()
	select {
	case <-svc.done:
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
	e.start(t, cfg)
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
	e := &env{db: db, slot: "epitaph", nats: testenv.NewNATS(t)}
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
