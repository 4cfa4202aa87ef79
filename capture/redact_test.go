package capture

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// Credentials the clients accept in forms the redaction did not know are
// still hidden from the log and /status: a NATS URL without its scheme
// (nats.go adds nats://) carrying user:password, a source URL whose
// query carries sslpassword (the passphrase of the client key, which pgx
// reads from the URL), and a source password with a '#' (pgx reads the
// password up to the '@'; net/url takes the rest for a fragment).
func TestCaptureHidesPasswordsInURLFormsTheClientsAccept(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE public.t (id int PRIMARY KEY); ALTER TABLE public.t REPLICA IDENTITY FULL`)
	sep := "?"
	if strings.Contains(e.db, "?") {
		sep = "&"
	}
	var logs syncBuffer
	cfg := e.config()
	cfg.NATSURL = "epitaph:nats-secret-4711@" + strings.TrimPrefix(e.nats.URL, "nats://")
	cfg.SourceURL = strings.Replace(e.db, "postgres://postgres@", "postgres://postgres:2024#db-secret-4713@", 1) + sep + "sslpassword=key-secret-4712"
	require.Contains(t, cfg.SourceURL, "db-secret-4713")
	svc, err := New(cfg, WithLogger(slog.New(slog.NewTextHandler(&logs, nil))))
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, svc.Stop(context.Background())) })
	require.NoError(t, svc.Start(context.Background()))
	st := svc.CurrentStatus()
	require.NotContains(t, st.NATSURL, "nats-secret-4711", "/status hides the NATS password")
	require.Contains(t, st.NATSURL, strings.TrimPrefix(e.nats.URL, "nats://"), "/status still names the server")
	for _, secret := range []string{"nats-secret-4711", "key-secret-4712", "db-secret-4713"} {
		require.NotContains(t, logs.String(), secret, "the log hides it:\n%s", logs.String())
	}
}
