package broker_test

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/broker"
	"github.com/epitaph-dev/epitaph/internal/natsconn"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// logRecorder keeps the records a server logs, as "LEVEL message attrs".
type logRecorder struct {
	mu   sync.Mutex
	recs []string
}

func (r *logRecorder) Enabled(context.Context, slog.Level) bool { return true }
func (r *logRecorder) WithAttrs([]slog.Attr) slog.Handler       { return r }
func (r *logRecorder) WithGroup(string) slog.Handler            { return r }
func (r *logRecorder) Handle(_ context.Context, rec slog.Record) error {
	line := rec.Level.String() + " " + rec.Message
	rec.Attrs(func(a slog.Attr) bool {
		line += " " + a.String()
		return true
	})
	r.mu.Lock()
	defer r.mu.Unlock()
	r.recs = append(r.recs, line)
	return nil
}

// count is how many records start with prefix.
func (r *logRecorder) count(prefix string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, l := range r.recs {
		if strings.HasPrefix(l, prefix) {
			n++
		}
	}
	return n
}

func (r *logRecorder) all() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return strings.Join(r.recs, "\n")
}

// startLogged starts an embedded server with credentials in dir/nats that
// logs to the returned recorder.
func startLogged(t *testing.T, dir string) (*broker.Server, *logRecorder) {
	t.Helper()
	port, err := testenv.FreePort()
	require.NoError(t, err)
	rec := &logRecorder{}
	s, err := broker.Start(broker.Config{
		StoreDir: filepath.Join(dir, "jetstream"), Listen: "127.0.0.1:" + strconv.Itoa(port),
		Auth:   &broker.Auth{Dir: filepath.Join(dir, "nats"), Source: "main"},
		Logger: slog.New(rec),
	})
	require.NoError(t, err)
	t.Cleanup(s.Shutdown)
	return s, rec
}

// asyncErrs collects the asynchronous errors of a connection.
type asyncErrs struct {
	mu   sync.Mutex
	errs []error
}

func (a *asyncErrs) handler(_ *nats.Conn, _ *nats.Subscription, err error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.errs = append(a.errs, err)
}

func (a *asyncErrs) has(target error) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, e := range a.errs {
		if errors.Is(e, target) {
			return true
		}
	}
	return false
}

// copyFile copies a credentials file (a stolen copy survives the revoke's
// removal of the original).
func copyFile(t *testing.T, from string) string {
	t.Helper()
	raw, err := os.ReadFile(from)
	require.NoError(t, err)
	to := filepath.Join(t.TempDir(), filepath.Base(from))
	require.NoError(t, os.WriteFile(to, raw, 0o600))
	return to
}

// requireRefused waits until a fresh connection with creds is refused
// (the running server applies revocations every two seconds).
func requireRefused(t *testing.T, url, creds, what string) {
	t.Helper()
	var err error
	require.Eventually(t, func() bool {
		var nc *nats.Conn
		nc, err = nats.Connect(url, natsconn.UserCredentials(creds), nats.NoReconnect())
		if err == nil {
			nc.Close()
			return false
		}
		return errors.Is(err, nats.ErrAuthorization)
	}, 10*time.Second, 100*time.Millisecond, "%s: still accepted (last: %v)", what, err)
}

// requireWorks connects with creds and reads the account's JetStream
// information.
func requireWorks(t *testing.T, ctx context.Context, url, creds, what string) {
	t.Helper()
	nc, err := nats.Connect(url, natsconn.UserCredentials(creds), nats.NoReconnect())
	require.NoError(t, err, what)
	defer nc.Close()
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	_, err = js.AccountInfo(ctx)
	require.NoError(t, err, what)
}

// TestRevokedCredentialsAreRefusedWhileRunning: a target consuming the
// stream with its credentials is cut off within seconds of
// RevokeTargetCreds, with no restart: its connection gets the revocation
// and is closed, and a fresh connection with a copy of the credentials is
// refused; another target, the projector and the capture keep their
// connections (consuming, publishing) and can connect again.
func TestRevokedCredentialsAreRefusedWhileRunning(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dir := t.TempDir()
	creds := filepath.Join(dir, "nats")
	s, logs := startLogged(t, dir)

	cnc, err := nats.Connect(s.ClientURL(), natsconn.UserCredentials(s.CaptureCreds()))
	require.NoError(t, err)
	defer cnc.Close()
	cjs, err := jetstream.New(cnc)
	require.NoError(t, err)
	_, err = cjs.CreateStream(ctx, jetstream.StreamConfig{Name: "EPITAPH_MAIN", Subjects: []string{"epitaph.main.>"}, Storage: jetstream.FileStorage})
	require.NoError(t, err)
	for i := range 3 {
		_, err = cjs.Publish(ctx, "epitaph.main.0.mark", []byte(strconv.Itoa(i)))
		require.NoError(t, err)
	}

	// consumer connects with creds, consumes one message and keeps a
	// subscription to its own inboxes.
	type consumer struct {
		nc   *nats.Conn
		cons jetstream.Consumer
		errs *asyncErrs
	}
	consume := func(creds, name string) consumer {
		errs := &asyncErrs{}
		nc, err := nats.Connect(s.ClientURL(), natsconn.UserCredentials(creds), nats.ErrorHandler(errs.handler))
		require.NoError(t, err, name)
		t.Cleanup(nc.Close)
		_, err = nc.SubscribeSync(nc.NewInbox() + ".watch")
		require.NoError(t, err, name)
		js, err := jetstream.New(nc)
		require.NoError(t, err)
		cons, err := js.CreateOrUpdateConsumer(ctx, "EPITAPH_MAIN", jetstream.ConsumerConfig{Name: name, AckPolicy: jetstream.AckExplicitPolicy})
		require.NoError(t, err, name)
		b, err := cons.Fetch(1, jetstream.FetchMaxWait(5*time.Second))
		require.NoError(t, err, name)
		n := 0
		for m := range b.Messages() {
			require.NoError(t, m.Ack())
			n++
		}
		require.NoError(t, b.Error(), name)
		require.Equal(t, 1, n, name)
		return consumer{nc: nc, cons: cons, errs: errs}
	}

	crmPath := broker.TargetCreds(creds, "crm")
	require.NoError(t, broker.WriteTargetCreds(creds, "main", "crm", crmPath))
	opsPath := broker.TargetCreds(creds, "ops")
	require.NoError(t, broker.WriteTargetCreds(creds, "main", "ops", opsPath))
	stolen := copyFile(t, crmPath)
	_, revokedPub := testenv.CredsUser(t, crmPath)
	crm := consume(crmPath, "crm")
	ops := consume(opsPath, "ops")
	proj := consume(s.ProjectorCreds(), "projector")

	start := time.Now()
	require.NoError(t, broker.RevokeTargetCreds(creds, crmPath))
	require.NoFileExists(t, crmPath)

	// The consuming connection is told and closed.
	require.Eventually(t, func() bool { return crm.errs.has(nats.ErrAuthRevoked) && !crm.nc.IsConnected() },
		10*time.Second, 50*time.Millisecond, "the revoked connection: %v, %v", crm.nc.Status(), crm.nc.LastError())
	cut := time.Since(start)
	requireRefused(t, s.ClientURL(), stolen, "the revoked credentials")
	t.Logf("revoked connection closed %v after RevokeTargetCreds", cut.Round(time.Millisecond))
	require.Equal(t, 1, logs.count("INFO embedded jetstream: revoked users refused"), logs.all())
	require.Contains(t, logs.all(), revokedPub)

	// The others keep their connections and their work.
	for _, c := range []consumer{ops, proj} {
		require.True(t, c.nc.IsConnected())
		require.False(t, c.errs.has(nats.ErrAuthRevoked))
		b, err := c.cons.Fetch(1, jetstream.FetchMaxWait(5*time.Second))
		require.NoError(t, err)
		n := 0
		for m := range b.Messages() {
			require.NoError(t, m.Ack())
			n++
		}
		require.NoError(t, b.Error())
		require.Equal(t, 1, n, "the next message")
	}
	require.True(t, cnc.IsConnected())
	_, err = cjs.Publish(ctx, "epitaph.main.0.mark", []byte("after"))
	require.NoError(t, err, "the capture publishes")
	requireWorks(t, ctx, s.ClientURL(), opsPath, "the other target")
	requireWorks(t, ctx, s.ClientURL(), s.ProjectorCreds(), "the projector")
	requireWorks(t, ctx, s.ClientURL(), s.CaptureCreds(), "the capture")
	requireWorks(t, ctx, s.ClientURL(), s.EraseCreds(), "the erase role")

	// Written again: a new key, accepted at once.
	require.NoError(t, broker.WriteTargetCreds(creds, "main", "crm", crmPath))
	requireWorks(t, ctx, s.ClientURL(), crmPath, "credentials written again")
}

// TestBadRevokedUsersFileKeepsRevocations: once the running server refuses
// a revoked key, a revoked users file it cannot parse (here with a seed
// pasted in), or its removal, keeps that key refused and is logged once
// as an ERROR, without the line's content; a key later taken off a valid
// file stays refused until the next start, while keys the file adds are
// refused at once.
func TestBadRevokedUsersFileKeepsRevocations(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dir := t.TempDir()
	creds := filepath.Join(dir, "nats")
	list := filepath.Join(creds, "revoked-users")
	s, logs := startLogged(t, dir)
	paths := map[string]string{}
	for _, target := range []string{"a", "b", "c"} {
		paths[target] = broker.TargetCreds(creds, target)
		require.NoError(t, broker.WriteTargetCreds(creds, "main", target, paths[target]))
	}
	stolenA := copyFile(t, paths["a"])
	_, pubA := testenv.CredsUser(t, paths["a"])
	_, pubB := testenv.CredsUser(t, paths["b"])
	require.NoError(t, broker.RevokeTargetCreds(creds, paths["a"]))
	requireRefused(t, s.ClientURL(), stolenA, "a")

	// A seed pasted in: not a public key.
	raw, err := os.ReadFile(paths["c"])
	require.NoError(t, err)
	kp, err := jwt.ParseDecoratedNKey(raw)
	require.NoError(t, err)
	seed, err := kp.Seed()
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(list, []byte(pubA+"\n"+string(seed)+"\n"), 0o600))
	const bad = "ERROR embedded jetstream: bad revoked users file"
	require.Eventually(t, func() bool { return logs.count(bad) == 1 }, 10*time.Second, 50*time.Millisecond, logs.all())
	require.Contains(t, logs.all(), "line 2 is not a user's public key")
	require.NotContains(t, logs.all(), string(seed), "a secret in the log")
	// Unchanged over several polls: logged once, a still refused.
	require.Never(t, func() bool { return logs.count(bad) > 1 }, 5*time.Second, 100*time.Millisecond, logs.all())
	requireRefused(t, s.ClientURL(), stolenA, "a, after a bad file")

	// Garbage of another kind: a new change, logged again.
	require.NoError(t, os.WriteFile(list, []byte("garbage\x00\xff\n"), 0o600))
	require.Eventually(t, func() bool { return logs.count(bad) == 2 }, 10*time.Second, 50*time.Millisecond, logs.all())
	requireRefused(t, s.ClientURL(), stolenA, "a, after garbage")

	// Gone.
	require.NoError(t, os.Remove(list))
	require.Eventually(t, func() bool {
		return logs.count("ERROR embedded jetstream: the revoked users file is gone") == 1
	}, 10*time.Second, 50*time.Millisecond, logs.all())
	requireRefused(t, s.ClientURL(), stolenA, "a, after the file's removal")

	// A valid file without a, with b: b is refused at once, a stays refused.
	stolenB := copyFile(t, paths["b"])
	require.NoError(t, os.WriteFile(list, []byte(pubB+"\n"), 0o600))
	requireRefused(t, s.ClientURL(), stolenB, "b")
	require.Eventually(t, func() bool {
		return logs.count("WARN embedded jetstream: users taken off the revoked users file stay refused") == 1
	}, 10*time.Second, 50*time.Millisecond, logs.all())
	requireRefused(t, s.ClientURL(), stolenA, "a, taken off the file")
	requireWorks(t, ctx, s.ClientURL(), paths["c"], "c")
}
