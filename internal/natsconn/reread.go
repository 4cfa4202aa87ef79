package natsconn

import (
	"bytes"
	"fmt"
	"log/slog"
	"os"
	"sync"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"
)

// Option is a setting of the options this package builds.
type Option func(*settings)

type settings struct{ log *slog.Logger }

// WithLogger logs to log when a credentials file cannot be used at a
// (re)connect and when it can again. Without it nothing is logged.
func WithLogger(log *slog.Logger) Option {
	return func(s *settings) { s.log = log }
}

func newSettings(opts []Option) settings {
	var s settings
	for _, o := range opts {
		o(&s)
	}
	if s.log == nil {
		s.log = slog.New(slog.DiscardHandler)
	}
	return s
}

// wipe overwrites a secret's bytes.
func wipe(b []byte) {
	for i := range b {
		b[i] = 'x'
	}
}

// userCreds is what a usable .creds file holds: a user JWT and the seed
// of the key it names.
type userCreds struct {
	jwt  string
	name string // the user's name in the JWT (its inboxes)
	pub  string // the user's public key
	seed []byte
}

// parseCreds checks the content of the .creds file path: a user JWT whose
// name can name an inbox, and the seed of that user's key. Errors name the
// file, never its content. raw is left as it is.
func parseCreds(path string, raw []byte) (userCreds, error) {
	tok, err := jwt.ParseDecoratedJWT(raw)
	if err != nil {
		return userCreds{}, fmt.Errorf("%s: not a NATS credentials file", path)
	}
	uc, err := jwt.DecodeUserClaims(tok)
	if err != nil {
		return userCreds{}, fmt.Errorf("%s: not a NATS credentials file (no user JWT)", path)
	}
	if err := checkUser(path, uc.Name); err != nil {
		return userCreds{}, err
	}
	kp, err := jwt.ParseDecoratedNKey(raw)
	if err != nil {
		return userCreds{}, fmt.Errorf("%s: not a NATS credentials file (no user nkey seed)", path)
	}
	defer kp.Wipe()
	pub, err := kp.PublicKey()
	if err != nil || pub != uc.Subject {
		return userCreds{}, fmt.Errorf("%s: not a NATS credentials file (the nkey seed is not the JWT's user's)", path)
	}
	seed, err := kp.Seed()
	if err != nil {
		return userCreds{}, fmt.Errorf("%s: not a NATS credentials file (no user nkey seed)", path)
	}
	return userCreds{jwt: tok, name: uc.Name, pub: pub, seed: bytes.Clone(seed)}, nil
}

// readCreds reads and parses the .creds file path, and wipes what it read.
func readCreds(path string) (userCreds, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return userCreds{}, err
	}
	defer wipe(raw)
	return parseCreds(path, raw)
}

// option authenticates with the file path, whose content at start is c:
// each connection reads the file at every (re)connect (credsSource).
func (c userCreds) option(path string, log *slog.Logger) nats.Option {
	return func(o *nats.Options) error {
		src := &credsSource{reread: reread{path: path, log: log}, cur: c}
		src.cur.seed = bytes.Clone(c.seed)
		return nats.UserJWT(src.userJWT, src.sign)(o)
	}
}

// reread is the state of a secret file read at every connect: when it
// cannot be used, the connection keeps what it read last, and the first
// failure of a kind is logged (a WARN), as is the next good read (INFO);
// not every reconnect.
type reread struct {
	path string
	log  *slog.Logger
	mu   sync.Mutex
	// failed is the error last logged, "" while the file is read.
	failed string
}

// fail logs err once.
func (r *reread) fail(err error) {
	if err.Error() == r.failed {
		return
	}
	r.failed = err.Error()
	r.log.Warn("NATS credentials file cannot be used; connecting with the credentials read from it before",
		"file", r.path, "err", err)
}

// ok logs, once, that the file is read again.
func (r *reread) ok() {
	if r.failed == "" {
		return
	}
	r.failed = ""
	r.log.Info("NATS credentials file read again", "file", r.path)
}

// credsSource is the .creds file of one connection. At each connect the
// JWT callback reads the file: a usable one of the same user name (the
// connection's inboxes are the user's) becomes what the connection
// authenticates with, so a rotated file is used from the next connect; a
// missing, unreadable or invalid one keeps the last good content. The
// signature callback signs with the seed of the JWT just sent.
type credsSource struct {
	reread
	cur userCreds
}

func (s *credsSource) userJWT() (string, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	c, err := readCreds(s.path)
	if err == nil && c.name != s.cur.name {
		wipe(c.seed)
		err = fmt.Errorf("%s: NATS user %q, not %q whose inboxes this connection uses: restart to use it", s.path, c.name, s.cur.name)
	}
	if err != nil {
		s.fail(err)
		return s.cur.jwt, nil
	}
	s.ok()
	if c.jwt == s.cur.jwt && bytes.Equal(c.seed, s.cur.seed) {
		wipe(c.seed)
		return s.cur.jwt, nil
	}
	if c.pub != s.cur.pub {
		s.log.Info("NATS credentials file holds another key; connecting with it", "file", s.path, "user", c.name, "key", c.pub)
	}
	wipe(s.cur.seed)
	s.cur = c
	return c.jwt, nil
}

func (s *credsSource) sign(nonce []byte) ([]byte, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return signWith(s.cur.seed, nonce)
}

// signWith signs nonce with the key of seed, and wipes the key.
func signWith(seed, nonce []byte) ([]byte, error) {
	kp, err := nkeys.FromSeed(seed)
	if err != nil {
		return nil, fmt.Errorf("sign the server's nonce: %w", err)
	}
	defer kp.Wipe()
	return kp.Sign(nonce)
}

// parseNkey checks the content of the nkey seed file path: one user seed.
// It returns the seed and its public key; raw is left as it is.
func parseNkey(path string, raw []byte) (seed []byte, pub string, err error) {
	kp, err := nkeys.FromSeed(bytes.TrimSpace(raw))
	if err != nil {
		return nil, "", fmt.Errorf("%s: not an nkey seed", path)
	}
	defer kp.Wipe()
	pub, err = kp.PublicKey()
	if err != nil || !nkeys.IsValidPublicUserKey(pub) {
		return nil, "", fmt.Errorf("%s: not a user nkey seed (SU...)", path)
	}
	s, err := kp.Seed()
	if err != nil {
		return nil, "", fmt.Errorf("%s: not an nkey seed", path)
	}
	return bytes.Clone(s), pub, nil
}

// nkeyOption authenticates with the user nkey seed file path, whose seed
// at start is seed (public key pub): each connection reads the file at
// every (re)connect (nkeySource).
func nkeyOption(path string, seed []byte, pub string, log *slog.Logger) nats.Option {
	return func(o *nats.Options) error {
		src := &nkeySource{reread: reread{path: path, log: log}, pub: pub, seed: bytes.Clone(seed)}
		return nats.Nkey(pub, src.sign)(o)
	}
}

// nkeySource is the nkey seed file of one connection. The public key a
// connection sends is the one of its start, so a file is usable when it
// holds that key's seed; a missing, unreadable or invalid file, or one
// holding another key, keeps the seed read before.
type nkeySource struct {
	reread
	pub  string
	seed []byte
}

func (s *nkeySource) sign(nonce []byte) ([]byte, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.read(); err != nil {
		s.fail(err)
	} else {
		s.ok()
	}
	return signWith(s.seed, nonce)
}

func (s *nkeySource) read() error {
	raw, err := os.ReadFile(s.path)
	if err != nil {
		return err
	}
	defer wipe(raw)
	seed, pub, err := parseNkey(s.path, raw)
	if err != nil {
		return err
	}
	if pub != s.pub {
		wipe(seed)
		return fmt.Errorf("%s: holds another user key (%s), not %s: restart to use it", s.path, pub, s.pub)
	}
	wipe(s.seed)
	s.seed = seed
	return nil
}
