package broker_test

import (
	"bytes"
	"context"
	"errors"
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
	"github.com/nats-io/nkeys"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/broker"
	"github.com/epitaph-dev/epitaph/internal/natsconn"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

func startAuth(t *testing.T, dir string) *broker.Server {
	t.Helper()
	port, err := testenv.FreePort()
	require.NoError(t, err)
	s, err := broker.Start(broker.Config{
		StoreDir: filepath.Join(dir, "jetstream"), Listen: "127.0.0.1:" + strconv.Itoa(port),
		Auth: &broker.Auth{Dir: filepath.Join(dir, "nats"), Source: "main"},
	})
	require.NoError(t, err)
	t.Cleanup(s.Shutdown)
	return s
}

// short bounds a call the server refuses: a refused publish gets no
// acknowledgement, only an asynchronous permissions error.
func short(t *testing.T, ctx context.Context) context.Context {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// violations collects the permission errors the server sends a connection.
type violations struct {
	mu   sync.Mutex
	errs []string
}

func (v *violations) handler(_ *nats.Conn, _ *nats.Subscription, err error) {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.errs = append(v.errs, err.Error())
}

func (v *violations) has(sub string) bool {
	v.mu.Lock()
	defer v.mu.Unlock()
	for _, e := range v.errs {
		if strings.Contains(e, "ermissions") && strings.Contains(e, sub) {
			return true
		}
	}
	return false
}

// TestEmbeddedServerRequiresCredentials: the capture's embedded server
// refuses a client without credentials; the projector's credentials are
// refused a publish to the stream's subjects (the stream is unchanged) and
// to the object store, while they can do everything a projector does
// (stream info, message gets, direct gets, a durable consumer's fetch and
// ack, deleting it, reading an object); the capture's credentials publish.
func TestEmbeddedServerRequiresCredentials(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dir := t.TempDir()
	s := startAuth(t, dir)

	for _, f := range []string{s.CaptureCreds(), s.ProjectorCreds(), s.EraseCreds()} {
		st, err := os.Stat(f)
		require.NoError(t, err)
		require.Equal(t, os.FileMode(0o600), st.Mode().Perm(), f)
	}
	// The file tells other NATS tools where its user takes replies.
	raw, err := os.ReadFile(s.ProjectorCreds())
	require.NoError(t, err)
	require.Contains(t, string(raw), "--inbox-prefix _INBOX.projector;")
	st, err := os.Stat(filepath.Join(dir, "nats"))
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o700), st.Mode().Perm())
	entries, err := os.ReadDir(filepath.Join(dir, "nats"))
	require.NoError(t, err)
	for _, e := range entries {
		info, err := e.Info()
		require.NoError(t, err)
		require.Equal(t, os.FileMode(0o600), info.Mode().Perm(), e.Name())
	}

	// No credentials: refused at connect.
	_, err = nats.Connect(s.ClientURL())
	require.ErrorIs(t, err, nats.ErrAuthorization)
	// A user/password or a token the server does not know: refused too.
	_, err = nats.Connect(s.ClientURL(), nats.UserInfo("capture", "capture"))
	require.ErrorIs(t, err, nats.ErrAuthorization)

	// The capture's credentials: make the stream and an object, publish.
	cnc, err := nats.Connect(s.ClientURL(), natsconn.UserCredentials(s.CaptureCreds()))
	require.NoError(t, err)
	defer cnc.Close()
	cjs, err := jetstream.New(cnc)
	require.NoError(t, err)
	stream, err := cjs.CreateStream(ctx, jetstream.StreamConfig{Name: "EPITAPH_MAIN", Subjects: []string{"epitaph.main.>"}, Storage: jetstream.FileStorage, AllowDirect: false})
	require.NoError(t, err)
	_, err = cjs.Publish(ctx, "epitaph.main.0.commit", []byte(`{"v":1,"op":"commit"}`))
	require.NoError(t, err)
	_, err = cjs.Publish(short(t, ctx), "epitaph.other.0.commit", []byte(`x`))
	require.Error(t, err, "the capture publishes only its own source's subjects")
	obs, err := cjs.CreateObjectStore(ctx, jetstream.ObjectStoreConfig{Bucket: event.RowBucket("main"), Storage: jetstream.FileStorage})
	require.NoError(t, err)
	_, err = obs.PutBytes(ctx, "big", bytes.Repeat([]byte("r"), 300_000))
	require.NoError(t, err)

	// The projector's credentials: everything a projector reads...
	var v violations
	pnc, err := nats.Connect(s.ClientURL(), natsconn.UserCredentials(s.ProjectorCreds()), nats.ErrorHandler(v.handler))
	require.NoError(t, err)
	defer pnc.Close()
	pjs, err := jetstream.New(pnc)
	require.NoError(t, err)
	pstream, err := pjs.Stream(ctx, "EPITAPH_MAIN")
	require.NoError(t, err)
	msg, err := pstream.GetMsg(ctx, 1)
	require.NoError(t, err)
	require.Equal(t, `{"v":1,"op":"commit"}`, string(msg.Data))
	last, err := pstream.GetLastMsgForSubject(ctx, "epitaph.main.0.>")
	require.NoError(t, err)
	require.Equal(t, uint64(1), last.Sequence)
	cons, err := pstream.CreateConsumer(ctx, jetstream.ConsumerConfig{Durable: "g_archive-v1-p0", FilterSubject: "epitaph.main.0.>", AckPolicy: jetstream.AckAllPolicy})
	require.NoError(t, err)
	batch, err := cons.Fetch(10, jetstream.FetchMaxWait(5*time.Second))
	require.NoError(t, err)
	var got []string
	for m := range batch.Messages() {
		got = append(got, string(m.Data()))
		require.NoError(t, m.DoubleAck(ctx))
	}
	require.NoError(t, batch.Error())
	require.Equal(t, []string{`{"v":1,"op":"commit"}`}, got)
	ci, err := cons.Info(ctx)
	require.NoError(t, err)
	require.Equal(t, uint64(1), ci.AckFloor.Stream, "the ack was accepted")
	pobs, err := pjs.ObjectStore(ctx, event.RowBucket("main"))
	require.NoError(t, err)
	big, err := pobs.GetBytes(ctx, "big")
	require.NoError(t, err)
	require.Equal(t, bytes.Repeat([]byte("r"), 300_000), big)
	require.NoError(t, pstream.DeleteConsumer(ctx, "g_archive-v1-p0"))

	// ... and nothing it may not write.
	_, err = pjs.Publish(short(t, ctx), "epitaph.main.0.delete.public.items", []byte(`{"v":1,"op":"delete"}`))
	require.Error(t, err, "a projector publishing to the stream")
	require.NoError(t, pnc.Publish("epitaph.main.0.commit", []byte(`forged`)))
	_, err = pobs.PutBytes(short(t, ctx), "forged", []byte("x"))
	require.Error(t, err, "a projector writing an object")
	err = pjs.DeleteStream(short(t, ctx), "EPITAPH_MAIN")
	require.Error(t, err, "a projector deleting the stream")
	require.NoError(t, pnc.Flush())
	require.Eventually(t, func() bool { return v.has("epitaph.main.0.commit") }, 30*time.Second, 20*time.Millisecond,
		"the server reports the refused publish")

	// The writer never removes: no message delete, no purge, no stream
	// delete with the capture's credentials; putting an object again (the
	// object store purges the old chunks) still works.
	require.Error(t, stream.DeleteMsg(short(t, ctx), 1), "the capture deleting a message")
	require.Error(t, stream.SecureDeleteMsg(short(t, ctx), 1), "the capture erasing a message")
	require.Error(t, stream.Purge(short(t, ctx)), "the capture purging its stream")
	require.Error(t, cjs.DeleteStream(short(t, ctx), "EPITAPH_MAIN"), "the capture deleting its stream")
	_, err = obs.PutBytes(ctx, "big", bytes.Repeat([]byte("s"), 300_000))
	require.NoError(t, err, "an object put again")

	// A running projector's credentials delete no message (a delete before
	// every target applied it would be silent loss to the others): the
	// server refuses $JS.API.STREAM.MSG.DELETE, plain or secure.
	ack, err := cjs.Publish(ctx, "epitaph.main.0.delete.public.items", []byte(`{"v":1,"op":"delete"}`))
	require.NoError(t, err)
	require.Error(t, pstream.DeleteMsg(short(t, ctx), ack.Sequence), "the projector deleting a message")
	require.Error(t, pstream.SecureDeleteMsg(short(t, ctx), ack.Sequence), "the projector erasing a message")
	stored, err := stream.GetMsg(ctx, ack.Sequence)
	require.NoError(t, err, "still stored")
	require.Equal(t, `{"v":1,"op":"delete"}`, string(stored.Data))

	// projector erase --purge-stream, with the erase credentials: it may
	// securely delete a message, and read what it reads to find it.
	enc, err := nats.Connect(s.ClientURL(), natsconn.UserCredentials(s.EraseCreds()))
	require.NoError(t, err)
	defer enc.Close()
	ejs, err := jetstream.New(enc)
	require.NoError(t, err)
	estream, err := ejs.Stream(ctx, "EPITAPH_MAIN")
	require.NoError(t, err)
	stored, err = estream.GetMsg(ctx, ack.Sequence)
	require.NoError(t, err)
	require.Equal(t, `{"v":1,"op":"delete"}`, string(stored.Data))
	require.NoError(t, estream.SecureDeleteMsg(ctx, ack.Sequence))
	_, err = stream.GetMsg(ctx, ack.Sequence)
	require.ErrorIs(t, err, jetstream.ErrMsgNotFound)
	_, err = ejs.Publish(short(t, ctx), "epitaph.main.0.commit", []byte(`forged`))
	require.Error(t, err, "the erase credentials publishing to the stream")
	require.Error(t, estream.Purge(short(t, ctx)), "the erase credentials purging the stream")
	require.Error(t, ejs.DeleteStream(short(t, ctx), "EPITAPH_MAIN"), "the erase credentials deleting the stream")

	// Holders of the running roles' real credentials try, each at once,
	// what the role may not do (another target's consumer is the victim):
	// the server refuses every attempt, and the stream and the consumer
	// stay as they were.
	victim, err := pstream.CreateConsumer(ctx, jetstream.ConsumerConfig{Durable: "other_archive-v1-p0", FilterSubject: "epitaph.main.0.>", AckPolicy: jetstream.AckAllPolicy})
	require.NoError(t, err)
	proj := testenv.NewAttacker(t, s.ClientURL(), natsconn.UserCredentials(s.ProjectorCreds()))
	proj.RequireRefused(t, ctx, proj.ProjectorAttempts("main", "other_archive-v1-p0", 1))
	capt := testenv.NewAttacker(t, s.ClientURL(), natsconn.UserCredentials(s.CaptureCreds()))
	capt.RequireRefused(t, ctx, capt.CaptureAttempts("main", "other_archive-v1-p0", 1))
	// Each role reads only its own inboxes: not every client's, not
	// another role's, not the acknowledgements or consumer advisories
	// (their subjects name consumers).
	proj.RequireRefused(t, ctx, proj.SnoopAttempts("main", broker.CaptureUser))
	capt.RequireRefused(t, ctx, capt.SnoopAttempts("main", broker.ProjectorUser))
	erase := testenv.NewAttacker(t, s.ClientURL(), natsconn.UserCredentials(s.EraseCreds()))
	erase.RequireRefused(t, ctx, erase.SnoopAttempts("main", broker.ProjectorUser))
	vi, err := victim.Info(ctx)
	require.NoError(t, err)
	require.Equal(t, uint64(1), vi.NumPending, "the other target's consumer still has the message pending")
	require.False(t, vi.Paused, "not paused")

	info, err := stream.Info(ctx)
	require.NoError(t, err)
	require.Equal(t, uint64(1), info.State.Msgs, "only the capture's message is in the stream")
	require.False(t, info.Config.AllowRollup, "no roll-ups allowed")
	msg, err = stream.GetMsg(ctx, 1)
	require.NoError(t, err)
	require.Equal(t, `{"v":1,"op":"commit"}`, string(msg.Data))
	_, err = obs.GetInfo(ctx, "forged")
	require.True(t, errors.Is(err, jetstream.ErrObjectNotFound), "%v", err)
}

// TestEmbeddedServerKeepsIdentities: a restart keeps the keys and the
// credentials files byte for byte (a running projector keeps its file),
// and the stream made before survives.
func TestEmbeddedServerKeepsIdentities(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dir := t.TempDir()
	s := startAuth(t, dir)
	before := map[string][]byte{}
	entries, err := os.ReadDir(filepath.Join(dir, "nats"))
	require.NoError(t, err)
	require.Len(t, entries, 6, "operator, system account, account, three creds")
	for _, e := range entries {
		b, err := os.ReadFile(filepath.Join(dir, "nats", e.Name()))
		require.NoError(t, err)
		before[e.Name()] = b
	}
	nc, err := nats.Connect(s.ClientURL(), natsconn.UserCredentials(s.CaptureCreds()))
	require.NoError(t, err)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	_, err = js.CreateStream(ctx, jetstream.StreamConfig{Name: "EPITAPH_MAIN", Subjects: []string{"epitaph.main.>"}, Storage: jetstream.FileStorage})
	require.NoError(t, err)
	_, err = js.Publish(ctx, "epitaph.main.0.mark", []byte(`kept`))
	require.NoError(t, err)
	nc.Close()
	s.Shutdown()

	s = startAuth(t, dir)
	for name, b := range before {
		now, err := os.ReadFile(filepath.Join(dir, "nats", name))
		require.NoError(t, err)
		require.Equal(t, b, now, name)
	}
	nc, err = nats.Connect(s.ClientURL(), natsconn.UserCredentials(s.ProjectorCreds()))
	require.NoError(t, err)
	defer nc.Close()
	js, err = jetstream.New(nc)
	require.NoError(t, err)
	stream, err := js.Stream(ctx, "EPITAPH_MAIN")
	require.NoError(t, err)
	m, err := stream.GetMsg(ctx, 1)
	require.NoError(t, err)
	require.Equal(t, "kept", string(m.Data))
}

// TestTargetCredentialsAreKeptCurrent: a target's credentials file
// (capture creds --target) written with other permissions than the
// projector's, signed by the account, is brought to the projector's
// permissions with the target's own inboxes at the next start, keeping its
// key; the running broker accepts a file written while it runs. A target
// name that is not one subject token is refused.
func TestTargetCredentialsAreKeptCurrent(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dir := t.TempDir()
	creds := filepath.Join(dir, "nats")
	s := startAuth(t, dir)
	require.Error(t, broker.WriteTargetCreds(creds, "main", "a.b", broker.TargetCreds(creds, "x")))
	require.ErrorContains(t, broker.WriteTargetCreds(t.TempDir(), "main", "crm", filepath.Join(t.TempDir(), "c")), "no embedded broker keys")
	path := broker.TargetCreds(creds, "crm")
	require.NoError(t, broker.WriteTargetCreds(creds, "main", "crm", path))
	nc, err := nats.Connect(s.ClientURL(), natsconn.UserCredentials(path))
	require.NoError(t, err)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	_, err = js.AccountInfo(ctx)
	require.NoError(t, err, "accepted by the running broker")
	nc.Close()

	// Rewrite it as an older release would have: subscribing to _INBOX.>.
	raw, err := os.ReadFile(path)
	require.NoError(t, err)
	user, err := jwt.ParseDecoratedNKey(raw)
	require.NoError(t, err)
	pub, err := user.PublicKey()
	require.NoError(t, err)
	seed, err := user.Seed()
	require.NoError(t, err)
	accSeed, err := os.ReadFile(filepath.Join(creds, "account.nk"))
	require.NoError(t, err)
	account, err := nkeys.FromSeed(bytes.TrimSpace(accSeed))
	require.NoError(t, err)
	uc := jwt.NewUserClaims(pub)
	uc.Name = broker.TargetUser("crm")
	uc.Permissions = broker.ProjectorPermissions("main", broker.TargetUser("crm"))
	uc.Sub.Allow = jwt.StringList{"_INBOX.>"}
	tok, err := uc.Encode(account)
	require.NoError(t, err)
	old, err := jwt.FormatUserConfig(tok, seed)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(path, old, 0o644))

	s.Shutdown()
	startAuth(t, dir)
	raw, err = os.ReadFile(path)
	require.NoError(t, err)
	tok, err = jwt.ParseDecoratedJWT(raw)
	require.NoError(t, err)
	got, err := jwt.DecodeUserClaims(tok)
	require.NoError(t, err)
	require.Equal(t, pub, got.Subject, "the same key")
	require.Equal(t, "projector_crm", got.Name)
	require.Equal(t, jwt.StringList{"_INBOX.projector_crm.>"}, got.Sub.Allow)
	require.Equal(t, broker.ProjectorPermissions("main", "projector_crm").Pub, got.Pub)
	st, err := os.Stat(path)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), st.Mode().Perm())
}

// TestEmbeddedServerAdoptsUnauthenticatedData: a data dir written by an
// embedded server without authentication (before it required it) keeps its
// stream when the server starts with credentials.
func TestEmbeddedServerAdoptsUnauthenticatedData(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dir := t.TempDir()
	n := testenv.NewNATSWith(t, broker.Config{StoreDir: filepath.Join(dir, "jetstream")})
	nc, js := n.Connect(t)
	_, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "EPITAPH_MAIN", Subjects: []string{"epitaph.main.>"}, Storage: jetstream.FileStorage})
	require.NoError(t, err)
	_, err = js.Publish(ctx, "epitaph.main.0.mark", []byte(`old`))
	require.NoError(t, err)
	nc.Close()
	n.Stop()

	s := startAuth(t, dir)
	pnc, err := nats.Connect(s.ClientURL(), natsconn.UserCredentials(s.ProjectorCreds()))
	require.NoError(t, err)
	defer pnc.Close()
	pjs, err := jetstream.New(pnc)
	require.NoError(t, err)
	stream, err := pjs.Stream(ctx, "EPITAPH_MAIN")
	require.NoError(t, err)
	m, err := stream.GetMsg(ctx, 1)
	require.NoError(t, err)
	require.Equal(t, "old", string(m.Data))
}
