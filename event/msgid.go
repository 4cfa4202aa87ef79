package event

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/ed25519"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"strconv"
	"strings"
)

// MsgIDTagger makes the Nats-Msg-Id of row and truncate messages
// unpredictable to anyone without the capture's signing key:
// <src>/<commit_lsn>/<seq>/t<16 hex digits>, the digits the first 8 bytes
// of AES-128 (key derived from the signing key's seed) of the commit LSN
// and seq. The same key gives the same ids, so JetStream still drops a
// re-publish of the same row (after a crash, a replay); but a writer who
// sees a transaction's first row on the stream cannot take the id of its
// next one before the capture publishes it (JetStream would drop the real
// row as a duplicate of the forgery, and a row published without its own
// acknowledgement cannot be told it was dropped). Commits, marks and gaps
// keep plain ids: they are always acknowledged, and the capture republishes
// one whose id was taken (RepublishedMsgID). One AES block per row.
type MsgIDTagger struct{ block cipher.Block }

// NewMsgIDTagger derives the tagger of a signing key.
func NewMsgIDTagger(priv ed25519.PrivateKey) *MsgIDTagger {
	k := sha256.Sum256(append([]byte("epitaph msg-id tag v1\x00"), priv.Seed()...))
	b, err := aes.NewCipher(k[:16])
	if err != nil {
		panic("event: aes.NewCipher with a 16-byte key: " + err.Error()) // cannot happen
	}
	return &MsgIDTagger{block: b}
}

// AppendTag appends "/t" and the tag of (commitLSN, seq) to dst.
func (t *MsgIDTagger) AppendTag(dst []byte, commitLSN LSN, seq int) []byte {
	var in, out [16]byte
	binary.BigEndian.PutUint64(in[:8], uint64(commitLSN))
	binary.BigEndian.PutUint64(in[8:], uint64(seq))
	t.block.Encrypt(out[:], in[:])
	dst = append(dst, '/', 't')
	return hex.AppendEncode(dst, out[:8])
}

// RowMsgID is the Nats-Msg-Id of a row or truncate message the capture
// publishes: MsgID(src, commitLSN, seq) and its tag.
func (t *MsgIDTagger) RowMsgID(src string, commitLSN LSN, seq int) string {
	b := make([]byte, 0, len(src)+40)
	b = append(b, src...)
	b = append(b, '/')
	b = append(b, commitLSN.String()...)
	b = append(b, '/')
	b = strconv.AppendInt(b, int64(seq), 10)
	return string(t.AppendTag(b, commitLSN, seq))
}

// UntaggedMsgID is id without a row tag: MsgID's form (for ids of streams
// written before tags, and for reading ids).
func UntaggedMsgID(id string) string {
	i := strings.LastIndex(id, "/t")
	if i < 0 || len(id)-i != 18 {
		return id
	}
	if _, err := hex.DecodeString(id[i+2:]); err != nil {
		return id
	}
	return id[:i]
}
