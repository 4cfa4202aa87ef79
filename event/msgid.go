package event

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/ed25519"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"strconv"
	"strings"
)

// MsgIDTagger makes every Nats-Msg-Id the capture publishes unpredictable
// to anyone without its signing key: the id's plain form (MsgID,
// CommitMsgID, MarkMsgID, GapMsgID, TableGapMsgID) followed by "/t" and 16
// hex digits keyed by the signing key.
//
//   - Rows and truncates, <src>/<commit_lsn>/<seq>/t<tag>: the first 8
//     bytes of AES-128 (key derived from the signing key's seed) of the
//     commit LSN and seq, one AES block per row.
//   - Commits, marks and heartbeats (each partition's copy), gaps:
//     <plain id>/t<tag>, the tag the first 8 bytes of HMAC-SHA256 (another
//     key derived from the seed) of the plain id.
//
// The same key gives the same ids, so JetStream still drops a re-publish of
// the same message (after a crash, a replay); but a writer who sees the
// stream cannot take the id of a message before the capture publishes it.
// Had it done so, JetStream would drop the real message as a duplicate of
// the forgery; a row published without an acknowledgement of its own
// could not be told it was dropped, and a forged commit stored between a
// transaction's last row and its commit would let the next message chain
// to it (its expected last id is the commit's), so that a new session
// resumed after the commit and never published it. UntaggedMsgID gives the
// plain form back: operators read ids as before, and ids stored untagged
// by an older capture compare equal.
type MsgIDTagger struct {
	block  cipher.Block
	macKey []byte
}

// NewMsgIDTagger derives the tagger of a signing key.
func NewMsgIDTagger(priv ed25519.PrivateKey) *MsgIDTagger {
	k := sha256.Sum256(append([]byte("epitaph msg-id tag v1\x00"), priv.Seed()...))
	b, err := aes.NewCipher(k[:16])
	if err != nil {
		panic("event: aes.NewCipher with a 16-byte key: " + err.Error()) // cannot happen
	}
	mk := sha256.Sum256(append([]byte("epitaph msg-id tag v2 signed\x00"), priv.Seed()...))
	return &MsgIDTagger{block: b, macKey: mk[:]}
}

// Tag appends "/t" and the keyed tag of id to id: the Nats-Msg-Id of a
// commit, mark, heartbeat or gap whose plain id is id.
func (t *MsgIDTagger) Tag(id string) string {
	mac := hmac.New(sha256.New, t.macKey)
	mac.Write([]byte(id))
	var sum [sha256.Size]byte
	b := make([]byte, 0, len(id)+18)
	b = append(b, id...)
	b = append(b, '/', 't')
	return string(hex.AppendEncode(b, mac.Sum(sum[:0])[:8]))
}

// CommitMsgID is the Nats-Msg-Id of a commit: CommitMsgID and its tag.
func (t *MsgIDTagger) CommitMsgID(src string, commitLSN LSN) string {
	return t.Tag(CommitMsgID(src, commitLSN))
}

// MarkMsgID is the Nats-Msg-Id of a mark or heartbeat copy for partition
// p: MarkMsgID and its tag.
func (t *MsgIDTagger) MarkMsgID(src string, lsn LSN, p int) string {
	return t.Tag(MarkMsgID(src, lsn, p))
}

// GapMsgID is the Nats-Msg-Id of a gap copy for partition p: GapMsgID and
// its tag.
func (t *MsgIDTagger) GapMsgID(src string, from, to LSN, p int) string {
	return t.Tag(GapMsgID(src, from, to, p))
}

// TableGapMsgID is the Nats-Msg-Id of a one-table gap copy for partition
// p: TableGapMsgID and its tag.
func (t *MsgIDTagger) TableGapMsgID(src, schema, table string, from, to LSN, p int) string {
	return t.Tag(TableGapMsgID(src, schema, table, from, to, p))
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

// UntaggedMsgID is id without its tag: the plain form (MsgID,
// CommitMsgID, MarkMsgID, GapMsgID, TableGapMsgID), for ids of streams
// written before tags and for reading ids. An id without a tag is returned
// as it is.
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
