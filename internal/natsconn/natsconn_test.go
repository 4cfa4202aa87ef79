package natsconn_test

import (
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

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
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
