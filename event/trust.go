package event

import (
	"bytes"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"encoding"
	"encoding/base64"
	"encoding/binary"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"hash"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// Trust headers. Together they let a reader prove that a
// transaction, mark, heartbeat or gap was published by the capture holding
// a known key, and notice messages removed from a partition.
const (
	// HeaderPosition is on every message the capture publishes: the
	// position of the message in the capture's output, "<trigger lsn>#<n>".
	// The trigger is the commit LSN of the source transaction the message
	// belongs to (or the LSN just before the end of a non-transactional
	// logical message or of a gap), n counts the messages published for
	// that trigger from 0. Output order is strictly increasing in it.
	HeaderPosition = "Epitaph-Position"
	// HeaderPartitionSeq is on every message the capture publishes: the
	// decimal 1-based count of messages it has published to that
	// partition, exactly one more than the previous message of the
	// partition. A reader that sees it jump knows messages were removed.
	HeaderPartitionSeq = "Epitaph-Partition-Seq"
	// HeaderDigest is on commit messages: "sha256:<hex>", see NewDigest
	// and NewDigestV2.
	HeaderDigest = "Epitaph-Digest"
	// HeaderDigestAlg names the algorithm of a transaction's digest: "v2"
	// (DigestAlgV2) on the commit and on every row and truncate message of
	// a transaction digested with NewDigestV2; absent for digest v1. It is
	// not signed: a changed value makes the digest, which is, fail.
	HeaderDigestAlg = "Epitaph-Digest-Alg"
	// HeaderKeyID is on signed messages: KeyID of the signing key.
	HeaderKeyID = "Epitaph-Key-Id"
	// HeaderSignature is on commits, marks, heartbeats and gaps:
	// "ed25519:<base64 std>" over SigningInput.
	HeaderSignature = "Epitaph-Signature"
)

// Stream metadata keys the capture sets on the stream it makes.
const (
	MetaPartitions  = "epitaph.partitions"
	MetaSource      = "epitaph.source"
	MetaWireVersion = "epitaph.wire_version"
	// MetaLimits records the limits the capture set last, so that a change
	// made behind its back can be told from its own.
	MetaLimits = "epitaph.limits"
)

// MetaSigningKey is the stream metadata key where a projector meeting its
// first key may also find the public key (PublicKeyString), besides the
// message's HeaderPublicKey. Either is only believed for a message whose
// signature verifies, and only while no key is trusted yet (trust on first
// use).
const MetaSigningKey = "epitaph.signing_key"

// DigestAlgV2 is HeaderDigestAlg's value for digest v2.
const DigestAlgV2 = "v2"

const (
	digestPrefix     = "sha256:"
	signaturePrefix  = "ed25519:"
	sigContext       = "epitaph-sig-v1\n"
	digestStateTag   = "epitaph-digest-v1:"
	digestStateTagV2 = "epitaph-digest-v2:"
)

// ErrBadSignature is wrapped by every Verify failure: a missing, malformed
// or non-matching signature, or one made with another key.
var ErrBadSignature = errors.New("bad signature")

// Digest is the incremental hash of a transaction's row and truncate
// messages, in seq order. Version 1 (NewDigest) hashes, for each message,
// its 8-byte big-endian partition sequence, the 4-byte big-endian length of
// its body, then the body. Version 2 (NewDigestV2) hashes, for each
// message, the sha256 of its body (BodyHash): a reader missing a message
// whose body hash it knows from elsewhere (an erasure ledger) can still
// check the rest with AddBodyHash; the partition sequences are covered by
// each message's own signature instead. Adding a message does not
// allocate. Its state marshals (encoding.BinaryMarshaler) so a reader can
// persist a half-hashed transaction that spans pages.
// The zero value is not usable; use NewDigest or NewDigestV2.
type Digest struct {
	h   hash.Hash
	n   uint64
	v2  bool
	pre [sha256.Size]byte
}

// NewDigest returns an empty digest v1.
func NewDigest() *Digest { return &Digest{h: sha256.New()} }

// NewDigestV2 returns an empty digest v2.
func NewDigestV2() *Digest { return &Digest{h: sha256.New(), v2: true} }

// BodyHash is the sha256 of a message body, as digest v2 and the erasure
// ledger record it.
func BodyHash(body []byte) [sha256.Size]byte { return sha256.Sum256(body) }

// V2 reports whether d is a digest v2.
func (d *Digest) V2() bool { return d.v2 }

// Reset empties d for the next transaction, keeping its version.
func (d *Digest) Reset() {
	d.h.Reset()
	d.n = 0
}

// ResetAlg empties d for the next transaction, of digest v2 when v2.
func (d *Digest) ResetAlg(v2 bool) {
	d.Reset()
	d.v2 = v2
}

// Add hashes one row or truncate message: its partition sequence and body
// (v1), or its body's hash (v2).
func (d *Digest) Add(partSeq uint64, body []byte) {
	if d.v2 {
		d.pre = sha256.Sum256(body)
		d.h.Write(d.pre[:])
		d.n++
		return
	}
	binary.BigEndian.PutUint64(d.pre[0:8], partSeq)
	binary.BigEndian.PutUint32(d.pre[8:12], uint32(len(body)))
	d.h.Write(d.pre[:12])
	d.h.Write(body)
	d.n++
}

// AddBodyHash hashes a message known only by its body hash (BodyHash), in
// its place in seq order. Only a digest v2 can: it returns an error for v1,
// whose input is the body itself.
func (d *Digest) AddBodyHash(sum [sha256.Size]byte) error {
	if !d.v2 {
		return errors.New("digest v1 covers whole bodies: a body hash cannot stand for one")
	}
	d.h.Write(sum[:])
	d.n++
	return nil
}

// Len is the number of messages added since NewDigest or Reset.
func (d *Digest) Len() uint64 { return d.n }

// Sum returns "sha256:<hex>" of what was added; d can go on being added to.
func (d *Digest) Sum() string {
	var b [sha256.Size]byte
	return digestPrefix + hex.EncodeToString(d.h.Sum(b[:0]))
}

// MarshalBinary returns d's state (encoding.BinaryMarshaler).
func (d *Digest) MarshalBinary() ([]byte, error) {
	st, err := d.h.(encoding.BinaryMarshaler).MarshalBinary()
	if err != nil {
		return nil, fmt.Errorf("marshal digest state: %w", err)
	}
	tag := digestStateTag
	if d.v2 {
		tag = digestStateTagV2
	}
	out := make([]byte, 0, len(tag)+8+len(st))
	out = append(out, tag...)
	out = binary.BigEndian.AppendUint64(out, d.n)
	return append(out, st...), nil
}

// UnmarshalBinary restores a state from MarshalBinary, of either version
// (encoding.BinaryUnmarshaler). It works on a zero Digest too.
func (d *Digest) UnmarshalBinary(data []byte) error {
	v2 := false
	rest, ok := bytes.CutPrefix(data, []byte(digestStateTag))
	if !ok {
		rest, ok = bytes.CutPrefix(data, []byte(digestStateTagV2))
		v2 = true
	}
	if !ok || len(rest) < 8 {
		return errors.New("unmarshal digest state: not an epitaph digest state")
	}
	h := sha256.New()
	if err := h.(encoding.BinaryUnmarshaler).UnmarshalBinary(rest[8:]); err != nil {
		return fmt.Errorf("unmarshal digest state: %w", err)
	}
	d.h, d.n, d.v2 = h, binary.BigEndian.Uint64(rest[:8]), v2
	return nil
}

// SignedFields are what a signature covers besides the body: the subject
// and the exact header text sent.
type SignedFields struct {
	Subject  string
	MsgID    string // Nats-Msg-Id
	Position string // Epitaph-Position
	PartSeq  string // Epitaph-Partition-Seq
	Digest   string // Epitaph-Digest, empty on messages that are not commits
}

// SigningInput is what a signature covers: "epitaph-sig-v1\n" + Subject +
// "\n" + MsgID + "\n" + Position + "\n" + PartSeq + "\n" + Digest + "\n" +
// body, so changing any of the fields or the body breaks the signature.
func SigningInput(f SignedFields, body []byte) []byte {
	return AppendSigningInput(nil, f, body)
}

// AppendSigningInput appends SigningInput to dst (to reuse a buffer).
func AppendSigningInput(dst []byte, f SignedFields, body []byte) []byte {
	dst = append(dst, sigContext...)
	for _, s := range [...]string{f.Subject, f.MsgID, f.Position, f.PartSeq, f.Digest} {
		dst = append(dst, s...)
		dst = append(dst, '\n')
	}
	return append(dst, body...)
}

// HeaderGetter reads a message header (nats.Header satisfies it).
type HeaderGetter interface {
	Get(key string) string
}

// MessageSigningInput is SigningInput of a received message, from its
// subject, headers (Nats-Msg-Id, Epitaph-Position, Epitaph-Partition-Seq,
// Epitaph-Digest) and body.
func MessageSigningInput(subject string, h HeaderGetter, body []byte) []byte {
	return SigningInput(SignedFields{Subject: subject, MsgID: h.Get(HeaderMsgID), Position: h.Get(HeaderPosition),
		PartSeq: h.Get(HeaderPartitionSeq), Digest: h.Get(HeaderDigest)}, body)
}

// VerifyMessage checks a received message's Epitaph-Key-Id and
// Epitaph-Signature against pub. Errors wrap ErrBadSignature.
func VerifyMessage(pub ed25519.PublicKey, subject string, h HeaderGetter, body []byte) error {
	if id := h.Get(HeaderKeyID); id != KeyID(pub) {
		return fmt.Errorf("%w: signed with key %q, not %s", ErrBadSignature, id, KeyID(pub))
	}
	return Verify(pub, MessageSigningInput(subject, h, body), h.Get(HeaderSignature))
}

// Sign returns the Epitaph-Signature value of in: "ed25519:<base64 std>".
func Sign(priv ed25519.PrivateKey, in []byte) string {
	return signaturePrefix + base64.StdEncoding.EncodeToString(ed25519.Sign(priv, in))
}

// Verify checks sig (an Epitaph-Signature value) over in with pub. Errors
// wrap ErrBadSignature.
func Verify(pub ed25519.PublicKey, in []byte, sig string) error {
	if len(pub) != ed25519.PublicKeySize {
		return fmt.Errorf("%w: public key of %d bytes", ErrBadSignature, len(pub))
	}
	b64, ok := strings.CutPrefix(sig, signaturePrefix)
	if !ok {
		if sig == "" {
			return fmt.Errorf("%w: unsigned", ErrBadSignature)
		}
		return fmt.Errorf("%w: not an %s signature", ErrBadSignature, strings.TrimSuffix(signaturePrefix, ":"))
	}
	raw, err := base64.StdEncoding.DecodeString(b64)
	if err != nil || len(raw) != ed25519.SignatureSize {
		return fmt.Errorf("%w: malformed", ErrBadSignature)
	}
	if !ed25519.Verify(pub, in, raw) {
		return fmt.Errorf("%w: does not match", ErrBadSignature)
	}
	return nil
}

// KeyID is the Epitaph-Key-Id of a public key: the first 16 hex digits of
// sha256 of its 32 bytes.
func KeyID(pub ed25519.PublicKey) string {
	s := sha256.Sum256(pub)
	return hex.EncodeToString(s[:8])
}

// PublicKeyPath is where LoadOrCreateSigningKey writes the public key of
// the key at keyPath: beside it, with the extension ".pub" instead of
// ".key" (<data-dir>/signing.key -> <data-dir>/signing.pub), or keyPath +
// ".pub" for another name.
func PublicKeyPath(keyPath string) string {
	return strings.TrimSuffix(keyPath, ".key") + ".pub"
}

// LoadOrCreateSigningKey reads the Ed25519 private key at path (PEM PKCS#8
// "PRIVATE KEY", or the raw 32-byte seed), or creates it (PEM, mode 0600)
// when path does not exist. It refuses a key file accessible to others, or
// to its group, except as PostgreSQL allows for its server key: a file
// owned by root may be readable by its group (at most 0640), which is how
// Kubernetes mounts a Secret for a non-root pod (root:fsGroup, 0440). The public key is written beside it (PublicKeyPath, PEM
// "PUBLIC KEY", mode 0644) so an operator can pin it: a failure to write it
// is an error for a new key, and ignored for an existing one (its directory
// may be read-only).
func LoadOrCreateSigningKey(path string) (ed25519.PrivateKey, error) {
	fi, err := os.Stat(path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		priv, err := createSigningKey(path)
		if err != nil {
			return nil, err
		}
		if err := WritePublicKey(PublicKeyPath(path), priv.Public().(ed25519.PublicKey)); err != nil {
			return nil, err
		}
		return priv, nil
	case err != nil:
		return nil, fmt.Errorf("read signing key %s: %w", path, err)
	}
	if fi.IsDir() {
		return nil, fmt.Errorf("read signing key %s: is a directory", path)
	}
	if err := checkKeyMode(path, fi); err != nil {
		return nil, err
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read signing key %s: %w", path, err)
	}
	priv, err := ParsePrivateKey(data)
	if err != nil {
		return nil, fmt.Errorf("read signing key %s: %w", path, err)
	}
	pubPath := PublicKeyPath(path)
	if old, err := os.ReadFile(pubPath); err != nil || !bytes.Equal(old, EncodePublicKey(priv.Public().(ed25519.PublicKey))) {
		_ = WritePublicKey(pubPath, priv.Public().(ed25519.PublicKey))
	}
	return priv, nil
}

func createSigningKey(path string) (ed25519.PrivateKey, error) {
	_, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("generate signing key: %w", err)
	}
	der, err := x509.MarshalPKCS8PrivateKey(priv)
	if err != nil {
		return nil, fmt.Errorf("encode signing key: %w", err)
	}
	data := pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der})
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, fmt.Errorf("create signing key %s: %w", path, err)
	}
	// Written under a temporary name and linked into place, so a crash
	// never leaves a half-written key, and two starting captures cannot
	// both create one: the loser reads the winner's.
	tmp, err := os.CreateTemp(filepath.Dir(path), ".signing-key-*")
	if err != nil {
		return nil, fmt.Errorf("create signing key %s: %w", path, err)
	}
	defer os.Remove(tmp.Name())
	if err := tmp.Chmod(0o600); err == nil {
		_, err = tmp.Write(data)
		if err == nil {
			err = tmp.Sync()
		}
		if cerr := tmp.Close(); err == nil {
			err = cerr
		}
		if err == nil {
			err = os.Link(tmp.Name(), path)
		}
		if errors.Is(err, fs.ErrExist) {
			return LoadOrCreateSigningKey(path)
		}
		if err != nil {
			return nil, fmt.Errorf("create signing key %s: %w", path, err)
		}
	} else {
		tmp.Close()
		return nil, fmt.Errorf("create signing key %s: %w", path, err)
	}
	return priv, nil
}

// ParsePrivateKey parses an Ed25519 private key: PEM PKCS#8 "PRIVATE KEY",
// or the raw 32-byte seed.
func ParsePrivateKey(data []byte) (ed25519.PrivateKey, error) {
	if blk, _ := pem.Decode(data); blk != nil {
		if blk.Type != "PRIVATE KEY" {
			return nil, fmt.Errorf("parse signing key: PEM block %q, want \"PRIVATE KEY\" (PKCS#8 Ed25519)", blk.Type)
		}
		k, err := x509.ParsePKCS8PrivateKey(blk.Bytes)
		if err != nil {
			return nil, fmt.Errorf("parse signing key: %w", err)
		}
		priv, ok := k.(ed25519.PrivateKey)
		if !ok {
			return nil, fmt.Errorf("parse signing key: a %T, not an Ed25519 key", k)
		}
		return priv, nil
	}
	if len(data) == ed25519.SeedSize {
		return ed25519.NewKeyFromSeed(data), nil
	}
	return nil, fmt.Errorf("parse signing key: neither PEM (PKCS#8 \"PRIVATE KEY\") nor a raw %d-byte Ed25519 seed (%d bytes)", ed25519.SeedSize, len(data))
}

// EncodePublicKey returns pub as PEM "PUBLIC KEY" (PKIX).
func EncodePublicKey(pub ed25519.PublicKey) []byte {
	der, err := x509.MarshalPKIXPublicKey(pub)
	if err != nil {
		panic("marshal ed25519 public key: " + err.Error()) // cannot happen for a 32-byte key
	}
	return pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: der})
}

// WritePublicKey writes pub to path as EncodePublicKey does, mode 0644.
func WritePublicKey(path string, pub ed25519.PublicKey) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, EncodePublicKey(pub), 0o644); err != nil {
		return fmt.Errorf("write public key %s: %w", path, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("write public key %s: %w", path, err)
	}
	return nil
}

// ParsePublicKey parses an Ed25519 public key: PEM "PUBLIC KEY" (PKIX), or
// its 32 bytes in standard base64 or in hex (surrounding space ignored).
func ParsePublicKey(data []byte) (ed25519.PublicKey, error) {
	if blk, _ := pem.Decode(data); blk != nil {
		if blk.Type != "PUBLIC KEY" {
			return nil, fmt.Errorf("parse public key: PEM block %q, want \"PUBLIC KEY\"", blk.Type)
		}
		k, err := x509.ParsePKIXPublicKey(blk.Bytes)
		if err != nil {
			return nil, fmt.Errorf("parse public key: %w", err)
		}
		pub, ok := k.(ed25519.PublicKey)
		if !ok {
			return nil, fmt.Errorf("parse public key: a %T, not an Ed25519 key", k)
		}
		return pub, nil
	}
	s := strings.TrimSpace(string(data))
	if raw, err := hex.DecodeString(s); err == nil && len(raw) == ed25519.PublicKeySize {
		return ed25519.PublicKey(raw), nil
	}
	if raw, err := base64.StdEncoding.DecodeString(s); err == nil && len(raw) == ed25519.PublicKeySize {
		return ed25519.PublicKey(raw), nil
	}
	return nil, errors.New("parse public key: neither PEM \"PUBLIC KEY\" nor 32 bytes in base64 or hex")
}

// PublicKeyString is pub's 32 bytes in standard base64, for logs and status
// (ParsePublicKey reads it back).
func PublicKeyString(pub ed25519.PublicKey) string {
	return base64.StdEncoding.EncodeToString(pub)
}

// RepublishedMsgID is the Nats-Msg-Id under which the capture publishes a
// message again when its own id was taken by a message it did not publish
// in this session (its ids are tagged with the signing key, MsgIDTagger:
// only a writer holding the key, or a stored message of its own it did not
// adopt, can hold one): "<id>/r<n>", n from 1. The signature and digest
// cover the message as republished; BaseMsgID returns the original id.
func RepublishedMsgID(id string, n int) string { return id + "/r" + strconv.Itoa(n) }

// BaseMsgID strips a RepublishedMsgID suffix, returning the message's
// original id and the republish count (0 for an original id).
func BaseMsgID(id string) (string, int) {
	i := strings.LastIndex(id, "/r")
	if i < 0 {
		return id, 0
	}
	n, err := strconv.Atoi(id[i+2:])
	if err != nil || n < 1 || strconv.Itoa(n) != id[i+2:] {
		return id, 0
	}
	return id[:i], n
}

// checkKeyMode refuses a key file others may access, or its group may,
// unless the file is root's and its group may only read it (PostgreSQL's
// rule for ssl_key_file: u=rw if owned by the user, u=rw,g=r if owned by
// root).
func checkKeyMode(path string, fi fs.FileInfo) error {
	perm := fi.Mode().Perm()
	if perm&0o077 == 0 {
		return nil
	}
	if perm&0o037 == 0 && ownedByRoot(fi) {
		return nil // root:group, group read only (a Kubernetes Secret with fsGroup)
	}
	return fmt.Errorf("signing key %s has mode %04o: it must not be accessible to group or others (chmod 600 %s; "+
		"a file owned by root may be group-readable: 0640 or 0440)", path, perm, path)
}
