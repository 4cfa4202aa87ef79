package handler

import (
	"bytes"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	standardwebhooks "github.com/standard-webhooks/standard-webhooks/libraries/go"
)

// Webhook headers. The webhook-* ones are Standard Webhooks'
// (standardwebhooks.org): a receiver verifies them with that project's
// library in its language, with no code of ours.
const (
	HeaderWebhookID        = standardwebhooks.HeaderWebhookID
	HeaderWebhookTimestamp = standardwebhooks.HeaderWebhookTimestamp
	HeaderWebhookSignature = standardwebhooks.HeaderWebhookSignature

	HeaderDeliveryID = "Epitaph-Delivery-Id"
	HeaderAttempt    = "Epitaph-Attempt"
	// HeaderBatchSize is on a batch's POST (which has no
	// Epitaph-Delivery-Id: its deliveries' ids are in its body): how many
	// deliveries it holds. Its Epitaph-Attempt is their highest attempt.
	HeaderBatchSize = "Epitaph-Batch-Size"
	// HeaderSignature is deprecated (kept for one release beside
	// webhook-signature): "sha256=" and the hex HMAC-SHA256 of the body
	// alone, with the current secret only.
	HeaderSignature = "Epitaph-Signature"
)

// SecretPrefix starts a Standard Webhooks secret: "whsec_" and the key's
// bytes in standard base64.
const SecretPrefix = "whsec_"

// DefaultRotationWindow is how long a rotated-out secret keeps signing
// beside the new one (Svix's default too): a day to give the receiver the
// new secret.
const DefaultRotationWindow = 24 * time.Hour

// Sign is the deprecated Epitaph-Signature of a webhook body: "sha256="
// and the hex HMAC-SHA256 of the body with the key.
func Sign(key, body []byte) string {
	m := hmac.New(sha256.New, key)
	m.Write(body)
	return "sha256=" + hex.EncodeToString(m.Sum(nil))
}

// FormatSecret is key as a Standard Webhooks secret (whsec_<base64>).
func FormatSecret(key []byte) string { return SecretPrefix + base64.StdEncoding.EncodeToString(key) }

// NewSecret is a fresh random 32-byte secret, formatted.
func NewSecret() string {
	var b [32]byte
	_, _ = rand.Read(b[:])
	return FormatSecret(b[:])
}

// SecretKey is one signing key of a secret file; Until is zero for the
// current one and the end of the rotation window for a previous one.
type SecretKey struct {
	Key   []byte
	Until time.Time
	// Raw: the file holds a key in the old raw form (its bytes are the
	// key), not whsec_<base64>.
	Raw bool
	wh  *standardwebhooks.Webhook
}

// Secrets is a parsed secret file: the current key first, then the
// previous keys still within (or past) their rotation windows.
type Secrets []SecretKey

// untilField ends a previous key's line in a secret file.
const untilField = " until="

// ParseSecrets parses a secret file. Its first line is the current secret,
// whsec_<base64>; each further line a previous secret that still signs
// until its time: "whsec_<base64> until=<RFC 3339>". A file whose first
// line does not start with whsec_ is one key in the old raw form (the
// file's bytes, its trailing line break trimmed). Errors never quote the
// file's content.
func ParseSecrets(b []byte) (Secrets, error) {
	b = bytes.TrimRight(b, "\r\n")
	if len(b) == 0 {
		return nil, errors.New("the secret file is empty")
	}
	if !bytes.HasPrefix(b, []byte(SecretPrefix)) {
		wh, err := standardwebhooks.NewWebhookRaw(b)
		if err != nil {
			return nil, err
		}
		return Secrets{{Key: b, Raw: true, wh: wh}}, nil
	}
	var out Secrets
	for i, line := range strings.Split(string(b), "\n") {
		line = strings.TrimRight(line, "\r")
		if strings.TrimSpace(line) == "" {
			continue
		}
		secret, until, hasUntil := strings.Cut(line, untilField)
		k := SecretKey{}
		if hasUntil {
			if len(out) == 0 {
				return nil, fmt.Errorf("secret file line %d: the current (first) secret has no until=", i+1)
			}
			t, err := time.Parse(time.RFC3339, strings.TrimSpace(until))
			if err != nil {
				return nil, fmt.Errorf("secret file line %d: until= is not an RFC 3339 time", i+1)
			}
			k.Until = t
		} else if len(out) > 0 {
			return nil, fmt.Errorf("secret file line %d: a previous secret needs until=<RFC 3339 time>", i+1)
		}
		if !strings.HasPrefix(secret, SecretPrefix) {
			return nil, fmt.Errorf("secret file line %d: not whsec_<base64>", i+1)
		}
		key, err := base64.StdEncoding.DecodeString(strings.TrimPrefix(strings.TrimSpace(secret), SecretPrefix))
		if err != nil || len(key) == 0 {
			return nil, fmt.Errorf("secret file line %d: not whsec_<base64> (of at least one byte)", i+1)
		}
		k.Key = key
		if k.wh, err = standardwebhooks.NewWebhookRaw(key); err != nil {
			return nil, err
		}
		out = append(out, k)
	}
	return out, nil
}

// ReadSecrets reads and parses a secret file.
func ReadSecrets(file string) (Secrets, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	s, err := ParseSecrets(b)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", file, err)
	}
	return s, nil
}

// Signing is the keys that sign at now: the current one and the previous
// ones whose windows have not ended.
func (s Secrets) Signing(now time.Time) Secrets {
	out := make(Secrets, 0, len(s))
	for i, k := range s {
		if i == 0 || now.Before(k.Until) {
			out = append(out, k)
		}
	}
	return out
}

// SignatureHeader is the webhook-signature of (id, ts, body) at ts: one
// "v1,<base64>" per signing key, space-separated (a receiver holding any
// one of the keys verifies it).
func (s Secrets) SignatureHeader(id string, ts time.Time, body []byte) (string, error) {
	var b strings.Builder
	for _, k := range s.Signing(ts) {
		sig, err := k.wh.Sign(id, ts, body)
		if err != nil {
			return "", err
		}
		if b.Len() > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(sig)
	}
	return b.String(), nil
}

// format is the file's text (the old raw form is written as whsec_: the
// same key).
func (s Secrets) format() []byte {
	var b bytes.Buffer
	for i, k := range s {
		b.WriteString(FormatSecret(k.Key))
		if i > 0 {
			b.WriteString(untilField + k.Until.UTC().Format(time.RFC3339))
		}
		b.WriteByte('\n')
	}
	return b.Bytes()
}

// RotateSecretFile makes next (a whsec_ secret; "" for a fresh random one)
// the current secret of file; the current one keeps signing beside it
// until now+window (not at all with a window of 0), and previous ones
// whose windows have not ended stay as they are. The file is replaced
// atomically, with its mode kept. It returns the end of the window.
func RotateSecretFile(file, next string, window time.Duration, now time.Time) (time.Time, error) {
	if window < 0 {
		return time.Time{}, errors.New("the rotation window must not be negative")
	}
	old, err := ReadSecrets(file)
	if err != nil {
		return time.Time{}, err
	}
	if next == "" {
		next = NewSecret()
	}
	fresh, err := ParseSecrets([]byte(next))
	if err != nil || fresh[0].Raw || len(fresh) != 1 {
		return time.Time{}, errors.New("the new secret is not one whsec_<base64> secret")
	}
	until := now.Add(window).Truncate(time.Second)
	set := Secrets{fresh[0]}
	if window > 0 {
		cur := old[0]
		cur.Until = until
		set = append(set, cur)
	}
	for _, k := range old[1:] {
		if now.Before(k.Until) {
			set = append(set, k)
		}
	}
	st, err := os.Stat(file)
	if err != nil {
		return time.Time{}, err
	}
	tmp, err := os.CreateTemp(filepath.Dir(file), "."+filepath.Base(file)+".rotate-*")
	if err != nil {
		return time.Time{}, err
	}
	defer os.Remove(tmp.Name())
	if err := tmp.Chmod(st.Mode().Perm()); err != nil {
		tmp.Close()
		return time.Time{}, err
	}
	if _, err := tmp.Write(set.format()); err != nil {
		tmp.Close()
		return time.Time{}, err
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return time.Time{}, err
	}
	if err := tmp.Close(); err != nil {
		return time.Time{}, err
	}
	if err := os.Rename(tmp.Name(), file); err != nil {
		return time.Time{}, err
	}
	return until, nil
}

// secretCache holds webhook secrets read from their files, each read again
// once it is older than secretMaxAge (a rotated secret is used within a
// second, like a changed handler definition). Reading the file at every
// attempt cost the dispatcher about a tenth of its CPU per delivery (open,
// read, close: bench-handlers' profile).
type secretCache struct {
	mu sync.Mutex
	m  map[string]cachedSecret
}

type cachedSecret struct {
	secrets Secrets
	at      time.Time
}

// secretMaxAge bounds how long a secret read from its file is used.
const secretMaxAge = time.Second

// get returns the parsed secrets in file. A failed read is not cached.
func (c *secretCache) get(file string) (Secrets, error) {
	now := time.Now()
	c.mu.Lock()
	s, ok := c.m[file]
	c.mu.Unlock()
	if ok && now.Sub(s.at) < secretMaxAge {
		return s.secrets, nil
	}
	secrets, err := ReadSecrets(file)
	if err != nil {
		return nil, err
	}
	s = cachedSecret{secrets: secrets, at: now}
	c.mu.Lock()
	if c.m == nil {
		c.m = map[string]cachedSecret{}
	}
	c.m[file] = s
	c.mu.Unlock()
	return s.secrets, nil
}

// signWebhook sets a webhook request's signature headers for this attempt
// (ts: its time).
func signWebhook(set func(k, v string), secrets Secrets, id string, ts time.Time, body []byte) error {
	sig, err := secrets.SignatureHeader(id, ts, body)
	if err != nil {
		return err
	}
	set(HeaderWebhookSignature, sig)
	set(HeaderSignature, Sign(secrets[0].Key, body))
	return nil
}

// unixSeconds is webhook-timestamp's value.
func unixSeconds(t time.Time) string { return strconv.FormatInt(t.Unix(), 10) }
