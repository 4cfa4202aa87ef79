package broker

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nkeys"
)

// maxTargetLen bounds a target's name in its user name.
const maxTargetLen = 64

// TargetUser is the NATS user of the projectors of one target:
// projector_<target>.
func TargetUser(target string) string { return ProjectorUser + "_" + target }

// ValidateTarget checks a target name: 1..64 letters, digits, '-' or '_'
// (one subject token, so it can name the user's inboxes).
func ValidateTarget(target string) error {
	if target == "" || len(target) > maxTargetLen {
		return fmt.Errorf("target %q: want 1..%d letters, digits, '-' or '_'", target, maxTargetLen)
	}
	for _, r := range target {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_') {
			return fmt.Errorf("target %q: want 1..%d letters, digits, '-' or '_'", target, maxTargetLen)
		}
	}
	return nil
}

// TargetCreds is the default path of a target's credentials under dir (an
// Auth.Dir): projector_<target>.creds.
func TargetCreds(dir, target string) string {
	return filepath.Join(dir, TargetUser(target)+".creds")
}

// WriteTargetCreds writes to path the credentials of the projectors of
// one target (TargetUser): the projector's permissions on source's
// JetStream data, subscribing only to the target's own inboxes, signed
// with the account key of the embedded broker whose keys are in dir. The
// server accepts them without a restart (it trusts what the account key
// signs). An existing file of the same user keeps its key; the file is
// 0600. dir must hold the keys already: the capture makes them on its
// first start with the embedded broker.
func WriteTargetCreds(dir, source, target, path string) error {
	if err := ValidateTarget(target); err != nil {
		return err
	}
	raw, err := os.ReadFile(filepath.Join(dir, accountSeedFile))
	if errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("no embedded broker keys in %s: start the capture with the embedded broker (no --nats-url) once first", dir)
	}
	if err != nil {
		return fmt.Errorf("read the account key: %w", err)
	}
	account, err := nkeys.FromSeed([]byte(strings.TrimSpace(string(raw))))
	if err != nil {
		return fmt.Errorf("the account key in %s is not an nkey seed", dir)
	}
	defer account.Wipe()
	user := TargetUser(target)
	return ensureCreds(path, user, account, ProjectorPermissions(source, user))
}

// revokedFile lists, one a line, the public keys of the users whose
// credentials were revoked (RevokeTargetCreds).
const revokedFile = "revoked-users"

// RevokeTargetCreds revokes the credentials file at path (written by
// WriteTargetCreds for the embedded broker whose keys are in dir): its
// user's key is listed as revoked in dir and the file is removed. A
// running embedded broker reads the list every two seconds: within
// seconds it closes the connections of that key and refuses new ones; a
// broker started later refuses it from its start. Credentials written
// again get a new key.
func RevokeTargetCreds(dir, path string) error {
	if _, err := os.Stat(filepath.Join(dir, accountSeedFile)); err != nil {
		return fmt.Errorf("no embedded broker keys in %s", dir)
	}
	raw, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("no credentials file %s", path)
	}
	if err != nil {
		return fmt.Errorf("read the target's credentials: %w", err)
	}
	kp, err := jwt.ParseDecoratedNKey(raw)
	if err != nil {
		return fmt.Errorf("%s: not a NATS credentials file", path)
	}
	pub, err := kp.PublicKey()
	kp.Wipe()
	if err != nil {
		return fmt.Errorf("%s: not a NATS credentials file", path)
	}
	revoked, err := revokedUsers(dir)
	if err != nil {
		return err
	}
	if !slices.Contains(revoked, pub) {
		revoked = append(revoked, pub)
		if err := writeFileAtomic(filepath.Join(dir, revokedFile), []byte(strings.Join(revoked, "\n")+"\n")); err != nil {
			return err
		}
	}
	if err := os.Remove(path); err != nil {
		return fmt.Errorf("remove %s: %w", path, err)
	}
	return nil
}

// revokedUsers reads the revoked users' public keys in dir (none when the
// file does not exist).
func revokedUsers(dir string) ([]string, error) {
	raw, err := os.ReadFile(filepath.Join(dir, revokedFile))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("embedded jetstream: read the revoked users: %w", err)
	}
	return parseRevoked(dir, raw)
}

// parseRevoked reads the content of dir's revoked users file: one user's
// public key a line, blank lines ignored.
func parseRevoked(dir string, raw []byte) ([]string, error) {
	var out []string
	for i, l := range strings.Split(string(raw), "\n") {
		l = strings.TrimSpace(l)
		if l == "" {
			continue
		}
		if !nkeys.IsValidPublicUserKey(l) {
			// The line is not shown: it may be a secret pasted by mistake.
			return nil, fmt.Errorf("embedded jetstream: %s line %d is not a user's public key", filepath.Join(dir, revokedFile), i+1)
		}
		out = append(out, l)
	}
	return out, nil
}

// refreshTargetCreds brings the target credentials files in a.Dir
// (projector_<target>.creds, written by WriteTargetCreds) to the
// projector's current permissions, keeping their keys.
func refreshTargetCreds(a Auth, account nkeys.KeyPair) error {
	files, err := filepath.Glob(filepath.Join(a.Dir, ProjectorUser+"_*.creds"))
	if err != nil {
		return fmt.Errorf("embedded jetstream: %w", err)
	}
	for _, f := range files {
		target := strings.TrimSuffix(strings.TrimPrefix(filepath.Base(f), ProjectorUser+"_"), ".creds")
		if ValidateTarget(target) != nil {
			continue
		}
		user := TargetUser(target)
		if err := ensureCreds(f, user, account, ProjectorPermissions(a.Source, user)); err != nil {
			return err
		}
	}
	return nil
}
