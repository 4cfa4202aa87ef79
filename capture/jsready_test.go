package capture

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// A broker that accepts connections before its JetStream answers (a server
// still starting it, as the embedded one under load: "no responders" to
// the first JetStream request) is waited for at start like a broker that
// is down, not a start that fails.
func TestStartWaitsForJetStreamToAnswer(t *testing.T) {
	t.Parallel()
	e := setup(t)
	port, err := testenv.FreePort()
	require.NoError(t, err)
	srv, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: port, NoLog: true, NoSigs: true})
	require.NoError(t, err)
	go srv.Start()
	require.True(t, srv.ReadyForConnections(10*time.Second))
	t.Cleanup(srv.Shutdown)

	cfg := e.config()
	cfg.NATSURL = fmt.Sprintf("nats://127.0.0.1:%d", port)
	svc := newService(t, cfg)
	started := make(chan error, 1)
	go func() { started <- svc.Start(context.Background()) }()
	select {
	case err := <-started:
		t.Fatalf("start returned while JetStream did not answer: %v", err)
	case <-time.After(2 * time.Second):
	}
	require.NoError(t, srv.EnableJetStream(&server.JetStreamConfig{StoreDir: t.TempDir()}))
	select {
	case err := <-started:
		require.NoError(t, err)
	case <-time.After(30 * time.Second):
		t.Fatal("start did not end once JetStream answered")
	}
}
