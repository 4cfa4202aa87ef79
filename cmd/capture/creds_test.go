package main

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/broker"
	"github.com/epitaph-dev/epitaph/internal/natsconn"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// capture creds --target writes, while the embedded broker runs, a 0600
// credentials file the broker accepts at once: the user projector_<target>
// may use JetStream through its own inboxes and may not read any other
// client's. Nothing of the file is printed; a second run keeps its key;
// a bad target or a data directory without keys is refused; --revoke
// removes the file, and the running broker closes the connection made with
// it and refuses its key within seconds, and after a restart too.
func TestCredsCommandWritesATargetsCredentials(t *testing.T) {
	t.Parallel()
	data := t.TempDir()
	dir := filepath.Join(data, "nats")
	n := testenv.NewNATSWith(t, broker.Config{Auth: &broker.Auth{Dir: dir, Source: "main"}})

	_, stderr, code := exec(nil, "creds", "--data-dir", data)
	require.Equal(t, 2, code, stderr)
	require.Contains(t, stderr, "--target is required")
	_, stderr, code = exec(nil, "creds", "--data-dir", data, "--target", "a.b")
	require.Equal(t, 2, code, stderr)
	require.Contains(t, stderr, `target "a.b"`)
	_, stderr, code = exec(nil, "creds", "--data-dir", t.TempDir(), "--target", "crm")
	require.Equal(t, 1, code, stderr)
	require.Contains(t, stderr, "no embedded broker keys")

	stdout, stderr, code := exec(nil, "creds", "--data-dir", data, "--target", "crm")
	require.Equal(t, 0, code, stderr)
	path := broker.TargetCreds(dir, "crm")
	require.Contains(t, stdout, "wrote "+path+": NATS user projector_crm (source main)")
	st, err := os.Stat(path)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), st.Mode().Perm())
	raw, err := os.ReadFile(path)
	require.NoError(t, err)
	for _, line := range strings.Split(string(raw), "\n") {
		if line = strings.TrimSpace(line); len(line) > 20 && !strings.HasPrefix(line, "-----") {
			require.NotContains(t, stdout+stderr, line, "a credential's content in the output")
		}
	}
	name, pub := testenv.CredsUser(t, path)
	require.Equal(t, "projector_crm", name)

	// Accepted by the running broker, through the user's own inboxes.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	att := testenv.NewAttacker(t, n.URL, natsconn.UserCredentials(path))
	require.True(t, strings.HasPrefix(att.NC.NewInbox(), "_INBOX.projector_crm."), att.NC.NewInbox())
	_, err = att.JS.AccountInfo(ctx)
	require.NoError(t, err)
	att.RequireRefused(t, ctx, att.SnoopAttempts("main", broker.ProjectorUser))

	// Again: the same key; --out elsewhere.
	_, stderr, code = exec(nil, "creds", "--data-dir", data, "--target", "crm")
	require.Equal(t, 0, code, stderr)
	_, again := testenv.CredsUser(t, path)
	require.Equal(t, pub, again)
	out := filepath.Join(t.TempDir(), "crm.creds")
	_, stderr, code = exec(nil, "creds", "--data-dir", data, "--target", "crm", "--out", out)
	require.Equal(t, 0, code, stderr)
	name, _ = testenv.CredsUser(t, out)
	require.Equal(t, "projector_crm", name)

	// --revoke: the file is gone; within seconds the running broker closes
	// the connection made with it and refuses its key, as it does after a
	// restart, while the other file (another key) still gets in, and
	// credentials written again (a new key) do.
	stolen := filepath.Join(t.TempDir(), "stolen.creds")
	raw, err = os.ReadFile(path)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(stolen, raw, 0o600))
	// A connection made with a copy (the file is removed), subscribed.
	thief, err := nats.Connect(n.URL, natsconn.UserCredentials(stolen), nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {}))
	require.NoError(t, err)
	defer thief.Close()
	_, err = thief.SubscribeSync(thief.NewInbox())
	require.NoError(t, err)
	stdout, stderr, code = exec(nil, "creds", "--data-dir", data, "--target", "crm", "--revoke")
	require.Equal(t, 0, code, stderr)
	require.Contains(t, stdout, "revoked "+path+": a running capture's embedded broker refuses it within seconds")
	_, err = os.Stat(path)
	require.ErrorIs(t, err, os.ErrNotExist)
	_, stderr, code = exec(nil, "creds", "--data-dir", data, "--target", "crm", "--revoke")
	require.Equal(t, 1, code, stderr)
	require.Contains(t, stderr, "no credentials file")
	// Cut off, and its reconnects refused until the client gives up.
	require.Eventually(t, thief.IsClosed, 20*time.Second, 50*time.Millisecond,
		"the connection made with the revoked credentials: %v", thief.Status())
	require.ErrorIs(t, thief.LastError(), nats.ErrAuthorization)
	require.Eventually(t, func() bool {
		nc, err := nats.Connect(n.URL, natsconn.UserCredentials(stolen), nats.NoReconnect())
		if err == nil {
			nc.Close()
		}
		return errors.Is(err, nats.ErrAuthorization)
	}, 10*time.Second, 100*time.Millisecond, "the revoked credentials, without a restart")
	nc, err := nats.Connect(n.URL, natsconn.UserCredentials(out))
	require.NoError(t, err, "the other file, without a restart")
	nc.Close()
	n.Restart()
	_, err = nats.Connect(n.URL, natsconn.UserCredentials(stolen))
	require.ErrorIs(t, err, nats.ErrAuthorization, "the revoked credentials, after a restart")
	nc, err = nats.Connect(n.URL, natsconn.UserCredentials(out))
	require.NoError(t, err, "the other file")
	nc.Close()
	_, stderr, code = exec(nil, "creds", "--data-dir", data, "--target", "crm")
	require.Equal(t, 0, code, stderr)
	_, fresh := testenv.CredsUser(t, path)
	require.NotEqual(t, pub, fresh)
	nc, err = nats.Connect(n.URL, natsconn.UserCredentials(path))
	require.NoError(t, err, "credentials written again")
	nc.Close()
}
