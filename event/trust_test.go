package event_test

import (
	"crypto/ed25519"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
)

// oneShotDigest is the Epitaph-Digest definition written out directly.
func oneShotDigest(seqs []uint64, bodies [][]byte) string {
	var all []byte
	for i, b := range bodies {
		all = binary.BigEndian.AppendUint64(all, seqs[i])
		all = binary.BigEndian.AppendUint32(all, uint32(len(b)))
		all = append(all, b...)
	}
	s := sha256.Sum256(all)
	return "sha256:" + hex.EncodeToString(s[:])
}

func TestDigestIncrementalEqualsOneShot(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name   string
		seqs   []uint64
		bodies [][]byte
	}{
		{"empty", nil, nil},
		{"one", []uint64{1}, [][]byte{[]byte(`{"v":1}`)}},
		{"empty body", []uint64{7}, [][]byte{{}}},
		{"several", []uint64{3, 4, 9}, [][]byte{[]byte("a"), []byte("bb"), make([]byte, 70000)}},
		{"big seq", []uint64{1<<63 + 5}, [][]byte{[]byte("x")}},
	}
	for _, c := range cases {
		d := event.NewDigest()
		for i, b := range c.bodies {
			d.Add(c.seqs[i], b)
		}
		require.Equal(t, oneShotDigest(c.seqs, c.bodies), d.Sum(), c.name)
		require.Equal(t, d.Sum(), d.Sum(), "%s: Sum does not change the state", c.name)
		require.Equal(t, uint64(len(c.bodies)), d.Len(), c.name)
		d.Reset()
		require.Equal(t, oneShotDigest(nil, nil), d.Sum(), "%s: reset", c.name)
	}
	// The framing matters: moving a byte from one body to the next changes it.
	a, b := event.NewDigest(), event.NewDigest()
	a.Add(1, []byte("ab"))
	a.Add(2, []byte("c"))
	b.Add(1, []byte("a"))
	b.Add(2, []byte("bc"))
	require.NotEqual(t, a.Sum(), b.Sum())
	// So does the partition sequence.
	c := event.NewDigest()
	c.Add(1, []byte("ab"))
	c.Add(3, []byte("c"))
	require.NotEqual(t, a.Sum(), c.Sum())
}

func TestDigestStateRoundTrip(t *testing.T) {
	t.Parallel()
	full := event.NewDigest()
	half := event.NewDigest()
	for i := uint64(1); i <= 10; i++ {
		body := []byte(`{"seq":` + string(rune('0'+i%10)) + `}`)
		full.Add(i, body)
		if i <= 4 {
			half.Add(i, body)
		}
	}
	st, err := half.MarshalBinary()
	require.NoError(t, err)
	var resumed event.Digest // a zero Digest restores too
	require.NoError(t, resumed.UnmarshalBinary(st))
	require.Equal(t, uint64(4), resumed.Len())
	require.Equal(t, half.Sum(), resumed.Sum())
	for i := uint64(5); i <= 10; i++ {
		resumed.Add(i, []byte(`{"seq":`+string(rune('0'+i%10))+`}`))
	}
	require.Equal(t, full.Sum(), resumed.Sum())

	require.Error(t, resumed.UnmarshalBinary(nil))
	require.Error(t, resumed.UnmarshalBinary([]byte("garbage state")))
	require.Error(t, resumed.UnmarshalBinary(st[:len(st)-3]))
}

func TestDigestAddDoesNotAllocate(t *testing.T) {
	body := make([]byte, 300)
	for _, d := range []*event.Digest{event.NewDigest(), event.NewDigestV2()} {
		n := testing.AllocsPerRun(1000, func() { d.Add(42, body) })
		require.Zero(t, n, "v2: %v", d.V2())
	}
}

func testKey(t *testing.T) (ed25519.PublicKey, ed25519.PrivateKey) {
	t.Helper()
	pub, priv, err := ed25519.GenerateKey(rand.Reader)
	require.NoError(t, err)
	return pub, priv
}

func TestSigningInputLayout(t *testing.T) {
	t.Parallel()
	got := event.SigningInput(event.SignedFields{Subject: "epitaph.main.3.commit", MsgID: "main/0/1/commit",
		Position: "0/1#2", PartSeq: "17", Digest: "sha256:ab"}, []byte(`{"v":1}`))
	require.Equal(t, "epitaph-sig-v1\nepitaph.main.3.commit\nmain/0/1/commit\n0/1#2\n17\nsha256:ab\n{\"v\":1}", string(got))
	require.Equal(t, "epitaph-sig-v1\ns\nid\np\n1\n\nb", string(event.SigningInput(event.SignedFields{Subject: "s", MsgID: "id", Position: "p", PartSeq: "1"}, []byte("b"))))
}

// header is a minimal event.HeaderGetter.
type header map[string]string

func (h header) Get(k string) string { return h[k] }

func signedCommit(priv ed25519.PrivateKey) (string, header, []byte) {
	subject, body := "epitaph.main.3.commit", []byte(`{"v":1,"op":"commit","rows":2}`)
	h := header{
		event.HeaderMsgID:        "main/0/1A2B3C8/commit",
		event.HeaderPosition:     "0/1A2B3C8#2",
		event.HeaderPartitionSeq: "17",
		event.HeaderDigest:       "sha256:00ff",
		event.HeaderKeyID:        event.KeyID(priv.Public().(ed25519.PublicKey)),
	}
	h[event.HeaderSignature] = event.Sign(priv, event.MessageSigningInput(subject, h, body))
	return subject, h, body
}

func TestSignVerify(t *testing.T) {
	t.Parallel()
	pub, priv := testKey(t)
	otherPub, otherPriv := testKey(t)
	subject, h, body := signedCommit(priv)
	require.NoError(t, event.VerifyMessage(pub, subject, h, body))
	require.Regexp(t, `^ed25519:[A-Za-z0-9+/]+=*$`, h[event.HeaderSignature])
	require.Regexp(t, `^[0-9a-f]{16}$`, event.KeyID(pub))
	require.NotEqual(t, event.KeyID(pub), event.KeyID(otherPub))

	with := func(k, v string) header {
		c := header{}
		for kk, vv := range h {
			c[kk] = vv
		}
		c[k] = v
		return c
	}
	flipped := append([]byte(nil), body...)
	flipped[len(flipped)-2] = '3'
	_, otherH, _ := signedCommit(otherPriv)
	cases := []struct {
		name    string
		pub     ed25519.PublicKey
		subject string
		h       header
		body    []byte
	}{
		{"tampered body", pub, subject, h, flipped},
		{"truncated body", pub, subject, h, body[:len(body)-1]},
		{"other subject", pub, "epitaph.main.4.commit", h, body},
		{"tampered digest", pub, subject, with(event.HeaderDigest, "sha256:00fe"), body},
		{"digest removed", pub, subject, with(event.HeaderDigest, ""), body},
		{"tampered position", pub, subject, with(event.HeaderPosition, "FFFFFFFF/FFFFFFF0#0"), body},
		{"tampered partition seq", pub, subject, with(event.HeaderPartitionSeq, "18"), body},
		{"tampered msg id", pub, subject, with(event.HeaderMsgID, "main/0/1A2B3C8/commit/r1"), body},
		{"unsigned", pub, subject, with(event.HeaderSignature, ""), body},
		{"garbage signature", pub, subject, with(event.HeaderSignature, "ed25519:!!!"), body},
		{"short signature", pub, subject, with(event.HeaderSignature, "ed25519:AAAA"), body},
		{"other scheme", pub, subject, with(event.HeaderSignature, "rsa:AAAA"), body},
		{"other key, our key id", pub, subject, with(event.HeaderSignature, otherH[event.HeaderSignature]), body},
		{"other key", otherPub, subject, h, body},
		{"bad public key", ed25519.PublicKey{1, 2, 3}, subject, h, body},
	}
	for _, c := range cases {
		err := event.VerifyMessage(c.pub, c.subject, c.h, c.body)
		require.Error(t, err, c.name)
		require.True(t, errors.Is(err, event.ErrBadSignature), "%s: %v", c.name, err)
	}
	// Verify alone, with the raw signing input.
	in := event.SigningInput(event.SignedFields{Subject: "s", MsgID: "id", Position: "p", PartSeq: "1"}, []byte("b"))
	sig := event.Sign(priv, in)
	require.NoError(t, event.Verify(pub, in, sig))
	require.ErrorIs(t, event.Verify(pub, append(in, 'x'), sig), event.ErrBadSignature)
}

func TestLoadOrCreateSigningKey(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	path := filepath.Join(dir, "signing.key")
	priv, err := event.LoadOrCreateSigningKey(path)
	require.NoError(t, err)
	fi, err := os.Stat(path)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), fi.Mode().Perm())
	pubPEM, err := os.ReadFile(filepath.Join(dir, "signing.pub"))
	require.NoError(t, err)
	pub, err := event.ParsePublicKey(pubPEM)
	require.NoError(t, err)
	require.Equal(t, priv.Public(), pub)

	// Loaded again: the same key; a removed public key file comes back.
	require.NoError(t, os.Remove(filepath.Join(dir, "signing.pub")))
	again, err := event.LoadOrCreateSigningKey(path)
	require.NoError(t, err)
	require.True(t, priv.Equal(again))
	_, err = os.Stat(filepath.Join(dir, "signing.pub"))
	require.NoError(t, err)

	// Group or world access is refused, naming the fix; a file owned by
	// root may be group-readable (PostgreSQL's rule for its key; how
	// Kubernetes mounts a Secret for a non-root pod with fsGroup: 0440).
	refused := []os.FileMode{0o604, 0o660, 0o666, 0o644}
	if os.Geteuid() == 0 {
		for _, mode := range []os.FileMode{0o640, 0o440} {
			require.NoError(t, os.Chmod(path, mode))
			_, err = event.LoadOrCreateSigningKey(path)
			require.NoError(t, err, "root-owned, group read only: mode %o", mode)
		}
		// Not root's: group access is refused.
		require.NoError(t, os.Chown(path, 10001, 10001))
		for _, mode := range []os.FileMode{0o640, 0o440} {
			require.NoError(t, os.Chmod(path, mode))
			_, err = event.LoadOrCreateSigningKey(path)
			require.ErrorContains(t, err, "chmod 600", "owned by 10001, mode %o", mode)
		}
		require.NoError(t, os.Chown(path, 0, 0))
	} else {
		refused = append(refused, 0o640, 0o440)
	}
	for _, mode := range refused {
		require.NoError(t, os.Chmod(path, mode))
		_, err = event.LoadOrCreateSigningKey(path)
		require.ErrorContains(t, err, "chmod 600", "mode %o", mode)
	}
	require.NoError(t, os.Chmod(path, 0o600))

	// A raw 32-byte seed is accepted.
	seedPath := filepath.Join(dir, "seed")
	require.NoError(t, os.WriteFile(seedPath, priv.Seed(), 0o600))
	fromSeed, err := event.LoadOrCreateSigningKey(seedPath)
	require.NoError(t, err)
	require.True(t, priv.Equal(fromSeed))
	require.FileExists(t, seedPath+".pub")

	// Anything else is one clear error.
	bad := filepath.Join(dir, "bad.key")
	require.NoError(t, os.WriteFile(bad, []byte("not a key"), 0o600))
	_, err = event.LoadOrCreateSigningKey(bad)
	require.ErrorContains(t, err, "neither PEM")
	rsa := filepath.Join(dir, "rsa.key")
	require.NoError(t, os.WriteFile(rsa, []byte("-----BEGIN RSA PRIVATE KEY-----\nAAAA\n-----END RSA PRIVATE KEY-----\n"), 0o600))
	_, err = event.LoadOrCreateSigningKey(rsa)
	require.ErrorContains(t, err, `"RSA PRIVATE KEY"`)
	_, err = event.LoadOrCreateSigningKey(dir)
	require.ErrorContains(t, err, "directory")

	// A new key in a directory that does not exist yet.
	nested := filepath.Join(dir, "a", "b", "signing.key")
	_, err = event.LoadOrCreateSigningKey(nested)
	require.NoError(t, err)
	require.FileExists(t, filepath.Join(dir, "a", "b", "signing.pub"))
}

func TestParsePublicKeyForms(t *testing.T) {
	t.Parallel()
	pub, _ := testKey(t)
	for _, in := range []string{string(event.EncodePublicKey(pub)), event.PublicKeyString(pub), hex.EncodeToString(pub), " " + event.PublicKeyString(pub) + "\n"} {
		got, err := event.ParsePublicKey([]byte(in))
		require.NoError(t, err, in)
		require.Equal(t, pub, got)
	}
	_, err := event.ParsePublicKey([]byte("AAAA"))
	require.Error(t, err)
}

func TestRepublishedMsgID(t *testing.T) {
	t.Parallel()
	cases := []struct {
		id   string
		base string
		n    int
	}{
		{"main/0/1A/3", "main/0/1A/3", 0},
		{"main/0/1A/3/r1", "main/0/1A/3", 1},
		{"main/0/1A/commit/r12", "main/0/1A/commit", 12},
		{"main/0/1A/3/r0", "main/0/1A/3/r0", 0},
		{"main/0/1A/3/r01", "main/0/1A/3/r01", 0},
		{"main/0/1A/3/rx", "main/0/1A/3/rx", 0},
		{"r/r2", "r", 2},
	}
	for _, c := range cases {
		b, n := event.BaseMsgID(c.id)
		require.Equal(t, c.base, b, c.id)
		require.Equal(t, c.n, n, c.id)
	}
	require.Equal(t, "main/0/1A/3/r2", event.RepublishedMsgID("main/0/1A/3", 2))
}

// oneShotDigestV2 is digest v2 written out directly: sha256 over the
// sha256 of every body, in order.
func oneShotDigestV2(bodies [][]byte) string {
	var all []byte
	for _, b := range bodies {
		s := sha256.Sum256(b)
		all = append(all, s[:]...)
	}
	s := sha256.Sum256(all)
	return "sha256:" + hex.EncodeToString(s[:])
}

// Digest v2 is the hash of the bodies' hashes: a body known only by its
// hash (a purged message, from the erasure ledger) stands in for the body,
// which v1 cannot allow; the partition sequence is not part of it; the
// state round-trips with its version.
func TestDigestV2(t *testing.T) {
	t.Parallel()
	bodies := [][]byte{[]byte(`{"seq":0}`), []byte(`{"seq":1,"email":"ann@example.com"}`), make([]byte, 70000)}
	d := event.NewDigestV2()
	require.True(t, d.V2())
	for i, b := range bodies {
		d.Add(uint64(i+1), b)
	}
	require.Equal(t, oneShotDigestV2(bodies), d.Sum())
	require.NotEqual(t, oneShotDigest([]uint64{1, 2, 3}, bodies), d.Sum(), "not v1")

	// The middle body purged: its hash stands in for it.
	p := event.NewDigestV2()
	p.Add(1, bodies[0])
	require.NoError(t, p.AddBodyHash(event.BodyHash(bodies[1])))
	p.Add(3, bodies[2])
	require.Equal(t, d.Sum(), p.Sum())
	// A wrong hash, or one left out, does not verify.
	q := event.NewDigestV2()
	q.Add(1, bodies[0])
	require.NoError(t, q.AddBodyHash(event.BodyHash([]byte("another body"))))
	q.Add(3, bodies[2])
	require.NotEqual(t, d.Sum(), q.Sum())
	r := event.NewDigestV2()
	r.Add(1, bodies[0])
	r.Add(3, bodies[2])
	require.NotEqual(t, d.Sum(), r.Sum())
	// v1 has no stand-in.
	require.Error(t, event.NewDigest().AddBodyHash(event.BodyHash(bodies[0])))

	// The state keeps the version: a v2 state resumes as v2.
	half := event.NewDigestV2()
	half.Add(1, bodies[0])
	st, err := half.MarshalBinary()
	require.NoError(t, err)
	var resumed event.Digest
	require.NoError(t, resumed.UnmarshalBinary(st))
	require.True(t, resumed.V2())
	resumed.Add(2, bodies[1])
	resumed.Add(3, bodies[2])
	require.Equal(t, d.Sum(), resumed.Sum())

	// ResetAlg switches the version for the next transaction.
	d.ResetAlg(false)
	require.False(t, d.V2())
	d.Add(1, bodies[0])
	require.Equal(t, oneShotDigest([]uint64{1}, bodies[:1]), d.Sum())
	d.ResetAlg(true)
	d.Add(9, bodies[0])
	require.Equal(t, oneShotDigestV2(bodies[:1]), d.Sum())
}
