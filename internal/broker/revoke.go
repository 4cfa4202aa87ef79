package broker

import (
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nkeys"
)

// revocationPoll is how often a running embedded server reads its revoked
// users file: a revocation takes effect within about this long.
const revocationPoll = 2 * time.Second

// liveAuth is what a running embedded server keeps of its Auth to apply
// revocations made while it runs: the account's claims and the operator
// key that signs them. Only the server's watch goroutine uses it after
// the start.
type liveAuth struct {
	dir      string
	operator nkeys.KeyPair
	accPub   string
	claims   *jwt.AccountClaims
	res      *server.MemAccResolver
	// revoked are the keys the running server refuses; it only adds to
	// them (a key taken off the file is accepted again from the next start).
	revoked map[string]bool
	// seen is the revoked users file last handled (revokedSignature).
	seen string
	// failed is the last error logged of applying a revocation, so a
	// retried failure is logged once.
	failed string
}

// revokedSignature tells apart the states of the revoked users file: its
// content, its absence, or an error reading it.
func revokedSignature(raw []byte, err error) string {
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return "absent"
	case err != nil:
		return "error " + err.Error()
	}
	return "content " + string(raw)
}

// watch applies, every revocationPoll until stop is closed, the keys added
// to the revoked users file to the running server ns.
func (l *liveAuth) watch(ns *server.Server, log *slog.Logger, stop <-chan struct{}) {
	t := time.NewTicker(revocationPoll)
	defer t.Stop()
	for {
		select {
		case <-stop:
			return
		case <-t.C:
			l.poll(ns, log)
		}
	}
}

// poll reads the revoked users file and, when it changed, applies the
// keys it adds. A file that cannot be read or parsed, or is gone, keeps
// every revocation in force and is logged once, as is a key taken off
// the file: the running server never accepts a revoked key again.
func (l *liveAuth) poll(ns *server.Server, log *slog.Logger) {
	path := filepath.Join(l.dir, revokedFile)
	raw, err := os.ReadFile(path)
	sig := revokedSignature(raw, err)
	if sig == l.seen {
		return
	}
	switch {
	case errors.Is(err, fs.ErrNotExist):
		l.seen = sig
		if len(l.revoked) > 0 {
			log.Error("embedded jetstream: the revoked users file is gone; the running broker keeps refusing the revoked users",
				"file", path, "revoked", len(l.revoked))
		}
		return
	case err != nil:
		l.seen = sig
		log.Error("embedded jetstream: cannot read the revoked users; the running broker keeps refusing the users revoked before",
			"file", path, "revoked", len(l.revoked), "err", err)
		return
	}
	keys, err := parseRevoked(l.dir, raw)
	if err != nil {
		l.seen = sig
		log.Error("embedded jetstream: bad revoked users file; the running broker keeps refusing the users revoked before",
			"revoked", len(l.revoked), "err", err)
		return
	}
	var added []string
	for _, pub := range keys {
		if !l.revoked[pub] && !slices.Contains(added, pub) {
			added = append(added, pub)
		}
	}
	if len(added) > 0 {
		if err := l.apply(ns, added); err != nil {
			// Tried again at the next poll; logged once.
			if err.Error() != l.failed {
				l.failed = err.Error()
				log.Error("embedded jetstream: cannot apply the revoked users; retrying", "users", added, "err", err)
			}
			return
		}
		l.failed = ""
		log.Info("embedded jetstream: revoked users refused; their connections closed", "users", added, "revoked", len(l.revoked))
	}
	l.seen = sig
	var removed []string
	for pub := range l.revoked {
		if !slices.Contains(keys, pub) {
			removed = append(removed, pub)
		}
	}
	if len(removed) > 0 {
		slices.Sort(removed)
		log.Warn("embedded jetstream: users taken off the revoked users file stay refused until the capture restarts",
			"file", path, "users", removed)
	}
}

// apply revokes added in the account's claims (every JWT of those keys
// issued until now), signs them and updates the running server's account:
// the server closes the connections of those keys and refuses new ones.
func (l *liveAuth) apply(ns *server.Server, added []string) error {
	now := time.Now()
	for _, pub := range added {
		l.claims.RevokeAt(pub, now)
	}
	tok, err := l.claims.Encode(l.operator)
	if err != nil {
		return fmt.Errorf("sign the account: %w", err)
	}
	ac, err := jwt.DecodeAccountClaims(tok)
	if err != nil {
		return fmt.Errorf("read the signed account: %w", err)
	}
	acc, err := ns.LookupAccount(l.accPub)
	if err != nil {
		return fmt.Errorf("account %s: %w", AccountName, err)
	}
	// The resolver first: an account the server fetches again gets the
	// revocations too.
	if err := l.res.Store(l.accPub, tok); err != nil {
		return fmt.Errorf("store the account: %w", err)
	}
	ns.UpdateAccountClaims(acc, ac)
	for _, pub := range added {
		l.revoked[pub] = true
	}
	return nil
}
