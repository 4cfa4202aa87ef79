package testenv

import (
	"crypto/ed25519"
	"crypto/rand"
	"strconv"
	"strings"
	"sync"

	"github.com/nats-io/nats.go"

	"github.com/epitaph-dev/epitaph/event"
)

// Signer signs messages a test publishes itself the way the capture does:
// every message gets Epitaph-Partition-Seq (per partition, +1 each), commits
// get Epitaph-Digest over the row and truncate messages signed since the
// partition's last commit, and commits, marks, heartbeats and gaps get
// Epitaph-Key-Id, the public key (Epitaph-Public-Key, so a projector can
// trust it on first use) and Epitaph-Signature. Sign messages in the order
// they are published.
type Signer struct {
	Key ed25519.PrivateKey
	// V2 signs with digest v2, as a capture does now: rows, truncates and
	// commits get Epitaph-Digest-Alg: v2. Without it, digest v1 (a stream
	// written before v2). Set it before the first Sign.
	V2 bool

	mu      sync.Mutex
	seq     map[int]uint64
	digests map[int]*event.Digest
}

// NewSignerV2 makes a signer with a fresh key that signs digest v2.
func NewSignerV2() *Signer {
	s := NewSigner()
	s.V2 = true
	return s
}

// NewSigner makes a signer with a fresh key (digest v1).
func NewSigner() *Signer {
	_, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		panic(err)
	}
	return &Signer{Key: priv, seq: map[int]uint64{}, digests: map[int]*event.Digest{}}
}

// Public is the signer's public key.
func (s *Signer) Public() ed25519.PublicKey { return s.Key.Public().(ed25519.PublicKey) }

// Sign adds the trust headers to m. A message signed already (it has
// Epitaph-Partition-Seq) is left as it is, so publishing it again is a
// duplicate, as a capture's re-send is. A subject that is not a partition
// subject is left alone.
func (s *Signer) Sign(m *nats.Msg) {
	if m.Header == nil {
		m.Header = nats.Header{}
	}
	if m.Header.Get(event.HeaderPartitionSeq) != "" {
		return
	}
	p, err := event.PartitionOf(m.Subject)
	if err != nil {
		return
	}
	kind := ""
	if parts := strings.SplitN(m.Subject, ".", 5); len(parts) >= 4 {
		kind = parts[3]
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.seq[p]++
	m.Header.Set(event.HeaderPartitionSeq, strconv.FormatUint(s.seq[p], 10))
	d := s.digests[p]
	if d == nil {
		d = event.NewDigest()
		if s.V2 {
			d = event.NewDigestV2()
		}
		s.digests[p] = d
	}
	switch kind {
	case "delete", "truncate":
		if s.V2 {
			m.Header.Set(event.HeaderDigestAlg, event.DigestAlgV2)
		}
		d.Add(s.seq[p], m.Data)
		return
	case "commit":
		m.Header.Set(event.HeaderDigest, d.Sum())
		if s.V2 {
			m.Header.Set(event.HeaderDigestAlg, event.DigestAlgV2)
		}
		d.Reset()
	case "mark", "gap":
	default:
		return
	}
	s.SignOnly(m)
}

// SignOnly sets the key id, public key and signature over m as its
// headers stand now (no partition sequence or digest bookkeeping).
func (s *Signer) SignOnly(m *nats.Msg) {
	pub := s.Public()
	m.Header.Set(event.HeaderKeyID, event.KeyID(pub))
	m.Header.Set(event.HeaderPublicKey, event.PublicKeyString(pub))
	m.Header.Set(event.HeaderSignature, event.Sign(s.Key, event.MessageSigningInput(m.Subject, m.Header, m.Data)))
}

// Skip counts n messages of partition p as published without publishing
// them (as if they had been removed from the stream since).
func (s *Signer) Skip(p int, n uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.seq[p] += n
}

// Rewind numbers partition p's next messages from n+1 again, as a capture
// that lost its counters would (a partition sequence that goes back).
func (s *Signer) Rewind(p int, n uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.seq[p] = n
}
