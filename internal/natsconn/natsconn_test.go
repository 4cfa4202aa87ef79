package natsconn_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nkeys"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/natsconn"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

func TestValidateRefusesContradictions(t *testing.T) {
	t.Parallel()
	cases := []struct {
		a    natsconn.Auth
		url  string
		want string // "" = valid
	}{
		{natsconn.Auth{}, "nats://h:4222", ""},
		{natsconn.Auth{CredsFile: "c"}, "nats://h:4222", ""},
		{natsconn.Auth{User: "u", PasswordFile: "p"}, "nats://h:4222", ""},
		{natsconn.Auth{CredsFile: "c", NkeyFile: "n"}, "nats://h", "NATS credentials given twice (--nats-creds, --nats-nkey)"},
		{natsconn.Auth{CredsFile: "c", User: "u", PasswordFile: "p"}, "nats://h", "NATS credentials given twice (--nats-creds, --nats-user)"},
		{natsconn.Auth{User: "u"}, "nats://h", "--nats-user needs --nats-password-file"},
		{natsconn.Auth{PasswordFile: "p"}, "nats://h", "--nats-password-file needs --nats-user"},
		{natsconn.Auth{TLSCert: "c"}, "nats://h", "--nats-tls-cert and --nats-tls-key go together"},
		{natsconn.Auth{TLSKey: "k"}, "nats://h", "--nats-tls-cert and --nats-tls-key go together"},
		{natsconn.Auth{TLSCA: "ca"}, "nats://h", ""},
		{natsconn.Auth{CredsFile: "c"}, "nats://tok@h:4222", "the NATS URL carries credentials and --nats-creds gives others"},
		{natsconn.Auth{NkeyFile: "n"}, "nats://a:4222,nats://u:p@b:4222", "the NATS URL carries credentials and --nats-nkey gives others"},
		{natsconn.Auth{}, "nats://tok@h:4222", ""},
	}
	for _, c := range cases {
		err := c.a.Validate(c.url)
		if c.want == "" {
			require.NoError(t, err, "%+v", c.a)
			continue
		}
		require.ErrorContains(t, err, c.want, "%+v", c.a)
		require.NotContains(t, err.Error(), "\n")
	}
}

func TestOptionsRefuseBadFiles(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	missing := filepath.Join(dir, "missing")
	notSeed := filepath.Join(dir, "not-seed")
	require.NoError(t, os.WriteFile(notSeed, []byte("SUsecretlookingbutwrong\n"), 0o600))
	empty := filepath.Join(dir, "empty")
	require.NoError(t, os.WriteFile(empty, []byte("\n"), 0o600))
	account, err := nkeys.CreateAccount()
	require.NoError(t, err)
	accSeed, err := account.Seed()
	require.NoError(t, err)
	accFile := filepath.Join(dir, "account.nk")
	require.NoError(t, os.WriteFile(accFile, accSeed, 0o600))
	for _, c := range []struct {
		a    natsconn.Auth
		want string
	}{
		{natsconn.Auth{CredsFile: missing}, "--nats-creds: open " + missing},
		{natsconn.Auth{NkeyFile: missing}, "--nats-nkey: open " + missing},
		{natsconn.Auth{NkeyFile: notSeed}, "--nats-nkey " + notSeed + ": not an nkey seed"},
		{natsconn.Auth{NkeyFile: accFile}, "not a user nkey seed (SU...)"},
		{natsconn.Auth{User: "u", PasswordFile: missing}, "--nats-password-file: open " + missing},
		{natsconn.Auth{User: "u", PasswordFile: empty}, "--nats-password-file " + empty + " is empty"},
		{natsconn.Auth{TLSCA: missing}, "--nats-tls-ca: open " + missing},
		{natsconn.Auth{TLSCert: missing, TLSKey: missing}, "--nats-tls-cert: open " + missing},
	} {
		_, err := c.a.Options("nats://127.0.0.1:4222")
		require.ErrorContains(t, err, c.want)
		require.NotContains(t, err.Error(), "secretlooking", "a secret file's content in an error")
		require.NotContains(t, err.Error(), string(accSeed))
	}
}

func startServer(t *testing.T, opts *server.Options) string {
	t.Helper()
	port, err := testenv.FreePort()
	require.NoError(t, err)
	opts.Host, opts.Port, opts.NoLog, opts.NoSigs = "127.0.0.1", port, true, true
	s, err := server.NewServer(opts)
	require.NoError(t, err)
	go s.Start()
	t.Cleanup(s.Shutdown)
	require.True(t, s.ReadyForConnections(20*time.Second))
	return fmt.Sprintf("nats://127.0.0.1:%d", port)
}

func connect(t *testing.T, url string, a natsconn.Auth) error {
	t.Helper()
	opts, err := a.Options(url)
	require.NoError(t, err)
	nc, err := nats.Connect(url, append(opts, nats.Timeout(5*time.Second))...)
	if err == nil {
		defer nc.Close()
		return nc.Flush()
	}
	return err
}

// TestOptionsAuthenticateToRealServers: a user with a password file and an
// nkey seed file get in, the wrong secret does not.
func TestOptionsAuthenticateToRealServers(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	pw := filepath.Join(dir, "pw")
	require.NoError(t, os.WriteFile(pw, []byte("s3cret\n"), 0o600))
	wrong := filepath.Join(dir, "wrong")
	require.NoError(t, os.WriteFile(wrong, []byte("nope"), 0o600))
	url := startServer(t, &server.Options{Users: []*server.User{{Username: "projector", Password: "s3cret"}}})
	require.NoError(t, connect(t, url, natsconn.Auth{User: "projector", PasswordFile: pw}))
	require.ErrorIs(t, connect(t, url, natsconn.Auth{User: "projector", PasswordFile: wrong}), nats.ErrAuthorization)
	require.ErrorIs(t, connect(t, url, natsconn.Auth{}), nats.ErrAuthorization)

	user, err := nkeys.CreateUser()
	require.NoError(t, err)
	pub, err := user.PublicKey()
	require.NoError(t, err)
	seed, err := user.Seed()
	require.NoError(t, err)
	seedFile := filepath.Join(dir, "user.nk")
	require.NoError(t, os.WriteFile(seedFile, append(seed, '\n'), 0o600))
	other, err := nkeys.CreateUser()
	require.NoError(t, err)
	otherSeed, err := other.Seed()
	require.NoError(t, err)
	otherFile := filepath.Join(dir, "other.nk")
	require.NoError(t, os.WriteFile(otherFile, otherSeed, 0o600))
	url = startServer(t, &server.Options{Nkeys: []*server.NkeyUser{{Nkey: pub}}})
	require.NoError(t, connect(t, url, natsconn.Auth{NkeyFile: seedFile}))
	require.ErrorIs(t, connect(t, url, natsconn.Auth{NkeyFile: otherFile}), nats.ErrAuthorization)
}

// TestOptionsVerifyTLS: with --nats-tls-ca the client verifies the server
// (and without it refuses the unknown certificate); a server that verifies
// clients admits the one with --nats-tls-cert/--nats-tls-key only.
func TestOptionsVerifyTLS(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	ca, caKey := makeCert(t, dir, "ca", nil, nil)
	makeCert(t, dir, "server", ca, caKey)
	makeCert(t, dir, "client", ca, caKey)
	tc, err := server.GenTLSConfig(&server.TLSConfigOpts{CertFile: filepath.Join(dir, "server.crt"), KeyFile: filepath.Join(dir, "server.key"),
		CaFile: filepath.Join(dir, "ca.crt"), Verify: true})
	require.NoError(t, err)
	url := startServer(t, &server.Options{TLS: true, TLSConfig: tc, TLSVerify: true, TLSTimeout: 2})
	caFile := filepath.Join(dir, "ca.crt")
	require.NoError(t, connect(t, url, natsconn.Auth{TLSCA: caFile, TLSCert: filepath.Join(dir, "client.crt"), TLSKey: filepath.Join(dir, "client.key")}))
	require.Error(t, connect(t, url, natsconn.Auth{TLSCA: caFile}), "no client certificate")
	require.Error(t, connect(t, url, natsconn.Auth{TLSCert: filepath.Join(dir, "client.crt"), TLSKey: filepath.Join(dir, "client.key")}),
		"the server's certificate is not trusted without the CA")
}

// makeCert writes name.crt and name.key under dir: a self-signed CA when
// parent is nil, else a certificate for 127.0.0.1 signed by it.
func makeCert(t *testing.T, dir, name string, parent *x509.Certificate, parentKey *ecdsa.PrivateKey) (*x509.Certificate, *ecdsa.PrivateKey) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour)}
	if parent == nil {
		tmpl.IsCA, tmpl.BasicConstraintsValid = true, true
		tmpl.KeyUsage = x509.KeyUsageCertSign
		parent, parentKey = tmpl, key
	} else {
		tmpl.IPAddresses = []net.IP{net.ParseIP("127.0.0.1")}
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}
		tmpl.KeyUsage = x509.KeyUsageDigitalSignature
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, &key.PublicKey, parentKey)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(dir, name+".crt"), pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600))
	kb, err := x509.MarshalECPrivateKey(key)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(dir, name+".key"), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb}), 0o600))
	cert, err := x509.ParseCertificate(der)
	require.NoError(t, err)
	return cert, key
}

// inboxOf is the inbox prefix the options of a give a client (with its
// trailing dot).
func inboxOf(t *testing.T, url string, a natsconn.Auth) string {
	t.Helper()
	opts, err := a.Options(url)
	require.NoError(t, err)
	o := nats.GetDefaultOptions()
	for _, opt := range opts {
		require.NoError(t, opt(&o))
	}
	if o.InboxPrefix == "" {
		return nats.InboxPrefix
	}
	return o.InboxPrefix + "."
}

// TestOptionsTakeTheUsersInboxes: a client named as a user (--nats-user,
// the URL's user, the name in a .creds file's JWT) takes its replies on
// _INBOX.<user>.>; with no user name, on _INBOX.>. A user name that
// cannot be one subject token is refused. On a server that lets the user
// subscribe to its own inboxes only, JetStream requests are answered.
func TestOptionsTakeTheUsersInboxes(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	pw := filepath.Join(dir, "pw")
	require.NoError(t, os.WriteFile(pw, []byte("s3cret\n"), 0o600))
	user, err := nkeys.CreateUser()
	require.NoError(t, err)
	seed, err := user.Seed()
	require.NoError(t, err)
	seedFile := filepath.Join(dir, "user.nk")
	require.NoError(t, os.WriteFile(seedFile, seed, 0o600))

	require.Equal(t, "_INBOX.projector_crm.", inboxOf(t, "nats://h:4222", natsconn.Auth{User: "projector_crm", PasswordFile: pw}))
	require.Equal(t, "_INBOX.capture.", inboxOf(t, "nats://capture:pw@h:4222", natsconn.Auth{}))
	require.Equal(t, "_INBOX.", inboxOf(t, "nats://tok@h:4222", natsconn.Auth{}))
	require.Equal(t, "_INBOX.", inboxOf(t, "nats://h:4222", natsconn.Auth{NkeyFile: seedFile}))
	require.Equal(t, "_INBOX.", inboxOf(t, "nats://h:4222", natsconn.Auth{}))
	_, err = natsconn.Auth{User: "a.b", PasswordFile: pw}.Options("nats://h:4222")
	require.ErrorContains(t, err, `NATS user "a.b" cannot name an inbox`)

	account, err := nkeys.CreateAccount()
	require.NoError(t, err)
	pub, err := user.PublicKey()
	require.NoError(t, err)
	uc := jwt.NewUserClaims(pub)
	uc.Name = "projector_crm"
	tok, err := uc.Encode(account)
	require.NoError(t, err)
	creds, err := jwt.FormatUserConfig(tok, seed)
	require.NoError(t, err)
	credsFile := filepath.Join(dir, "user.creds")
	require.NoError(t, os.WriteFile(credsFile, creds, 0o600))
	require.Equal(t, "_INBOX.projector_crm.", inboxOf(t, "nats://h:4222", natsconn.Auth{CredsFile: credsFile}))
	var o nats.Options
	require.NoError(t, natsconn.UserCredentials(credsFile)(&o))
	require.Equal(t, "_INBOX.projector_crm", o.InboxPrefix)
	notCreds := filepath.Join(dir, "not.creds")
	require.NoError(t, os.WriteFile(notCreds, []byte("SUsecretlookingbutwrong\n"), 0o600))
	_, err = natsconn.Auth{CredsFile: notCreds}.Options("nats://h:4222")
	require.ErrorContains(t, err, "not a NATS credentials file")
	require.NotContains(t, err.Error(), "secretlooking")

	// A server that lets each user subscribe to its own inboxes only.
	url := startServer(t, &server.Options{JetStream: true, StoreDir: t.TempDir(), Users: []*server.User{{Username: "projector_crm", Password: "s3cret",
		Permissions: &server.Permissions{
			Publish:   &server.SubjectPermission{Allow: []string{"$JS.API.>"}},
			Subscribe: &server.SubjectPermission{Allow: []string{"_INBOX.projector_crm.>"}}}}}})
	opts, err := natsconn.Auth{User: "projector_crm", PasswordFile: pw}.Options(url)
	require.NoError(t, err)
	nc, err := nats.Connect(url, opts...)
	require.NoError(t, err)
	defer nc.Close()
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = js.AccountInfo(ctx)
	require.NoError(t, err, "a JetStream request answered on the user's inbox")
}
