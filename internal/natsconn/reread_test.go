package natsconn_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nkeys"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/broker"
	"github.com/epitaph-dev/epitaph/internal/natsconn"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// logs records what a logger is given.
type logs struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *logs) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func (l *logs) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

func (l *logs) logger() *slog.Logger {
	return slog.New(slog.NewTextHandler(l, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// count is how many records of level whose message contains msg were logged.
func (l *logs) count(level slog.Level, msg string) int {
	n := 0
	for _, line := range strings.Split(l.String(), "\n") {
		if strings.Contains(line, "level="+level.String()+" ") && strings.Contains(line, msg) {
			n++
		}
	}
	return n
}

const (
	warnUnusable = "NATS credentials file cannot be used"
	infoReadBack = "NATS credentials file read again"
)

// reconnecting is a client that reconnects forever and counts its
// reconnects.
type reconnecting struct {
	nc         *nats.Conn
	reconnects atomic.Int64
}

func connectReconnecting(t *testing.T, url string, opts []nats.Option) *reconnecting {
	t.Helper()
	r := &reconnecting{}
	nc, err := nats.Connect(url, append([]nats.Option{nats.MaxReconnects(-1), nats.ReconnectWait(50 * time.Millisecond),
		nats.ReconnectHandler(func(*nats.Conn) { r.reconnects.Add(1) }),
		nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {})}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	r.nc = nc
	return r
}

// awaitReconnect waits until the client reconnected more than `after`
// times and is connected.
func (r *reconnecting) awaitReconnect(t *testing.T, after int64, why string) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); r.reconnects.Load() <= after || !r.nc.IsConnected(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) || r.nc.IsClosed() {
			t.Fatalf("%s: the client did not reconnect: %v, last error %v", why, r.nc.Status(), r.nc.LastError())
		}
	}
}

// requireWorks asks JetStream for the account's information: a request
// published with the client's credentials and answered on its inbox.
func requireWorks(t *testing.T, nc *nats.Conn) {
	t.Helper()
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = js.AccountInfo(ctx)
	require.NoError(t, err)
}

// credsSetup starts the embedded broker with authentication and writes
// the credentials of target "a" (user projector_a) to a file outside its
// directory, as an operator hands it to a projector.
func credsSetup(t *testing.T) (n *testenv.NATS, dir, path string, raw []byte) {
	t.Helper()
	dir = filepath.Join(t.TempDir(), "nats")
	n = testenv.NewNATSWith(t, broker.Config{Auth: &broker.Auth{Dir: dir, Source: "main"}})
	path = filepath.Join(t.TempDir(), "projector_a.creds")
	require.NoError(t, broker.WriteTargetCreds(dir, "main", "a", path))
	raw, err := os.ReadFile(path)
	require.NoError(t, err)
	return n, dir, path, raw
}

// requireNoSecret fails when out holds a line of the credentials file raw
// (its JWT or its seed).
func requireNoSecret(t *testing.T, out string, raw []byte) {
	t.Helper()
	for _, line := range strings.Split(string(raw), "\n") {
		if line = strings.TrimSpace(line); len(line) > 20 && !strings.HasPrefix(line, "-----") && !strings.HasPrefix(line, "#") {
			require.NotContains(t, out, line, "a credential's content in the log")
		}
	}
}

// TestCredsFileDeletedKeepsReconnecting: a client connected with
// --nats-creds whose file is then deleted reconnects after broker
// restarts with the credentials it read, and can publish; one WARN is
// logged for all those reconnects, and one INFO when the file is back.
func TestCredsFileDeletedKeepsReconnecting(t *testing.T) {
	t.Parallel()
	n, _, path, raw := credsSetup(t)
	var l logs
	opts, err := natsconn.Auth{CredsFile: path}.Options(n.URL, natsconn.WithLogger(l.logger()))
	require.NoError(t, err)
	c := connectReconnecting(t, n.URL, opts)
	requireWorks(t, c.nc)

	require.NoError(t, os.Remove(path))
	n.Restart()
	c.awaitReconnect(t, 0, "after a restart with the file deleted")
	requireWorks(t, c.nc)
	n.Restart()
	c.awaitReconnect(t, 1, "after a second restart with the file deleted")
	requireWorks(t, c.nc)
	require.Equal(t, 1, l.count(slog.LevelWarn, warnUnusable), l.String())
	require.Contains(t, l.String(), "file="+path)
	require.Contains(t, l.String(), "no such file or directory")
	require.Zero(t, l.count(slog.LevelInfo, infoReadBack), l.String())

	require.NoError(t, os.WriteFile(path, raw, 0o600))
	n.Restart()
	c.awaitReconnect(t, 2, "after a restart with the file back")
	requireWorks(t, c.nc)
	require.Equal(t, 1, l.count(slog.LevelInfo, infoReadBack), l.String())
	require.Equal(t, 1, l.count(slog.LevelWarn, warnUnusable), l.String())
	requireNoSecret(t, l.String(), raw)
}

// TestCredsFileRotatedIsUsedAtTheNextConnect: the file is removed (the
// client keeps reconnecting with what it read), then written again with
// a new key of the same user (credentials reissued); the old key is
// revoked, the broker closes the client's connection, and the client
// reconnects with the new key. Then the broker restarts, refusing the
// old key from its start, and the client gets in again.
func TestCredsFileRotatedIsUsedAtTheNextConnect(t *testing.T) {
	t.Parallel()
	n, dir, path, raw := credsSetup(t)
	_, oldKey := testenv.CredsUser(t, path)
	var l logs
	opts, err := natsconn.Auth{CredsFile: path}.Options(n.URL, natsconn.WithLogger(l.logger()))
	require.NoError(t, err)
	c := connectReconnecting(t, n.URL, opts)
	requireWorks(t, c.nc)
	old := filepath.Join(t.TempDir(), "old.creds")
	require.NoError(t, os.WriteFile(old, raw, 0o600))

	require.NoError(t, os.Remove(path))
	n.Restart()
	c.awaitReconnect(t, 0, "after a restart with the file deleted")
	requireWorks(t, c.nc)

	// Reissued: a new key of projector_a, written in place.
	require.NoError(t, broker.WriteTargetCreds(dir, "main", "a", path))
	name, newKey := testenv.CredsUser(t, path)
	require.Equal(t, "projector_a", name)
	require.NotEqual(t, oldKey, newKey)
	fresh, err := os.ReadFile(path)
	require.NoError(t, err)
	// The old key revoked: the running broker closes its connections.
	require.NoError(t, broker.RevokeTargetCreds(dir, old))
	c.awaitReconnect(t, 1, "after the old key is revoked")
	requireWorks(t, c.nc)
	require.Equal(t, 1, l.count(slog.LevelInfo, "NATS credentials file holds another key"), l.String())
	require.Contains(t, l.String(), "key="+newKey)
	n.Restart()
	c.awaitReconnect(t, 2, "after a restart that refuses the old key")
	requireWorks(t, c.nc)
	require.Equal(t, 1, l.count(slog.LevelWarn, warnUnusable), l.String())
	require.Equal(t, 1, l.count(slog.LevelInfo, infoReadBack), l.String())
	requireNoSecret(t, l.String(), raw)
	requireNoSecret(t, l.String(), fresh)
}

// TestCredsFileHalfWrittenKeepsReconnecting: a file cut anywhere (in its
// JWT, in its seed), or holding another user's credentials, is like a
// missing one: the client reconnects with the credentials it read, one
// WARN per kind of fault. UserCredentials, the option other Epitaph
// clients use, behaves as Auth.Options does.
func TestCredsFileHalfWrittenKeepsReconnecting(t *testing.T) {
	t.Parallel()
	n, dir, path, raw := credsSetup(t)
	var l logs
	c := connectReconnecting(t, n.URL, []nats.Option{natsconn.UserCredentials(path, natsconn.WithLogger(l.logger()))})
	requireWorks(t, c.nc)

	seedAt := bytes.Index(raw, []byte("-----BEGIN USER NKEY SEED-----"))
	seedEnd := bytes.Index(raw, []byte("------END USER NKEY SEED------"))
	require.Positive(t, seedAt)
	require.Greater(t, seedEnd, seedAt)
	// In the JWT, after it, at the seed's start and end, empty.
	cuts := []int{len(raw) / 4, seedAt - 40, seedAt + 40, seedEnd - 20, 0}
	for i, cut := range cuts {
		require.NoError(t, os.WriteFile(path, raw[:cut], 0o600))
		if i%2 == 0 {
			n.Restart()
		} else {
			require.NoError(t, c.nc.ForceReconnect())
		}
		c.awaitReconnect(t, int64(i), fmt.Sprintf("the file cut at %d of %d", cut, len(raw)))
		requireWorks(t, c.nc)
	}
	// One WARN per change of fault: no JWT, no seed (three cuts), no JWT.
	require.Equal(t, 3, l.count(slog.LevelWarn, warnUnusable), l.String())

	// Another user's file (its inboxes are not the connection's) is not used.
	other, err := os.ReadFile(broker.ProjectorCreds(dir))
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(path, other, 0o600))
	n.Restart()
	c.awaitReconnect(t, int64(len(cuts)), "another user's file")
	requireWorks(t, c.nc)
	require.True(t, strings.HasPrefix(c.nc.NewInbox(), "_INBOX.projector_a."))
	require.Equal(t, 4, l.count(slog.LevelWarn, warnUnusable), l.String())
	require.Contains(t, l.String(), `NATS user \"projector\", not \"projector_a\" whose inboxes this connection uses: restart to use it`)
	require.Zero(t, l.count(slog.LevelInfo, infoReadBack), l.String())
	requireNoSecret(t, l.String(), raw)
	requireNoSecret(t, l.String(), other)

	require.NoError(t, os.WriteFile(path, raw, 0o600))
	n.Restart()
	c.awaitReconnect(t, int64(len(cuts))+1, "the file whole again")
	requireWorks(t, c.nc)
	require.Equal(t, 1, l.count(slog.LevelInfo, infoReadBack), l.String())
}

// TestNkeyFileDeletedOrReplacedKeepsReconnecting: a client connected with
// --nats-nkey whose file is deleted, cut, or replaced with another user's
// seed, reconnects when the server closes its connection, as the user it
// started as (the server's connection list names it); one WARN per fault.
func TestNkeyFileDeletedOrReplacedKeepsReconnecting(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	user, err := nkeys.CreateUser()
	require.NoError(t, err)
	pub, err := user.PublicKey()
	require.NoError(t, err)
	seed, err := user.Seed()
	require.NoError(t, err)
	other, err := nkeys.CreateUser()
	require.NoError(t, err)
	otherPub, err := other.PublicKey()
	require.NoError(t, err)
	otherSeed, err := other.Seed()
	require.NoError(t, err)
	path := filepath.Join(dir, "user.nk")
	require.NoError(t, os.WriteFile(path, append(seed, '\n'), 0o600))

	port, err := testenv.FreePort()
	require.NoError(t, err)
	s, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: port, NoLog: true, NoSigs: true,
		Nkeys: []*server.NkeyUser{{Nkey: pub}, {Nkey: otherPub}}})
	require.NoError(t, err)
	go s.Start()
	t.Cleanup(s.Shutdown)
	require.True(t, s.ReadyForConnections(20*time.Second))
	url := fmt.Sprintf("nats://127.0.0.1:%d", port)

	var l logs
	opts, err := natsconn.Auth{NkeyFile: path}.Options(url, natsconn.WithLogger(l.logger()))
	require.NoError(t, err)
	c := connectReconnecting(t, url, opts)
	// kick closes the client's connection from the server and waits for
	// the client to be back, as pub.
	kick := func(after int64, why string) {
		t.Helper()
		connz, err := s.Connz(&server.ConnzOptions{Username: true})
		require.NoError(t, err)
		require.Len(t, connz.Conns, 1)
		require.NoError(t, s.DisconnectClientByID(connz.Conns[0].Cid))
		c.awaitReconnect(t, after, why)
		require.NoError(t, c.nc.FlushTimeout(10*time.Second))
		require.Eventually(t, func() bool {
			connz, err := s.Connz(&server.ConnzOptions{Username: true})
			return err == nil && len(connz.Conns) == 1 && connz.Conns[0].AuthorizedUser == pub
		}, 10*time.Second, 20*time.Millisecond, "%s: the client is not back as its user", why)
	}
	kick(0, "the file as it was")

	require.NoError(t, os.Remove(path))
	kick(1, "the file deleted")
	kick(2, "the file still deleted")
	require.Equal(t, 1, l.count(slog.LevelWarn, warnUnusable), l.String())
	require.NoError(t, os.WriteFile(path, seed[:len(seed)/2], 0o600))
	kick(3, "the file cut")
	require.NoError(t, os.WriteFile(path, otherSeed, 0o600))
	kick(4, "another user's seed")
	require.Equal(t, 3, l.count(slog.LevelWarn, warnUnusable), l.String())
	require.Contains(t, l.String(), "restart to use it")
	require.NoError(t, os.WriteFile(path, seed, 0o600))
	kick(5, "the file back")
	require.Equal(t, 1, l.count(slog.LevelInfo, infoReadBack), l.String())
	for _, secret := range [][]byte{seed, otherSeed, seed[:len(seed)/2]} {
		require.NotContains(t, l.String(), string(secret))
	}
}
