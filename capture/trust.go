package capture

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/epitaph-dev/epitaph/event"
)

// The capture never believes a foreign message.
//
// Anyone who can publish to the stream can write anything there, with any
// header: positions, message ids and partition sequences are predictable.
// So the resume rests only on what the capture can prove it published:
//
//   - Commits, marks, heartbeats and gaps are signed (event.SigningInput
//     covers subject, message id, position, partition sequence, digest and
//     body). The resume position is the position of the last message of the
//     stream whose signature verifies with the capture's key, is plausible
//     (its LSN is not beyond the source's pg_current_wal_lsn: a verified
//     message from the future means the source was rewound or the key is
//     used elsewhere, and is refused loudly) and that is a transaction
//     boundary: a commit, a non-transactional mark or heartbeat, or a gap.
//     A transactional mark only says "a transaction is open here", so the
//     walk goes on to that transaction's start.
//   - Everything at or before that position is in the stream: each session
//     chains its messages with Nats-Expected-Last-Msg-Id, so what it stored
//     is a prefix of what it sent, and each session starts where the proven
//     part of the previous one ends. Those messages are skipped on replay.
//   - Rows and truncates are not signed one by one (the hot path affords
//     one hash update per row, not a signature): the stream may hold the
//     first rows of the transaction that was open when the last session
//     ended, whose commit is not in the stream yet. They are "chained to
//     the verified message" by the slot itself: the slot replays that
//     transaction, and each message the capture is about to publish after
//     the resume position is looked for among the stored messages after the
//     verified one, in stream order. A stored message is adopted (not
//     published again) only when it is byte for byte what the capture would
//     publish now: same subject, position, message id (or a republished id
//     of it), body, and the next partition sequence of its partition (a
//     transactional mark, signed, is adopted when it verifies there: its
//     time is when the slot sent it, so its body differs on replay). Its
//     partition sequence and body go into the transaction's digest, which
//     the commit signs, so an adopted message is proven by that signature
//     once the commit is published. A forger's copy of a real row can only
//     be adopted if it is identical to it, which is harmless. Stored
//     messages that match nothing are foreign; the first message of the
//     replay that is not found ends the adoption (the stored prefix cannot
//     continue after a hole) and everything from it on is published.
//   - A foreign message is logged once with its stream sequence and counted
//     (epitaph_capture_foreign_messages_total), never believed, and never
//     stops the capture: the first message of every session expects no
//     particular last message id (the stream's tail proves nothing), and a
//     foreign message published while streaming breaks the chain, which
//     ends the session; the capture starts a new one in the same process
//     (the loop in runLoop) from the slot's confirmed position, which
//     never passed a transaction whose messages were not all acknowledged.
//   - Every message id carries a tag keyed by the signing key
//     (event.MsgIDTagger): rows, and commits, marks, heartbeats and gaps,
//     so nobody without the key can take an id before the capture
//     publishes its message. Had a forger done so, JetStream would drop the
//     real message as a duplicate: a row published without an
//     acknowledgement of its own could not be told it was dropped, and a
//     forged commit stored between a transaction's last row and its
//     commit would hold the id the next message expects as the stream's
//     last, so that message would chain to the forgery and a new session
//     would resume past a commit that is not in the stream. A forgery
//     under a plain (or any other) id is only a foreign message in the
//     chain. Nothing here reads an id's shape: the resume rests on
//     signatures and positions, and adoption compares ids without their
//     tags, so a stream written by an older capture with plain ids is
//     resumed as its own. A message JetStream still answers as a
//     duplicate (only a writer holding the key could cause it, or a
//     stored message the replay did not adopt, inside the window) is
//     noticed (a PubAck with Duplicate, or the chain failing on the next
//     message), and the new session publishes its first messages one at a
//     time, each acknowledged, republishing one acknowledged as a
//     duplicate under event.RepublishedMsgID (id + "/r<n>"), so the real
//     message is in the stream after its transaction started and the
//     commit's digest covers it.

// resumePoint is what the stream proves of the capture's earlier output.
type resumePoint struct {
	has bool
	pos position // last own transaction boundary
	// partSeq per partition: the last proven Epitaph-Partition-Seq.
	partSeq []uint64
	// adoptFrom..adoptTo are the stream sequences after the verified
	// boundary message: candidates for adoption (0, 0: none).
	adoptFrom, adoptTo uint64
	// recorded per partition: the highest sequence recorded outside the
	// stream (seqRecords.seqs), as of slotLSN.
	recorded []uint64
	// slotLSN: the highest position recorded as confirmed to the slot
	// (seqRecords.slotLSN; 0: none).
	slotLSN event.LSN
	// timeline: the source's timeline recorded with it (0: none).
	timeline int32
}

// streamReader is the part of jetstream.Stream the resume reads.
type streamReader interface {
	Info(ctx context.Context, opts ...jetstream.StreamInfoOpt) (*jetstream.StreamInfo, error)
	GetMsg(ctx context.Context, seq uint64, opts ...jetstream.GetMsgOpt) (*jetstream.RawStreamMsg, error)
	GetLastMsgForSubject(ctx context.Context, subject string) (*jetstream.RawStreamMsg, error)
	OrderedConsumer(ctx context.Context, cfg jetstream.OrderedConsumerConfig) (jetstream.Consumer, error)
}

// ownMsg is a stored message whose signature verifies with our key.
type ownMsg struct {
	seq      uint64
	pos      position
	part     int
	partSeq  uint64
	boundary bool // a commit, a gap, or a non-transactional mark
}

// signedSubject reports whether messages on subject must be signed, and
// their partition.
func signedSubject(src, subject string) (part int, signed bool, ok bool) {
	rest, found := strings.CutPrefix(subject, event.SubjectPrefix+"."+src+".")
	if !found {
		return 0, false, false
	}
	ps, kind, _ := strings.Cut(rest, ".")
	p, err := strconv.Atoi(ps)
	if err != nil || p < 0 || strconv.Itoa(p) != ps {
		return 0, false, false
	}
	switch {
	case kind == "commit" || kind == "mark" || kind == "gap":
		return p, true, true
	case strings.HasPrefix(kind, "delete.") || strings.HasPrefix(kind, "truncate."):
		return p, false, true
	}
	return 0, false, false
}

// verifyOwn checks that m is a signed message of ours; it returns why not
// otherwise.
func (s *Service) verifyOwn(m *jetstream.RawStreamMsg, parts int) (ownMsg, string) {
	p, signed, ok := signedSubject(s.cfg.SourceName, m.Subject)
	if !ok || !signed {
		return ownMsg{}, "not a signed subject"
	}
	if p >= parts {
		return ownMsg{}, "partition out of range"
	}
	if err := event.VerifyMessage(s.pub, m.Subject, m.Header, m.Data); err != nil {
		return ownMsg{}, err.Error()
	}
	// Signed by us: the headers are ours, so these parse.
	pos, err := parsePosition(m.Header.Get(event.HeaderPosition))
	if err != nil {
		return ownMsg{}, "signed, but " + err.Error()
	}
	ps, err := strconv.ParseUint(m.Header.Get(event.HeaderPartitionSeq), 10, 64)
	if err != nil {
		return ownMsg{}, "signed, but no partition sequence"
	}
	om := ownMsg{seq: m.Sequence, pos: pos, part: p, partSeq: ps, boundary: true}
	if strings.HasSuffix(m.Subject, ".mark") {
		if e, err := event.Decode(m.Data); err == nil && e.CommitLSN != 0 {
			om.boundary = false // a transactional mark: its transaction is open
		}
	}
	return om, ""
}

// foreign logs a message the capture did not publish, once per stream
// sequence, and counts it.
func (s *Service) foreign(seq uint64, subject, why string) {
	s.mu.Lock()
	if s.foreignSeen == nil {
		s.foreignSeen = map[uint64]struct{}{}
	}
	_, seen := s.foreignSeen[seq]
	if !seen && len(s.foreignSeen) < maxForeignRemembered {
		s.foreignSeen[seq] = struct{}{}
	}
	n := len(s.foreignSeen)
	s.mu.Unlock()
	if seen {
		return
	}
	s.m.foreign.Inc()
	switch {
	case n < maxForeignLogged:
		s.log.Warn("foreign message in the stream: not published by this capture, ignored", "stream_seq", seq, "subject", subject, "why", why)
	case n == maxForeignLogged:
		s.log.Warn("foreign message in the stream: not published by this capture, ignored; further ones are counted (epitaph_capture_foreign_messages_total), not logged", "stream_seq", seq, "subject", subject, "why", why)
	}
}

const (
	maxForeignRemembered = 100000
	maxForeignLogged     = 1000
)

// implausible logs and counts a verified message beyond the source's WAL.
func (s *Service) implausible(om ownMsg, current event.LSN) {
	s.mu.Lock()
	if s.implausibleSeen == nil {
		s.implausibleSeen = map[uint64]struct{}{}
	}
	_, seen := s.implausibleSeen[om.seq]
	if !seen && len(s.implausibleSeen) < maxForeignRemembered {
		s.implausibleSeen[om.seq] = struct{}{}
	}
	s.mu.Unlock()
	if seen {
		return
	}
	s.m.implausible.Inc()
	s.log.Error("IMPLAUSIBLE resume position refused: a message signed with this capture's key stands for a position beyond the source's current WAL (was the source restored or rewound, or is the signing key used by another capture?); resuming from the last plausible message",
		"stream_seq", om.seq, "position", om.pos.String(), "source_current_wal_lsn", current.String())
}

// lastOwnOfPartitions is findResume's fast path: the last commit, mark and
// gap of every partition. When each of them is ours (or absent) and
// plausible, they give every partition's sequence (into partSeq), and the
// latest of them is the last own signed message (best); walk says they do
// not.
func (s *Service) lastOwnOfPartitions(ctx context.Context, rs resumeStream, partSeq []uint64) (best ownMsg, walk bool, err error) {
	st, parts, current := rs.st, rs.parts, rs.current
	src := s.cfg.SourceName
	for p := 0; p < parts; p++ {
		for _, subj := range []string{event.CommitSubject(src, p), event.MarkSubject(src, p), event.GapSubject(src, p)} {
			m, err := st.GetLastMsgForSubject(ctx, subj)
			if errors.Is(err, jetstream.ErrMsgNotFound) {
				continue
			}
			if err != nil {
				return best, walk, fmt.Errorf("read the last message of %s: %w", subj, err)
			}
			om, why := s.verifyOwn(m, parts)
			if why != "" {
				s.foreign(m.Sequence, m.Subject, why)
				walk = true
				continue
			}
			if om.pos.lsn > current {
				s.implausible(om, current)
				walk = true
				continue
			}
			partSeq[p] = max(partSeq[p], om.partSeq)
			if om.seq > best.seq {
				best = om
			}
		}
	}
	return best, walk, nil
}

// walkBackResume walks back from the end of the stream (sequences first
// to last), one message at a time, until the last own plausible boundary V
// is found and then every partition's last own message at or before it
// (its sequence into partSeq): own messages after V (the open
// transaction's, a transactional mark's copies) are adopted on replay,
// which counts them again. V is zero when there is none.
func (s *Service) walkBackResume(ctx context.Context, rs resumeStream, first, last uint64, partSeq []uint64) (ownMsg, error) {
	st, parts, current := rs.st, rs.parts, rs.current
	src := s.cfg.SourceName
	var v ownMsg
	known := make([]bool, parts)
	pending := parts
	for seq := last; seq >= first && seq > 0; seq-- {
		if v.seq != 0 && pending == 0 {
			break
		}
		if err := ctx.Err(); err != nil {
			return v, fmt.Errorf("read the stream back: %w", err)
		}
		m, err := st.GetMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		if err != nil {
			return v, fmt.Errorf("read stream message %d: %w", seq, err)
		}
		if storedProbe(src, m.Subject, m.Data) {
			continue
		}
		_, signed, ok := signedSubject(src, m.Subject)
		if !ok {
			s.foreign(seq, m.Subject, "not an epitaph subject of this source")
			continue
		}
		if !signed {
			continue // a row or truncate: proven, if at all, by adoption
		}
		om, why := s.verifyOwn(m, parts)
		if why != "" {
			s.foreign(seq, m.Subject, why)
			continue
		}
		if om.pos.lsn > current {
			s.implausible(om, current)
			continue
		}
		if v.seq == 0 && om.boundary {
			v = om
		}
		if v.seq != 0 && !known[om.part] {
			known[om.part], partSeq[om.part] = true, om.partSeq
			pending--
		}
	}
	return v, nil
}

// resumeStream is the stream findResume reads, with its partition count
// and the source's pg_current_wal_lsn (no own message is believed past it).
type resumeStream struct {
	st      streamReader
	parts   int
	current event.LSN
}

// findResume reads what the stream proves of the capture's earlier output
// (see the comment at the top of this file). current is the source's
// pg_current_wal_lsn.
func (s *Service) findResume(ctx context.Context, st streamReader, parts int, current event.LSN) (resumePoint, error) {
	rp := resumePoint{partSeq: make([]uint64, parts)}
	info, err := st.Info(ctx)
	if err != nil {
		return rp, fmt.Errorf("read stream info: %w", err)
	}
	first, last := info.State.FirstSeq, info.State.LastSeq
	if info.State.Msgs == 0 {
		return rp, nil
	}
	rs := resumeStream{st: st, parts: parts, current: current}
	best, walk, err := s.lastOwnOfPartitions(ctx, rs, rp.partSeq)
	if err != nil {
		return rp, err
	}
	if best.seq != 0 && !best.boundary {
		walk = true // the last own message is inside an open transaction
	}
	v := best
	if walk {
		clear(rp.partSeq)
		if v, err = s.walkBackResume(ctx, rs, first, last, rp.partSeq); err != nil {
			return rp, err
		}
	}
	if v.seq == 0 {
		// No own boundary: a first transaction cut short (only its rows
		// are there), a stream written before signing, or only foreign
		// messages. Every stored message is a candidate for adoption: the
		// replay finds its own rows there, and publishes the rest. (On a
		// stream written before signing nothing matches, as those
		// messages have no partition sequence: the first replayed message
		// reads the stream once, then everything the slot replays is
		// published; ids still in the dedupe window come back as
		// duplicates and are republished under a distinct id.)
		rp.adoptFrom, rp.adoptTo = first, last
		return rp, nil
	}
	rp.has, rp.pos = true, v.pos
	if v.seq < last {
		rp.adoptFrom, rp.adoptTo = v.seq+1, last
	}
	return rp, nil
}

// adopter walks the stored messages after the resume point, in stream
// order, looking for the ones the replay is about to publish.
//
// It reads them in batches through an ordered consumer: one request per
// message made a restart in the middle of a large transaction adopt at a
// round trip per row (20,000 rows took a minute on a loaded machine). The
// batches are only a faster way to the same answer: whenever a batch
// read fails or comes back empty before the last candidate, the adopter
// goes on one message at a time, where "not found" is the stream's own
// word for a hole, so an adoption never ends early on a slow fetch (which
// would publish again what the stream holds).
type adopter struct {
	s        *Service
	st       streamReader
	next, to uint64
	cons     jetstream.Consumer // ordered, from the first unread candidate; nil until the first batch
	buf      []storedMsg
	direct   bool // one GetMsg per message from now on
}

// storedMsg is a candidate for adoption.
type storedMsg struct {
	seq     uint64
	subject string
	header  nats.Header
	data    []byte
}

// adoptBatchBytes bounds a batch read: the buffered candidates of a session
// take at most this much memory (or one message, when larger).
const adoptBatchBytes = 8 << 20

// find looks for a stored message identical to the one about to be
// published (for a signed one: at the same place, signed with our key),
// whose Epitaph-Digest-Alg is alg (anyDigestAlg: either version). It
// returns ok and the stored message's alg, or ok=false: not stored, and
// adoption is over (the caller drops the adopter).
func (a *adopter) find(ctx context.Context, out outMsg, alg string) (ok bool, storedAlg string, err error) {
	for {
		m, more, err := a.read(ctx)
		if err != nil || !more {
			return false, "", err
		}
		if storedProbe(a.s.cfg.SourceName, m.subject, m.data) {
			continue
		}
		storedAlg = m.header.Get(event.HeaderDigestAlg)
		// The id without a republish suffix, and without a tag on
		// either side: a row or a transactional mark stored by a capture
		// before ids were tagged is adopted all the same (a row's body,
		// place and partition sequence must still match exactly, and the
		// commit's digest covers it; a mark must verify there).
		base, _ := event.BaseMsgID(m.header.Get(event.HeaderMsgID))
		if m.subject == out.subject && event.UntaggedMsgID(base) == event.UntaggedMsgID(out.msgID) && m.header.Get(event.HeaderPosition) == out.pos &&
			m.header.Get(event.HeaderPartitionSeq) == strconv.FormatUint(out.partSeq, 10) &&
			m.header.Get(event.HeaderDigest) == out.digest {
			if _, signed, _ := signedSubject(a.s.cfg.SourceName, out.subject); signed {
				// Signed by us at this place of the output: ours, even if
				// its body differs (a transactional mark's time is when
				// the slot sent it).
				if err := event.VerifyMessage(a.s.pub, m.subject, m.header, m.data); err == nil {
					return true, storedAlg, nil
				}
			} else if bytes.Equal(m.data, out.body) && (alg == anyDigestAlg || storedAlg == alg) {
				return true, storedAlg, nil
			}
		}
		// A forger's, or a copy an earlier run published before a
		// restart and decodes differently now (the catalog changed
		// since: a type renamed, a key replaced): either way the
		// replay is published after it, and the commit's digest covers
		// the replay, which the projector chooses.
		a.s.foreign(m.seq, m.subject, "does not match what the capture publishes at position "+out.pos+
			" now (a forger's, or an earlier run's copy decoded against a catalog that changed since)")
	}
}

// read returns the next stored candidate (more=false: none is left).
func (a *adopter) read(ctx context.Context) (m storedMsg, more bool, err error) {
	for a.next <= a.to {
		if len(a.buf) > 0 {
			m, a.buf = a.buf[0], a.buf[1:]
			if m.seq < a.next {
				continue
			}
			if m.seq > a.to {
				break
			}
			a.next = m.seq + 1
			return m, true, nil
		}
		if a.direct {
			seq := a.next
			a.next++
			raw, err := a.st.GetMsg(ctx, seq)
			if errors.Is(err, jetstream.ErrMsgNotFound) {
				continue
			}
			if err != nil {
				return m, false, fmt.Errorf("read stream message %d: %w", seq, err)
			}
			return storedMsg{seq: raw.Sequence, subject: raw.Subject, header: raw.Header, data: raw.Data}, true, nil
		}
		if err := a.fill(ctx); err != nil || len(a.buf) == 0 {
			if err != nil {
				a.s.log.Debug("reading the stored messages one by one", "from", a.next, "err", err)
			}
			a.direct, a.cons = true, nil
		}
	}
	a.buf = nil
	return m, false, nil
}

// fill reads the next batch of candidates into buf.
func (a *adopter) fill(ctx context.Context) error {
	if a.cons == nil {
		c, err := a.st.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{
			DeliverPolicy: jetstream.DeliverByStartSequencePolicy,
			OptStartSeq:   a.next,
		})
		if err != nil {
			return err
		}
		a.cons = c
	}
	max := adoptBatchBytes
	if p := int(a.s.nc.MaxPayload()) + 64<<10; p > max {
		max = p
	}
	// The fetch's context ends on every way out: nats.go's fetch goroutine
	// must not outlive it.
	fctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	batch, err := a.cons.FetchBytes(max, jetstream.FetchContext(fctx))
	if err != nil {
		return err
	}
	for msg := range batch.Messages() {
		md, err := msg.Metadata()
		if err != nil {
			return err
		}
		a.buf = append(a.buf, storedMsg{seq: md.Sequence.Stream, subject: msg.Subject(), header: msg.Headers(), data: msg.Data()})
		if md.Sequence.Stream >= a.to {
			break
		}
	}
	if err := batch.Error(); err != nil && len(a.buf) == 0 {
		return err
	}
	return nil
}

// collisionError: JetStream dropped one of our messages as a duplicate of a
// message already stored under its id, that we did not publish.
type collisionError struct {
	what  string
	msgID string
	seq   uint64 // the stored message holding the id
}

func (e *collisionError) Error() string {
	return fmt.Sprintf("message id %s of %s is taken by stream message %d (not published by this capture in this session)", e.msgID, e.what, e.seq)
}

// errChainBroken: a message was refused because the stream's last message
// is not the one the capture published before it.
var errChainBroken = errors.New("the stream's last message is not the capture's previous message (a foreign message, or a message dropped as a duplicate)")

// interference reports whether err says another writer got in the way of
// this session: the capture starts a new session rather than stopping.
func interference(err error) bool {
	var ce *collisionError
	if errors.As(err, &ce) || errors.Is(err, errChainBroken) {
		return true
	}
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) && apiErr.ErrorCode == jsErrCodeWrongLastMsgID
}

// storedProbe reports whether a stored message is a settle probe an older
// server stored (settle): empty, on the settle subject. Anything else
// there is not the capture's, and foreign like any other message.
func storedProbe(src, subject string, data []byte) bool {
	return subject == event.SettleSubject(src) && len(data) == 0
}

// jsErrCodeWrongLastMsgID is JetStream's "wrong last msg ID" (10070).
const jsErrCodeWrongLastMsgID jetstream.ErrorCode = 10070

// signingKeyPath is where the key is: Config.SigningKey, or
// <data-dir>/signing.key.
func (c *Config) signingKeyPath() string {
	if c.SigningKey != "" {
		return c.SigningKey
	}
	return filepath.Join(c.DataDir, "signing.key")
}

// loadKey loads or creates the signing key, writes <data-dir>/signing.pub
// when the key is elsewhere, and logs the public key and its id.
func (s *Service) loadKey() error {
	// The data dir holds the partition sequences' record too: made here,
	// not left to the embedded server, which an external broker skips.
	if s.cfg.DataDir != "" {
		if err := os.MkdirAll(s.cfg.DataDir, 0o700); err != nil {
			return configErr("data directory %s: %v", s.cfg.DataDir, err)
		}
	}
	path := s.cfg.signingKeyPath()
	priv, err := event.LoadOrCreateSigningKey(path)
	if err != nil {
		return configErr("signing key: %v", err)
	}
	s.priv, s.pub = priv, priv.Public().(ed25519.PublicKey)
	s.keyID = event.KeyID(s.pub)
	pubPath := event.PublicKeyPath(path)
	if s.cfg.SigningKey != "" && s.cfg.DataDir != "" {
		p := filepath.Join(s.cfg.DataDir, "signing.pub")
		if err := event.WritePublicKey(p, s.pub); err != nil {
			s.log.Warn("could not write the public key into the data dir", "path", p, "err", err)
		} else {
			pubPath = p
		}
	}
	s.pubPath = pubPath
	s.log.Info("signing key", "key_id", s.keyID, "public_key", event.PublicKeyString(s.pub), "public_key_file", pubPath)
	return nil
}
