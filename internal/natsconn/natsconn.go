// Package natsconn turns the NATS authentication settings both binaries
// take (--nats-creds, --nats-nkey, --nats-user with --nats-password-file,
// --nats-tls-ca, --nats-tls-cert with --nats-tls-key) into nats.Options,
// in one place. Secrets are read from files and never printed: errors name
// the flag and the file, never its content.
//
// A client that authenticates as a named NATS user takes its replies and
// deliveries on inboxes of its own, _INBOX.<user>.>: a server that lets
// each user subscribe only there keeps one user from reading another's
// JetStream replies (which name its consumers).
package natsconn

import (
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats.go"
)

// DefaultInboxPrefix is the inbox prefix of a client with no user name.
const DefaultInboxPrefix = "_INBOX"

// InboxPrefix is the inbox prefix of a client authenticated as user:
// _INBOX.<user> (DefaultInboxPrefix for ""). A server lets the user
// subscribe to InboxPrefix(user) + ".>" only.
func InboxPrefix(user string) string {
	if user == "" {
		return DefaultInboxPrefix
	}
	return DefaultInboxPrefix + "." + user
}

// checkUser refuses a user name that is not one subject token (it could
// not name the user's inboxes).
func checkUser(what, user string) error {
	if strings.ContainsAny(user, ". \t\r\n*>") {
		return fmt.Errorf("%s: NATS user %q cannot name an inbox (_INBOX.<user>): use a name without '.', '*', '>' or spaces", what, user)
	}
	return nil
}

// CredsUser is the user name a .creds file authenticates as: the name of
// its user JWT ("" when the JWT has none). The seed is not read.
func CredsUser(path string) (string, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	tok, err := jwt.ParseDecoratedJWT(raw)
	if err != nil {
		return "", fmt.Errorf("%s: not a NATS credentials file", path)
	}
	uc, err := jwt.DecodeUserClaims(tok)
	if err != nil {
		return "", fmt.Errorf("%s: not a NATS credentials file (no user JWT)", path)
	}
	if err := checkUser(path, uc.Name); err != nil {
		return "", err
	}
	return uc.Name, nil
}

// UserCredentials authenticates with the .creds file path and takes the
// inboxes of its user (InboxPrefix(CredsUser(path))): what every Epitaph
// client authenticating with a .creds file uses. The file must be usable
// when the option is applied (nats.Connect fails otherwise); then it is
// read again at every reconnect, so a rotated file is used from the next
// connect, while a missing, unreadable or half-written one (or one of
// another user name) keeps the credentials read last and is logged once
// (WithLogger).
func UserCredentials(path string, opts ...Option) nats.Option {
	log := newSettings(opts).log
	return func(o *nats.Options) error {
		c, err := readCreds(path)
		if err != nil {
			return err
		}
		defer wipe(c.seed)
		if err := c.option(path, log)(o); err != nil {
			return err
		}
		return inbox(c.name)(o)
	}
}

// inbox sets the inbox prefix of user (nothing for "").
func inbox(user string) nats.Option {
	return func(o *nats.Options) error {
		if user == "" {
			return nil
		}
		return nats.CustomInboxPrefix(InboxPrefix(user))(o)
	}
}

// urlUser is the user of the first URL of a comma-separated list that
// carries user:password ("" when none does; a lone token is no user).
func urlUser(url string) string {
	for _, info := range urlUserinfos(url) {
		if user, _, ok := strings.Cut(info, ":"); ok && user != "" {
			return user
		}
	}
	return ""
}

// urlUserinfos are the userinfo parts (a token or user:password) of the
// URLs of a comma-separated list that have one.
func urlUserinfos(url string) []string {
	var out []string
	for _, u := range strings.Split(url, ",") {
		u = strings.TrimSpace(u)
		if i := strings.Index(u, "://"); i >= 0 {
			u = u[i+3:]
		}
		if j := strings.IndexAny(u, "/?"); j >= 0 {
			u = u[:j]
		}
		if at := strings.LastIndex(u, "@"); at >= 0 {
			out = append(out, u[:at])
		}
	}
	return out
}

// Auth is how a client authenticates to a NATS server. The zero value
// authenticates with what the URL carries (nothing, a token or user:pass).
type Auth struct {
	// CredsFile is a .creds file (user JWT and nkey seed), such as the
	// projector.creds the capture's embedded broker writes.
	CredsFile string
	// NkeyFile is a file holding a user nkey seed (SU...).
	NkeyFile string
	// User and PasswordFile: a user and the file holding its password
	// (one line; a trailing newline is ignored).
	User         string
	PasswordFile string
	// TLSCA verifies the server's certificate (PEM); TLSCert and TLSKey are
	// a client certificate and its key, for servers that verify clients.
	TLSCA   string
	TLSCert string
	TLSKey  string
}

// Flag is one of the settings' command-line flag and environment variable.
type Flag struct {
	Name, Env, Usage string
	Field            func(*Auth) *string
}

// Flags are the flags of Auth, the same in every binary.
var Flags = []Flag{
	{"nats-creds", "EPITAPH_NATS_CREDS", "NATS credentials file (JWT and nkey seed), e.g. <capture data dir>/nats/projector.creds", func(a *Auth) *string { return &a.CredsFile }},
	{"nats-nkey", "EPITAPH_NATS_NKEY", "file holding a NATS user nkey seed", func(a *Auth) *string { return &a.NkeyFile }},
	{"nats-user", "EPITAPH_NATS_USER", "NATS user (with --nats-password-file)", func(a *Auth) *string { return &a.User }},
	{"nats-password-file", "EPITAPH_NATS_PASSWORD_FILE", "file holding the NATS user's password", func(a *Auth) *string { return &a.PasswordFile }},
	{"nats-tls-ca", "EPITAPH_NATS_TLS_CA", "CA certificate (PEM) that verifies the NATS server", func(a *Auth) *string { return &a.TLSCA }},
	{"nats-tls-cert", "EPITAPH_NATS_TLS_CERT", "client certificate (PEM) for NATS, with --nats-tls-key", func(a *Auth) *string { return &a.TLSCert }},
	{"nats-tls-key", "EPITAPH_NATS_TLS_KEY", "client certificate key (PEM) for NATS", func(a *Auth) *string { return &a.TLSKey }},
}

// IsZero reports whether no setting is given.
func (a Auth) IsZero() bool { return a == Auth{} }

// HasCredentials reports whether a credential (creds, nkey or user) is given.
func (a Auth) HasCredentials() bool { return a.CredsFile != "" || a.NkeyFile != "" || a.User != "" }

// Validate refuses contradictory settings with one line naming the flags.
// url is the server URL the settings go with (a credential in it and one in
// a flag contradict).
func (a Auth) Validate(url string) error {
	var given []string
	if a.CredsFile != "" {
		given = append(given, "--nats-creds")
	}
	if a.NkeyFile != "" {
		given = append(given, "--nats-nkey")
	}
	if a.User != "" || a.PasswordFile != "" {
		given = append(given, "--nats-user")
	}
	var errs []string
	if len(given) > 1 {
		errs = append(errs, "NATS credentials given twice ("+strings.Join(given, ", ")+"): use one of --nats-creds, --nats-nkey, --nats-user")
	}
	if a.User != "" && a.PasswordFile == "" {
		errs = append(errs, "--nats-user needs --nats-password-file (EPITAPH_NATS_PASSWORD_FILE)")
	}
	if a.PasswordFile != "" && a.User == "" {
		errs = append(errs, "--nats-password-file needs --nats-user (EPITAPH_NATS_USER)")
	}
	if (a.TLSCert == "") != (a.TLSKey == "") {
		errs = append(errs, "--nats-tls-cert and --nats-tls-key go together")
	}
	if len(given) > 0 && urlHasCredentials(url) {
		errs = append(errs, "the NATS URL carries credentials and "+given[0]+" gives others: use one")
	}
	if len(errs) > 0 {
		return errors.New(strings.Join(errs, "; "))
	}
	return nil
}

// urlHasCredentials reports whether any URL of a comma-separated list has
// userinfo (a token or user:password).
func urlHasCredentials(url string) bool { return len(urlUserinfos(url)) > 0 }

// Options validates the settings, reads the secret files and returns the
// nats.Options that authenticate with them and take the inboxes of the
// user they name (InboxPrefix of the user of --nats-user or of the URL, or
// of the name in the JWT of --nats-creds; an nkey alone names no user, and
// keeps _INBOX). Every file is checked now, so a missing or unreadable one
// is one clear error at start, not a refused connection later. The
// --nats-creds and --nats-nkey files are read again at every reconnect
// (UserCredentials): a rotated file is used from the next connect, and
// one missing or unusable then keeps the credentials read last, logged
// once (WithLogger).
func (a Auth) Options(url string, options ...Option) ([]nats.Option, error) {
	if err := a.Validate(url); err != nil {
		return nil, err
	}
	log := newSettings(options).log
	var opts []nats.Option
	switch {
	case a.CredsFile != "":
		raw, err := os.ReadFile(a.CredsFile)
		if err != nil {
			return nil, fmt.Errorf("--nats-creds: %w", err)
		}
		c, err := parseCreds(a.CredsFile, raw)
		wipe(raw)
		if err != nil {
			return nil, fmt.Errorf("--nats-creds %w", err)
		}
		opts = append(opts, c.option(a.CredsFile, log), inbox(c.name))
	case a.NkeyFile != "":
		raw, err := os.ReadFile(a.NkeyFile)
		if err != nil {
			return nil, fmt.Errorf("--nats-nkey: %w", err)
		}
		seed, pub, err := parseNkey(a.NkeyFile, raw)
		wipe(raw)
		if err != nil {
			return nil, fmt.Errorf("--nats-nkey %w", err)
		}
		opts = append(opts, nkeyOption(a.NkeyFile, seed, pub, log))
	case a.User != "":
		raw, err := os.ReadFile(a.PasswordFile)
		if err != nil {
			return nil, fmt.Errorf("--nats-password-file: %w", err)
		}
		pw := strings.TrimRight(string(raw), "\r\n")
		if pw == "" {
			return nil, fmt.Errorf("--nats-password-file %s is empty", a.PasswordFile)
		}
		if err := checkUser("--nats-user", a.User); err != nil {
			return nil, err
		}
		opts = append(opts, nats.UserInfo(a.User, pw), inbox(a.User))
	default:
		user := urlUser(url)
		if err := checkUser("the NATS URL", user); err != nil {
			return nil, err
		}
		opts = append(opts, inbox(user))
	}
	if a.TLSCA != "" {
		if err := readable("--nats-tls-ca", a.TLSCA); err != nil {
			return nil, err
		}
		opts = append(opts, nats.RootCAs(a.TLSCA))
	}
	if a.TLSCert != "" {
		if err := readable("--nats-tls-cert", a.TLSCert); err != nil {
			return nil, err
		}
		if err := readable("--nats-tls-key", a.TLSKey); err != nil {
			return nil, err
		}
		opts = append(opts, nats.ClientCert(a.TLSCert, a.TLSKey))
	}
	return opts, nil
}

func readable(flag, path string) error {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("%s: %w", flag, err)
	}
	return f.Close()
}
