package projection

import (
	"bytes"
	"cmp"
	"context"
	"crypto/ed25519"
	"crypto/sha256"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/progress"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/snapshot"
	"github.com/epitaph-dev/epitaph/projection/trust"
	"github.com/epitaph-dev/epitaph/projection/version"
	"github.com/epitaph-dev/epitaph/quarantine"
)

// Verification of signed transactions.
//
// A partition is a sequence of the capture's transactions (row and truncate
// messages, then their commit) and of marks, heartbeats and gaps; the
// capture never interleaves them. Commits, marks, heartbeats and gaps are
// signed; a commit's Epitaph-Digest covers its transaction's row messages
// (partition sequence and body, in seq order). So:
//
//   - Row messages after the last verified boundary (commit, mark,
//     heartbeat, gap) are pending: archived invisible (verified = false),
//     hashed in stream order into a digest kept with the cursor.
//   - At a commit whose signature verifies with a trusted key, the pending
//     messages are the transaction when their digest is the signed one
//     (the fast path). Otherwise (a foreign message among them, a real row
//     re-published after a foreign one took its id) the window is read
//     again from the stream: when its messages, exact copies set aside,
//     are the signed digest's, they are the transaction (members this build
//     cannot decode too); otherwise, among the candidates with the commit's
//     LSN, the choice of one message per seq whose digest is the signed one is
//     the transaction (the last copy of each seq first, then the first
//     copy, then every combination, bounded: maxChoices). Whatever else was pending is
//     quarantined as unauthenticated, and so is all of it when no choice
//     matches.
//   - At a verified mark, heartbeat or gap, whatever is pending cannot be
//     a transaction's (its commit would have come first): unauthenticated.
//     Except a transactional mark (pg_logical_emit_message(true, ...)) of
//     the transaction whose rows are pending, numbered right after them:
//     the capture publishes it between them, and the commit closes the
//     window (openTxMark).
//   - An unsigned commit, mark, heartbeat or gap, one with a bad signature
//     or signed by a key this target does not trust, is quarantined as
//     unauthenticated and believed in nothing (it moves neither the
//     watermark nor the partition's position).
//   - Epitaph-Partition-Seq is believed only on verified messages: when the
//     next verified boundary is not the last one + 1 + the rows of its
//     transaction, messages were removed from the stream before this
//     version applied them, and a removed_from_stream gap is recorded in
//     the same transaction.
//
// Messages at or before the partition's legacy boundary (a stream written
// before signing, recorded by an operator) are believed as before.

// maxChoices bounds the slow path: how many combinations of candidates
// (messages claiming the same commit LSN and seq) are hashed against a
// signed digest before the transaction is refused.
const maxChoices = 256

// windowMsgOverhead is what a message the slow path reads back holds
// besides its body (its item, headers and decoded event: about 1.5 KiB
// measured for a row of 400 bytes), for Config.VerifyWindowBytes.
const windowMsgOverhead = 1536

// windowTooLarge is the transient error of a slow path whose window
// would take more memory than Config.VerifyWindowBytes: the partition
// waits at the transaction, nothing of it archived or quarantined, until
// the bound is raised. Refusing the transaction instead would quarantine
// real rows on a guess; reading on would risk the worker's memory and
// every partition it holds.
type windowTooLarge struct {
	lsn      event.LSN
	from, to uint64
	read     int
	budget   int64
}

func (e *windowTooLarge) Error() string {
	return fmt.Sprintf("the rows of the transaction with commit LSN %s failed the fast check, and reading them back "+
		"(stream sequences %d to %d, %d messages read) would take more than --verify-window-bytes (%d bytes): "+
		"the partition waits here until it is raised", e.lsn, e.from, e.to, e.read, e.budget)
}

// TransientKind names it in metrics, progress and logs
// (quarantine.TransientKind).
func (e *windowTooLarge) TransientKind() string { return "verify_window" }

type msgKind int

const (
	kindOther msgKind = iota
	kindRow
	kindCommit
	kindMarker // mark, heartbeat, gap
)

// kindOf classifies by subject (a body may not decode):
// epitaph.<src>.<p>.<kind>[...]. It does not allocate (it runs per message).
func kindOf(subject string) msgKind {
	tok := subject
	for i := 0; i < 3; i++ {
		j := strings.IndexByte(tok, '.')
		if j < 0 {
			return kindOther
		}
		tok = tok[j+1:]
	}
	if j := strings.IndexByte(tok, '.'); j >= 0 {
		tok = tok[:j]
	}
	switch tok {
	case "delete", "truncate":
		return kindRow
	case "commit":
		return kindCommit
	case "mark", "gap":
		return kindMarker
	}
	return kindOther
}

// header reads a header; the names Epitaph uses are canonical already, so
// the map is read directly first (nats.Header.Get canonicalizes).
func header(it *item, key string) string {
	if v := it.headers[key]; len(v) > 0 {
		return v[0]
	}
	return nats.Header(it.headers).Get(key)
}

func partSeqOf(it *item) uint64 {
	n, err := strconv.ParseUint(header(it, event.HeaderPartitionSeq), 10, 64)
	if err != nil {
		return 0
	}
	return n
}

// keyring holds the target's trusted keys (epitaph.trusted_keys).
type keyring struct {
	pool   *pgxpool.Pool
	log    *slog.Logger
	mu     sync.Mutex
	keys   map[string]ed25519.PublicKey
	warned map[string]bool
}

func newKeyring(pool *pgxpool.Pool, log *slog.Logger) *keyring {
	return &keyring{pool: pool, log: log, warned: map[string]bool{}}
}

func (k *keyring) load(ctx context.Context) error {
	ks, err := trust.TrustedKeys(ctx, k.pool)
	if err != nil {
		return err
	}
	m := make(map[string]ed25519.PublicKey, len(ks))
	for _, x := range ks {
		m[x.KeyID] = x.PublicKey
	}
	k.mu.Lock()
	k.keys = m
	k.mu.Unlock()
	return nil
}

func (k *keyring) get(id string) (ed25519.PublicKey, int, bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	pub, ok := k.keys[id]
	return pub, len(k.keys), ok && k.keys != nil
}

// refusal is a refusal (the message is quarantined), not a failure.
type refusal struct{ msg string }

func (r *refusal) Error() string { return r.msg }

func refuse(format string, args ...any) error { return &refusal{msg: fmt.Sprintf(format, args...)} }

// verify checks a signed message: its signature must verify with a key the
// target trusts. The first key met is trusted (and recorded) when none is.
// A *refusal says the message is not authentic; any other error is
// transient.
func (k *keyring) verify(ctx context.Context, it *item, streamKey func(context.Context) string) error {
	h := nats.Header(it.headers)
	if h.Get(event.HeaderSignature) == "" {
		return refuse("unsigned %s message", kindName(it.subject))
	}
	id := h.Get(event.HeaderKeyID)
	pub, n, ok := k.get(id)
	if !ok {
		if err := k.load(ctx); err != nil {
			return err
		}
		pub, n, ok = k.get(id)
	}
	if !ok && n == 0 {
		var err error
		if pub, ok, err = k.firstUse(ctx, it, id, streamKey); err != nil {
			return err
		}
	}
	if !ok {
		k.mu.Lock()
		warn := !k.warned[id]
		k.warned[id] = true
		k.mu.Unlock()
		if warn {
			k.log.Error("a message is signed by a key this target does not trust: it is quarantined as unauthenticated; "+
				"if the capture's signing key changed, trust the new one with `projector trust-key --key-file <the capture's signing.pub>` "+
				"and rebuild the version (projector rebuild archive), which verifies the stream again", "key_id", id, "stream_seq", it.seq, "subject", it.subject)
		}
		return refuse("signed with key %q, which this target does not trust", id)
	}
	if err := event.VerifyMessage(pub, it.subject, h, it.data); err != nil {
		return refuse("%s message: %v", kindName(it.subject), err)
	}
	return nil
}

// firstUse trusts the key that signed it when the target trusts none yet:
// the public key comes from the message (HeaderPublicKey) or the stream's
// metadata, and is trusted only when it verifies the message.
func (k *keyring) firstUse(ctx context.Context, it *item, id string, streamKey func(context.Context) string) (ed25519.PublicKey, bool, error) {
	h := nats.Header(it.headers)
	for _, text := range []string{h.Get(event.HeaderPublicKey), streamKey(ctx)} {
		if text == "" {
			continue
		}
		pub, err := event.ParsePublicKey([]byte(text))
		if err != nil || event.KeyID(pub) != id || event.VerifyMessage(pub, it.subject, h, it.data) != nil {
			continue
		}
		tx, err := k.pool.Begin(ctx)
		if err != nil {
			return nil, false, fmt.Errorf("trust first key: %w", err)
		}
		defer tx.Rollback(context.WithoutCancel(ctx))
		// Two workers meeting different first keys at once: one wins.
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtext('epitaph.trusted_keys'))`); err != nil {
			return nil, false, fmt.Errorf("trust first key: %w", err)
		}
		tag, err := tx.Exec(ctx, `INSERT INTO epitaph.trusted_keys (key_id, public_key, trusted_by, note)
			SELECT $1, $2, 'first use', $3 WHERE NOT EXISTS (SELECT 1 FROM epitaph.trusted_keys)`,
			id, []byte(pub), fmt.Sprintf("first key met, on %s at stream sequence %d", it.subject, it.seq))
		if err != nil {
			return nil, false, fmt.Errorf("trust first key: %w", err)
		}
		if err := tx.Commit(ctx); err != nil {
			return nil, false, fmt.Errorf("trust first key: %w", err)
		}
		if tag.RowsAffected() == 1 {
			k.log.Info("trusting the capture's signing key on first use", "key_id", id, "public_key", event.PublicKeyString(pub))
		}
		if err := k.load(ctx); err != nil {
			return nil, false, err
		}
		pub, _, ok := k.get(id)
		return pub, ok, nil
	}
	return nil, false, nil
}

func kindName(subject string) string {
	parts := strings.SplitN(subject, ".", 5)
	if len(parts) < 4 {
		return "unknown"
	}
	return parts[3]
}

// legacyBoundary is the partition's legacy boundary as an operator
// recorded it (projector trust-key --legacy-boundary), 0 when none is.
// It is never inferred from the stream: unsigned messages found on a first
// run may as well be a forger's, published into a stream emptied behind
// the capture's back, so they are believed only below a boundary someone
// vouched for.
func (w *partitionWorker) legacyBoundary(ctx context.Context) (uint64, error) {
	var seq int64
	err := w.pool.QueryRow(ctx, `SELECT boundary_seq FROM epitaph.legacy_boundaries WHERE stream = $1 AND partition = $2`,
		event.StreamName(w.cfg.SourceName), w.lease.Partition).Scan(&seq)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("read legacy boundary: %w", err)
	}
	if seq > 0 {
		w.log.Info("unsigned messages at or before the recorded legacy boundary are believed; unsigned messages after it are quarantined",
			"boundary_seq", seq)
	}
	return uint64(seq), nil
}

// rowID names an archived row.
type rowID struct {
	lsn event.LSN
	seq int
}

// rowIDArgs is ids as the two arrays a statement unnests: commit LSNs (as
// text) and seqs.
func rowIDArgs(ids []rowID) (lsns []string, seqs []int32) {
	lsns, seqs = make([]string, len(ids)), make([]int32, len(ids))
	for i, r := range ids {
		lsns[i], seqs[i] = r.lsn.String(), int32(r.seq)
	}
	return lsns, seqs
}

// gapRow is a removed_from_stream gap to record.
type gapRow struct {
	fromSeq, toSeq uint64
	fromLSN, toLSN event.LSN
	// head: the partition's first messages are missing (checkPartSeq); not
	// recorded again when the version has the stream's removed head as a
	// gap of every partition already.
	head bool
}

// A suspected gap (recordSuspectedGap) has no to_lsn: the stream's first
// sequence moved past the cursor while nothing else of the partition was
// there to tell whether its messages were among those removed. The next
// verified message tells: a partition sequence that continues acknowledges
// it with this reason; one that skips fills in its end.
const suspectedGapCleared = "the partition sequence continued: no message of this partition was removed"

// verdict is what verification decided for a page, applied in the page's
// transaction.
type verdict struct {
	trust   progress.Trust
	pending map[*item]bool // rows inserted invisible (their commit is later)
	promote []event.LSN    // transactions whose rows of earlier pages become visible
	// The slow path: unverified rows of earlier pages to delete, the chosen
	// ones to insert again (verified) and the refused ones to quarantine.
	drop      []rowID
	extraRows []*item
	extraQuar []*item
	gaps      []gapRow
	// continued: the partition sequence continued from this stream
	// sequence + 1 (a suspected gap starting there is cleared).
	continued []uint64
	// replayed counts the signed messages (commits, marks) ignored as
	// replays; the rows they take along are not counted.
	replayed int
	// purged: members of verified transactions absent from the stream
	// that the erasure ledger accounts for (erase --purge-stream); their
	// transactions' snapshot documents do not expect them.
	purged []snapshot.FencedRow
}

// verifyPage verifies a page (see the comment at the top of this file). It
// sets category unauthenticated on refused items and returns the rest of
// the decisions. Errors are transient.
func (w *partitionWorker) verifyPage(ctx context.Context, items []*item) (*verdict, error) {
	pv := newPageVerifier(w, items)
	for _, it := range items {
		kind := kindOf(it.subject)
		if it.seq <= w.legacy {
			if kind == kindCommit || kind == kindMarker || pv.st.Pending == 0 {
				pv.reset(it)
			}
			if (kind == kindCommit || kind == kindMarker) && it.ev != nil && it.category == "" {
				pv.lsn = max(pv.lsn, version.PositionLSN(it.ev)) // believed as before: applied (advance)
			}
			pv.st.PartSeq = 0
			continue
		}
		switch kind {
		case kindRow:
			pv.row(it)
		case kindCommit, kindMarker:
			if kind == kindMarker && pv.openTxMark(it) {
				if err := pv.txMark(ctx, it); err != nil {
					return nil, err
				}
				continue
			}
			if err := pv.boundary(ctx, it, kind); err != nil {
				return nil, err
			}
		}
		if pv.st.Pending == 0 {
			pv.st.TxStart = it.seq
		}
	}
	return pv.finish()
}

// pageVerifier is one page's verification in progress: the trust state
// carried from message to message (the open window's digest) and the
// verdict being built.
type pageVerifier struct {
	w      *partitionWorker
	items  []*item
	st     progress.Trust
	d      *event.Digest
	broken bool // the persisted digest could not be restored: only the slow path can tell
	vd     *verdict
	inPage map[uint64]*item // built when the slow path needs it
	page   []*item          // this page's pending rows
	ledger *ledgerCache     // the erasure ledger's answers, this page only (verify_ledger.go)
	lsn    event.LSN        // the source position applied so far, as advance moves it (replayed, a gap's from_lsn)
}

func newPageVerifier(w *partitionWorker, items []*item) *pageVerifier {
	pv := &pageVerifier{w: w, items: items, st: w.pos.Trust, d: event.NewDigest(), vd: &verdict{pending: map[*item]bool{}}, lsn: w.pos.SourceLSN}
	if pv.st.Pending > 0 {
		if err := pv.d.UnmarshalBinary(pv.st.Digest); err != nil {
			pv.broken = true
		}
	} else {
		pv.st.TxStart, pv.st.TxFirst, pv.st.Digest = w.pos.Cursor, 0, nil
	}
	return pv
}

// pageIndex is the page's items by stream sequence.
func (pv *pageVerifier) pageIndex() map[uint64]*item {
	if pv.inPage == nil {
		pv.inPage = make(map[uint64]*item, len(pv.items))
		for _, it := range pv.items {
			pv.inPage[it.seq] = it
		}
	}
	return pv.inPage
}

// reset opens a new window after message it.
func (pv *pageVerifier) reset(it *item) {
	pv.st.TxStart, pv.st.TxFirst, pv.st.Pending, pv.st.Digest = it.seq, 0, 0, nil
	pv.d.Reset()
	pv.broken = false
	pv.page = pv.page[:0]
}

// row adds a row message to the open window; it stays pending (inserted
// invisible) until a boundary verifies it.
func (pv *pageVerifier) row(it *item) {
	if pv.st.Pending == 0 {
		pv.st.TxFirst = it.seq
		// The transaction's first row says its digest version; a row
		// that lies about it only makes the digest fail.
		pv.d.ResetAlg(header(it, event.HeaderDigestAlg) == event.DigestAlgV2)
	}
	pv.d.Add(partSeqOf(it), it.data)
	pv.st.Pending++
	if it.ev == nil || it.category != "" {
		return // undecodable: quarantined as it is
	}
	w := pv.w
	if p := event.Partition(it.ev.CommitLSN, w.partitions); p != w.lease.Partition {
		w.refuse(it, fmt.Sprintf("row message in partition %d, but commit LSN %s belongs to partition %d", w.lease.Partition, it.ev.CommitLSN, p))
		return
	}
	pv.page = append(pv.page, it)
	pv.vd.pending[it] = true
}

// boundary verifies a commit or marker and closes the window at it.
func (pv *pageVerifier) boundary(ctx context.Context, it *item, kind msgKind) error {
	if it.ev == nil || it.category != "" {
		return nil // undecodable: not a boundary
	}
	w := pv.w
	if err := w.keys.verify(ctx, it, w.streamKey); err != nil {
		var r *refusal
		if !errors.As(err, &r) {
			return err
		}
		w.refuse(it, r.msg)
		return nil
	}
	if kind == kindCommit {
		if p := event.Partition(it.ev.CommitLSN, w.partitions); p != w.lease.Partition {
			w.refuse(it, fmt.Sprintf("commit in partition %d, but commit LSN %s belongs to partition %d", w.lease.Partition, it.ev.CommitLSN, p))
			return nil
		}
	}
	if pv.replayed(it) {
		pv.replay(it, kind)
		return nil
	}
	rows, short, err := pv.closeWindow(ctx, it, kind)
	if err != nil {
		return err
	}
	pv.checkPartSeq(it, rows, short)
	pv.reset(it)
	// The source position moves as the page's apply moves the partition's
	// (advance): a commit refused here is not applied, and a copy of its
	// transaction later in the stream is no replay, in this page or in the
	// next (which starts from the applied position).
	if l := version.PositionLSN(it.ev); l > pv.lsn && it.category == "" {
		pv.lsn = l
	}
	return nil
}

// openTxMark tells whether marker m is a transactional mark
// (pg_logical_emit_message(true, ...)) of the transaction whose rows are
// pending: the capture publishes it between them, numbered after them, on
// every partition. It closes no window there: the commit does.
func (pv *pageVerifier) openTxMark(m *item) bool {
	if m.ev == nil || m.category != "" || m.ev.Op != event.OpMark || m.ev.CommitLSN == 0 || pv.st.Pending == 0 {
		return false
	}
	if event.Partition(m.ev.CommitLSN, pv.w.partitions) != pv.w.lease.Partition {
		return false
	}
	if n := len(pv.page); n > 0 && pv.page[n-1].ev.CommitLSN != m.ev.CommitLSN {
		return false
	}
	return partSeqOf(m) == pv.st.PartSeq+uint64(pv.st.Pending)+1
}

// txMark verifies an open transaction's mark (openTxMark) and counts its
// partition sequence, so that the commit continues after it; the window
// stays open.
func (pv *pageVerifier) txMark(ctx context.Context, m *item) error {
	if err := pv.w.keys.verify(ctx, m, pv.w.streamKey); err != nil {
		var r *refusal
		if !errors.As(err, &r) {
			return err
		}
		pv.w.refuse(m, r.msg)
		return nil
	}
	pv.st.PartSeq++
	return nil
}

// replayed tells whether verified boundary b is a message the capture
// signed at or before the partition's last applied one, again: its
// partition sequence is not above the last applied one and its source
// position is not past what the partition applied. The capture never
// numbers two messages alike, so such a message was applied already (or
// lies in a gap recorded then); one with a lower partition sequence whose
// position is new is a regression (checkPartSeq).
func (pv *pageVerifier) replayed(b *item) bool {
	ps := partSeqOf(b)
	return pv.st.PartSeq > 0 && ps > 0 && ps <= pv.st.PartSeq && version.PositionLSN(b.ev) <= pv.lsn
}

// replay ignores a replayed boundary b: it moves nothing (neither the
// partition sequence nor the source position) and records no gap. A
// replayed commit whose pending rows are exactly its signed transaction
// (the fast path's digest) takes them along, ignored too: their rows are
// archived already. Otherwise the open window stays as it is, for the
// boundary that really closes it.
func (pv *pageVerifier) replay(b *item, kind msgKind) {
	b.replay = true
	pv.vd.replayed++
	st := pv.st
	if st.Pending == 0 {
		pv.reset(b)
		return
	}
	if want := header(b, event.HeaderDigest); kind == kindCommit && !pv.broken && want != "" && pv.d.Sum() == want {
		for _, it := range pv.page {
			delete(pv.vd.pending, it)
			it.replay = true
		}
		pv.reset(b)
	}
}

// checkPartSeq compares boundary b's partition sequence with the last one
// seen: one that skips more than the window's rows (or a transaction short
// of rows) records a removed_from_stream gap; one that continues clears a
// suspected gap.
func (pv *pageVerifier) checkPartSeq(b *item, rows int, short bool) {
	st := &pv.st
	ps := partSeqOf(b)
	if ps == 0 && !short {
		return
	}
	// regressed: a sequence below the continuation (the last applied one +
	// 1 + the transaction's rows) on a message whose position is new
	// (replayed said it is not a replay): the capture numbered again from
	// an earlier point, so what it numbered past it may be gone. Never a
	// continuation.
	regressed := st.PartSeq > 0 && ps > 0 && ps < st.PartSeq+1+uint64(rows)
	// head: the partition's first verified message in a version that reads
	// it from the stream's beginning (nothing of it verified or set aside
	// before, no legacy boundary): the capture numbers from 1, so a
	// sequence past 1 + its rows says the partition's first messages were
	// removed, even when the stream still starts at sequence 1 (a limit
	// per subject, or removals of one partition only).
	head := st.PartSeq == 0 && st.TxStart == 0 && pv.w.legacy == 0 && ps > 1+uint64(rows)
	if short || regressed || head || (st.PartSeq > 0 && ps > st.PartSeq+1+uint64(rows)) {
		// Messages removed before the open transaction's first end the
		// range there; members missing from it (short) put it inside.
		to := b.seq - 1
		if !short && st.Pending > 0 && st.TxFirst > 0 && rows > 0 {
			to = st.TxFirst - 1
		}
		pv.vd.gaps = append(pv.vd.gaps, gapRow{fromSeq: st.TxStart + 1, toSeq: to, fromLSN: pv.lsn, toLSN: version.PositionLSN(b.ev),
			head: head && !short})
		msg := "messages were removed from the stream before this version applied them: recorded a removed_from_stream gap"
		if regressed {
			msg = "the partition sequence went back on a new message (the capture numbered again, so messages it numbered may be gone): recorded a removed_from_stream gap"
		}
		pv.w.log.Error(msg, "from_seq", st.TxStart+1, "to_seq", to, "partition_seq", ps, "last_partition_seq", st.PartSeq)
	} else if st.PartSeq > 0 {
		pv.vd.continued = append(pv.vd.continued, st.TxStart)
	}
	st.PartSeq = ps // 0 after a short transaction without a partition sequence
}

// finish persists the open window's digest with the trust state.
func (pv *pageVerifier) finish() (*verdict, error) {
	if pv.st.Pending > 0 {
		b, err := pv.d.MarshalBinary()
		if err != nil {
			return nil, err
		}
		pv.st.Digest = b
		if pv.broken {
			pv.st.Digest = nil
		}
	}
	pv.vd.trust = pv.st
	return pv.vd, nil
}

func (w *partitionWorker) refuse(it *item, why string) {
	it.category, it.failure = trust.CategoryUnauthenticated, errors.New(why)
}

// streamKey is the public key in the stream's metadata (MetaSigningKey).
func (w *partitionWorker) streamKey(ctx context.Context) string {
	if w.stream == nil {
		return ""
	}
	info, err := w.stream.Info(ctx)
	if err != nil {
		return ""
	}
	return info.Config.Metadata[trust.MetaSigningKey]
}

// closeWindow settles the pending row messages at a verified boundary b and
// returns how many of them are b's transaction (0 for a marker), and
// whether the stream holds fewer of its rows than its signed commit counts
// (rows were removed).
func (pv *pageVerifier) closeWindow(ctx context.Context, b *item, kind msgKind) (int, bool, error) {
	st, w := pv.st, pv.w
	want := header(b, event.HeaderDigest)
	if kind == kindCommit && st.Pending > 0 && !pv.broken && want != "" && pv.d.Sum() == want {
		// Fast path: the pending messages are exactly the transaction.
		for _, it := range pv.page {
			delete(pv.vd.pending, it)
		}
		if st.Pending > len(pv.page) {
			pv.vd.promote = append(pv.vd.promote, b.ev.CommitLSN)
		}
		return st.Pending, false, nil
	}
	v2 := header(b, event.HeaderDigestAlg) == event.DigestAlgV2
	if st.Pending == 0 {
		if kind == kindCommit {
			// Every row purged by an erasure: the ledger may account for
			// all of them (digest v2 only).
			if v2 && want != "" {
				chosen, absent, err := chooseCandidates(nil, b.ev.CommitLSN, b.ev.Rows, want, true, pv.purgedLookup(ctx, b.ev.CommitLSN))
				if err != nil {
					return 0, false, err
				}
				if chosen != nil {
					pv.vd.purged = append(pv.vd.purged, purgedRows(b.ev, chosen, absent)...)
					return len(absent), false, nil
				}
			}
			w.refuse(b, "commit of a transaction none of whose rows is in the stream")
			return 0, b.ev.Rows > 0, nil
		}
		return 0, false, nil
	}
	inPage := pv.pageIndex()
	window, err := w.readWindow(ctx, st.TxStart+1, b.seq-1, inPage)
	var big *windowTooLarge
	if errors.As(err, &big) {
		big.lsn = b.ev.CommitLSN
		w.log.Error("a transaction cannot be verified within --verify-window-bytes; the partition waits",
			"commit_lsn", b.ev.CommitLSN.String(), "stream_seq", b.seq, "read", big.read, "verify_window_bytes", big.budget)
	}
	if err != nil {
		return 0, false, err
	}
	var chosen map[*item]bool
	var absent []int // members absent from the stream that the erasure ledger accounts for
	if kind == kindCommit {
		if whole, n := wholeWithCopies(window, want, v2); whole != nil {
			pv.settleWindow(window, inPage, kind, whole)
			return n, false, nil
		}
		chosen, absent, err = chooseCandidates(window, b.ev.CommitLSN, b.ev.Rows, want, v2, pv.purgedLookup(ctx, b.ev.CommitLSN))
		if err != nil {
			return 0, false, err
		}
		if chosen == nil {
			w.refuse(b, "the transaction's rows do not match its signed digest")
			w.log.Error("a transaction failed verification: its rows and commit are quarantined as unauthenticated",
				"commit_lsn", b.ev.CommitLSN.String(), "stream_seq", b.seq, "pending", st.Pending)
		}
	}
	n := pv.settleWindow(window, inPage, kind, chosen)
	if chosen == nil && kind == kindCommit {
		n, short := heldRows(window, b)
		return n, short, nil
	}
	// Purged members count among the transaction's partition sequences:
	// the jump they leave is no gap.
	pv.vd.purged = append(pv.vd.purged, purgedRows(b.ev, chosen, absent)...)
	return n + len(absent), false, nil
}

// settleWindow decides every message of the slow path's window: the chosen
// ones are verified (read again from earlier pages), the others refused.
// It returns how many distinct rows were chosen.
func (pv *pageVerifier) settleWindow(window []*item, inPage map[uint64]*item, kind msgKind, chosen map[*item]bool) int {
	vd := pv.vd
	n := 0
	counted := map[int]bool{} // copies of one message count once
	for _, it := range window {
		_, here := inPage[it.seq]
		switch {
		case chosen[it] && (it.ev == nil || it.category != ""):
			// A member set aside on arrival (a wire version this build
			// does not know): it keeps its entry and category, which
			// replay takes, as on the fast path.
		case chosen[it]:
			if !counted[it.ev.Seq] {
				counted[it.ev.Seq] = true
				n++
			}
			if here {
				delete(vd.pending, it)
				continue
			}
			vd.drop = append(vd.drop, rowID{it.ev.CommitLSN, it.ev.Seq})
			vd.extraRows = append(vd.extraRows, it)
		case it.category == trust.CategoryUnauthenticated || it.category == string(event.CategoryMalformed) ||
			it.category == string(event.CategoryInvalid):
			// Refused on arrival (another partition's), or a body no
			// version of the decoder reads: quarantined so, for good.
		case it.ev == nil || it.category != "":
			// Undecodable by this build (a wire version it does not know)
			// or set aside on arrival: quarantined then, under a category
			// that replay takes. No signed commit covers it, so it is
			// refused like the others, its entry too when it came in an
			// earlier page: replayed after an upgrade, it would be
			// archived as verified.
			pv.w.refuse(it, "row message not part of a verified transaction (it could not be decoded when it arrived)")
			if !here {
				vd.extraQuar = append(vd.extraQuar, it)
			}
		default:
			why := "row message not part of a verified transaction"
			if kind == kindCommit && chosen != nil {
				why = "row message not part of the signed transaction (another message with its commit LSN and seq is)"
			}
			delete(vd.pending, it)
			pv.w.refuse(it, why)
			if !here {
				// Met in an earlier page of this window: the partition's
				// watermark then is the window's, as advance sets it on the
				// page's items.
				it.after = pv.lsn
				vd.drop = append(vd.drop, rowID{it.ev.CommitLSN, it.ev.Seq})
				vd.extraQuar = append(vd.extraQuar, it)
			}
		}
	}
	return n
}

// wholeWithCopies is the window as commit's transaction when it is
// exactly its messages with copies of some (the capture sent them again:
// same partition sequence and body): its distinct messages, in stream
// order, hash to the signed digest want, as on the fast path. Members this
// build cannot decode count too (no seq is needed to hash them, and
// chooseCandidates, which needs one, would refuse the whole transaction
// for them). It returns every message of the window (copies included) and
// the number of distinct ones, or nil.
func wholeWithCopies(window []*item, want string, v2 bool) (map[*item]bool, int) {
	if want == "" || len(window) == 0 {
		return nil, 0
	}
	d := event.NewDigest()
	d.ResetAlg(v2)
	byPartSeq := map[uint64][]*item{}
	n := 0
	for _, it := range window {
		ps, dup := partSeqOf(it), false
		for _, o := range byPartSeq[ps] {
			if bytes.Equal(o.data, it.data) {
				dup = true
				break
			}
		}
		if !dup {
			byPartSeq[ps] = append(byPartSeq[ps], it)
			d.Add(ps, it.data)
			n++
		}
	}
	if d.Sum() != want {
		return nil, 0
	}
	all := make(map[*item]bool, len(window))
	for _, it := range window {
		all[it] = true
	}
	return all, n
}

// heldRows counts the distinct rows of commit b's transaction the stream
// still holds, for the gap check, and whether fewer of its deletes are
// there than its commit counts.
func heldRows(window []*item, b *item) (int, bool) {
	seen, deletes := map[int]bool{}, map[int]bool{}
	for _, it := range window {
		if it.ev != nil && it.ev.CommitLSN == b.ev.CommitLSN {
			seen[it.ev.Seq] = true
			if it.ev.Op == event.OpDelete {
				deletes[it.ev.Seq] = true
			}
		}
	}
	return len(seen), len(deletes) < b.ev.Rows
}

// readWindow reads the partition's messages with stream sequences in
// [from, to], using this page's items where they are in it. The messages
// read back may take at most Config.VerifyWindowBytes (a *windowTooLarge
// error past it).
func (w *partitionWorker) readWindow(ctx context.Context, from, to uint64, inPage map[uint64]*item) ([]*item, error) {
	if to < from {
		return nil, nil
	}
	var out []*item
	var size int64 // of the messages read back
	// Earlier pages: read back with an ordered consumer.
	first := to + 1
	for seq := range inPage {
		if seq >= from && seq <= to && seq < first {
			first = seq
		}
	}
	if first > from {
		c, err := w.stream.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{
			FilterSubjects: []string{w.filter},
			DeliverPolicy:  jetstream.DeliverByStartSequencePolicy,
			OptStartSeq:    from,
		})
		if err != nil {
			return nil, fmt.Errorf("read back the pending transaction: %w", err)
		}
		// One fetch per call, its context cancelled on every way out: an
		// early return must not leave nats.go's fetch goroutine waiting
		// out the fetch's expiry.
		fetch := func() (got int, past bool, err error) {
			fctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			defer cancel()
			batch, err := c.Fetch(500, jetstream.FetchContext(fctx))
			if err != nil {
				return 0, false, err
			}
			for m := range batch.Messages() {
				got++
				md, err := m.Metadata()
				if err != nil {
					return got, false, err
				}
				if md.Sequence.Stream >= first {
					return got, true, nil
				}
				if kindOf(m.Subject()) != kindRow {
					continue
				}
				if size += int64(len(m.Data())) + windowMsgOverhead; size > w.cfg.VerifyWindowBytes {
					return got, false, &windowTooLarge{from: from, to: to, read: len(out), budget: w.cfg.VerifyWindowBytes}
				}
				it := &item{seq: md.Sequence.Stream, subject: m.Subject(), headers: m.Headers(), data: m.Data(), stored: md.Timestamp}
				it.id = identityOf(it.headers, it.data)
				if ev, err := w.cfg.Decoder.Decode(it.data); err == nil {
					it.ev = ev
					if event.Partition(ev.CommitLSN, w.partitions) != w.lease.Partition {
						it.category = trust.CategoryUnauthenticated // refused on arrival
					}
				} else {
					// The category it was quarantined under on its page.
					cat, _ := quarantine.Classify(err)
					it.category = cmp.Or(string(cat), string(event.CategoryMalformed))
				}
				out = append(out, it)
			}
			return got, false, batch.Error()
		}
		for {
			got, past, err := fetch()
			var big *windowTooLarge
			if errors.As(err, &big) {
				return nil, err
			}
			if err != nil {
				return nil, fmt.Errorf("read back the pending transaction: %w", err)
			}
			if past {
				break // reached the page
			}
			if got == 0 {
				// The stream no longer holds the rest of the window (a
				// purge), or a fetch timed out before it sent any.
				if err := w.emptyReadBack(ctx, from, first); err != nil {
					return nil, err
				}
				break
			}
		}
	}
	for seq := first; seq <= to; seq++ {
		if it, ok := inPage[seq]; ok && kindOf(it.subject) == kindRow {
			out = append(out, it)
		}
	}
	return out, nil
}

// emptyReadBack decides what an empty fetch of a read-back from stream
// sequence from means: the end of it (nil) only when the stream no longer
// holds the message at first (the page's first in the window, or its
// boundary), which the read-back would otherwise reach. While it does, the
// fetch came back empty because the server did not answer in time (a 408
// carries no error): a window cut there would refuse the real transaction
// and invent a gap, so the read-back fails (transient) instead.
func (w *partitionWorker) emptyReadBack(ctx context.Context, from, first uint64) error {
	_, err := w.stream.GetMsg(ctx, first)
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("read back the pending transaction: look up stream sequence %d: %w", first, err)
	}
	return fmt.Errorf("read back the pending transaction: a fetch from stream sequence %d returned nothing "+
		"before the page's message at %d, which the stream holds: the server did not answer in time", from, first)
}

// chooseCandidates picks, among the decodable row messages of the window
// that claim commit LSN lsn, one per seq 0..k-1 such that their digest in
// seq order is want, for the smallest k >= rows (the commit's count of
// deletes; truncates add to it) that has one; nil when there is no such
// choice within maxChoices digests. For each k the last candidate of each
// seq in stream order is tried first (a capture's replay of a transaction
// follows what it stored before a restart), then the first one, whatever
// the number of combinations. Candidates with a seq beyond the
// transaction's (forged) are never chosen. For a digest v2 (v2), a seq
// with no candidate at all is looked up with purged (the erasure ledger):
// its body hash stands for the absent message, which is not chosen (it is
// not there) but listed in the second result. Errors are transient.
func chooseCandidates(window []*item, lsn event.LSN, rows int, want string, v2 bool, purged func(seq int) (*[sha256.Size]byte, error)) (map[*item]bool, []int, error) {
	if want == "" {
		return nil, nil, nil
	}
	bySeq, copies, maxSeq := candidatesBySeq(window, lsn)
	budget := maxChoices
	d := event.NewDigest()
	d.ResetAlg(v2)
	lastK := maxSeq + 1
	var absent *absentSums // absent seqs the ledger accounts for (v2 only)
	if v2 && purged != nil {
		lastK = max(lastK, rows) // the last members may be the purged ones
		absent = &absentSums{lookup: purged, sums: map[int]*[sha256.Size]byte{}}
		// ... past the commit's count of deletes too: a transaction's
		// truncates take seqs of its own. Every seq after the last one
		// present that the ledger accounts for may be a member.
		for {
			n, err := absent.choices(bySeq, lastK)
			if err != nil {
				return nil, nil, err
			}
			if n == 0 {
				break
			}
			lastK++
		}
	}
	for k := max(rows, 1); k <= lastK && budget > 0; k++ {
		choices := 1
		for s := 0; s < k; s++ {
			n, err := absent.choices(bySeq, s)
			if err != nil {
				return nil, nil, err
			}
			choices = min(choices*n, budget+1) // saturates: only "more than the budget" matters
		}
		if choices == 0 {
			return nil, nil, nil // a seq below k is missing: so it is for every larger k
		}
		// The last copy of each seq first, then the first copy, one
		// digest each, whatever the number of choices: a capture
		// restarted inside a transaction publishes it again after what it
		// had stored, and that earlier prefix may differ (it was decoded
		// against a catalog that changed before the restart: a type
		// renamed, a key replaced), so the replay is the last copy; copies
		// a forger adds after the real rows leave the real ones first.
		// Every seq of such a prefix has two candidates: more choices than
		// the budget from 9 rows on. (These two do not count against it.)
		last := make([]int, k)
		for s := range last {
			last[s] = max(len(bySeq[s])-1, 0)
		}
		for _, pick := range [][]int{last, make([]int, k)} {
			absent.hash(d, bySeq, pick)
			if d.Sum() == want {
				out, absent := chosenSet(bySeq, copies, pick)
				return out, absent, nil
			}
			if choices == 1 {
				break // the last copies are the first ones
			}
		}
		if choices == 1 {
			budget--
			continue // that was the only choice
		}
		if choices > budget {
			return nil, nil, nil
		}
		budget -= choices
		pick := make([]int, k)
		for n := 0; n < choices; n++ {
			absent.hash(d, bySeq, pick)
			if d.Sum() == want {
				out, absent := chosenSet(bySeq, copies, pick)
				return out, absent, nil
			}
			for s := 0; s < k; s++ { // next combination
				pick[s]++
				if pick[s] < len(bySeq[s]) {
					break
				}
				pick[s] = 0
			}
		}
	}
	return nil, nil, nil
}

// candidatesBySeq groups the window's decodable row messages that claim
// commit LSN lsn by seq, in stream order, and returns the highest seq (-1:
// none). Copies of one message (the capture sent it again: same partition
// sequence and body) are one candidate, the first; copies lists the others
// with it, so they go where it goes.
func candidatesBySeq(window []*item, lsn event.LSN) (bySeq map[int][]*item, copies map[*item][]*item, maxSeq int) {
	bySeq, copies, maxSeq = map[int][]*item{}, map[*item][]*item{}, -1
	for _, it := range window {
		if it.ev == nil || it.category != "" || it.ev.CommitLSN != lsn || it.ev.Seq < 0 {
			continue
		}
		dup := false
		for _, c := range bySeq[it.ev.Seq] {
			if partSeqOf(c) == partSeqOf(it) && bytes.Equal(c.data, it.data) {
				copies[c] = append(copies[c], it)
				dup = true
				break
			}
		}
		if !dup {
			bySeq[it.ev.Seq] = append(bySeq[it.ev.Seq], it)
		}
		maxSeq = max(maxSeq, it.ev.Seq)
	}
	return bySeq, copies, maxSeq
}

// applyVerdict writes the verdict's decisions that concern earlier pages
// and the gaps, in the page's transaction.
func (s *Service) applyVerdict(ctx context.Context, tx pgx.Tx, v version.Version, l progress.Lease, vd *verdict) error {
	if vd == nil {
		return nil
	}
	if err := dropUnverified(ctx, tx, v.Schema, s.cfg.SourceName, l.Partition, vd.drop); err != nil {
		return err
	}
	if len(vd.promote) > 0 {
		lsns := make([]string, len(vd.promote))
		for i, l := range vd.promote {
			lsns[i] = l.String()
		}
		if _, err := tx.Exec(ctx, `UPDATE `+archive.Ident(v.Schema, "rows")+` SET verified = true
			WHERE source = $1 AND commit_lsn = ANY($2::pg_lsn[]) AND NOT verified`, s.cfg.SourceName, lsns); err != nil {
			return fmt.Errorf("make verified rows visible: %w", err)
		}
		// Their truncates of earlier pages become gap rows now.
		if _, err := tx.Exec(ctx, `WITH moved AS (
				DELETE FROM `+archive.Ident(v.Schema, "pending_truncates")+` WHERE partition = $1 AND commit_lsn = ANY($2::pg_lsn[])
				RETURNING partition, commit_lsn, schema_name, table_name)
			INSERT INTO `+archive.Ident(v.Schema, "gaps")+` (kind, schema_name, table_name, partition, from_lsn, to_lsn)
			SELECT 'truncate', schema_name, table_name, partition, commit_lsn, commit_lsn FROM moved`, l.Partition, lsns); err != nil {
			return fmt.Errorf("record verified truncates: %w", err)
		}
	}
	for _, it := range vd.extraQuar {
		if err := quarantine.Insert(ctx, tx, quarantine.Entry{
			Projection: v.Projection, Version: v.Version, Partition: l.Partition,
			StreamSeq: it.seq, Subject: it.subject, Headers: it.headers, Data: it.data,
			Category: it.category, Error: quarantine.Sanitize(it.failure), After: it.after,
		}); err != nil {
			return err
		}
	}
	for _, g := range vd.gaps {
		if err := recordGap(ctx, tx, v.Schema, l.Partition, g); err != nil {
			return err
		}
	}
	if err := s.discountPurged(ctx, tx, v, vd.purged); err != nil {
		return err
	}
	if len(vd.continued) > 0 {
		// One statement for the page: a transaction of every few rows
		// continues its partition's sequence, and this ran once each.
		froms := make([]int64, len(vd.continued))
		for i, from := range vd.continued {
			froms[i] = int64(from + 1)
		}
		if _, err := tx.Exec(ctx, `UPDATE `+archive.Ident(v.Schema, "gaps")+` SET acknowledged_at = now(), ack_reason = $3
			WHERE kind = 'removed_from_stream' AND partition = $1 AND from_seq = ANY($2::bigint[]) AND to_lsn IS NULL AND acknowledged_at IS NULL`,
			l.Partition, froms, suspectedGapCleared); err != nil {
			return fmt.Errorf("clear suspected gap: %w", err)
		}
	}
	return nil
}

// dropUnverified deletes, in tx, the unverified rows and truncates drop
// of a partition from the archive of schema.
func dropUnverified(ctx context.Context, tx pgx.Tx, schema, source string, partition int, drop []rowID) error {
	if len(drop) == 0 {
		return nil
	}
	lsns, seqs := rowIDArgs(drop)
	if _, err := tx.Exec(ctx, `DELETE FROM `+archive.Ident(schema, "rows")+` r USING unnest($2::text[], $3::int[]) AS u(lsn, seq)
		WHERE r.source = $1 AND NOT r.verified AND r.commit_lsn = u.lsn::pg_lsn AND r.seq = u.seq`, source, lsns, seqs); err != nil {
		return fmt.Errorf("drop unverified rows: %w", err)
	}
	if _, err := tx.Exec(ctx, `DELETE FROM `+archive.Ident(schema, "pending_truncates")+` p USING unnest($2::text[], $3::int[]) AS u(lsn, seq)
		WHERE p.partition = $1 AND p.commit_lsn = u.lsn::pg_lsn AND p.seq = u.seq`, partition, lsns, seqs); err != nil {
		return fmt.Errorf("drop unverified truncates: %w", err)
	}
	return nil
}

// recordGap records a removed_from_stream gap of a partition, or completes
// the open one that starts at the same stream sequence (a suspected gap).
//
// A regression (a partition sequence that went back) right after the last
// verified boundary names no message of the stream: its range is empty and
// recorded with NULL sequences, never as from_seq > to_seq.
func recordGap(ctx context.Context, tx pgx.Tx, schema string, partition int, g gapRow) error {
	var fromSeq, toSeq any = int64(g.fromSeq), int64(g.toSeq)
	if g.toSeq < g.fromSeq {
		fromSeq, toSeq = nil, nil
	}
	tag, err := tx.Exec(ctx, `UPDATE `+archive.Ident(schema, "gaps")+` SET to_seq = GREATEST(to_seq, $3), to_lsn = $4::pg_lsn
		WHERE kind = 'removed_from_stream' AND partition = $1 AND from_seq = $2 AND acknowledged_at IS NULL`,
		partition, int64(g.fromSeq), toSeq, nullLSNText(g.toLSN))
	if err != nil {
		return fmt.Errorf("record removed_from_stream gap: %w", err)
	}
	if tag.RowsAffected() > 0 {
		return nil
	}
	if _, err := tx.Exec(ctx, `INSERT INTO `+archive.Ident(schema, "gaps")+` (kind, partition, from_lsn, to_lsn, from_seq, to_seq)
		SELECT 'removed_from_stream', $1, $2::pg_lsn, $3::pg_lsn, $4, $5
		WHERE NOT $6 OR NOT EXISTS (SELECT 1 FROM `+archive.Ident(schema, "gaps")+`
			WHERE kind = 'removed_from_stream' AND partition IS NULL AND from_seq = 1)`,
		partition, nullLSNText(g.fromLSN), nullLSNText(g.toLSN), fromSeq, toSeq, g.head); err != nil {
		return fmt.Errorf("record removed_from_stream gap: %w", err)
	}
	return nil
}

// recordSuspectedGap is called while the partition is idle and the
// stream's first sequence is past cursor + 1: the messages in between were
// removed (purged, aged out, discarded by a limit, or the stream made
// anew) without this version seeing them, and whether any was this
// partition's is not known until its next verified message. The gap is
// recorded now (to_lsn NULL) so readers are told at once; it is cleared or
// completed by that message.
func (w *partitionWorker) recordSuspectedGap(ctx context.Context, first uint64) error {
	from := w.pos.Cursor + 1
	tx, err := w.pool.Begin(ctx)
	if err != nil {
		return fmt.Errorf("record suspected gap: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	var exists bool
	if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM `+archive.Ident(w.ver.Schema, "gaps")+`
		WHERE kind = 'removed_from_stream' AND partition = $1 AND from_seq = $2)`, w.lease.Partition, int64(from)).Scan(&exists); err != nil {
		return fmt.Errorf("record suspected gap: %w", err)
	}
	if exists {
		return nil
	}
	if _, err := tx.Exec(ctx, `INSERT INTO `+archive.Ident(w.ver.Schema, "gaps")+` (kind, partition, from_lsn, from_seq, to_seq)
		VALUES ('removed_from_stream', $1, $2::pg_lsn, $3, $4)`,
		w.lease.Partition, nullLSNText(w.pos.SourceLSN), int64(from), int64(first-1)); err != nil {
		return fmt.Errorf("record suspected gap: %w", err)
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("record suspected gap: %w", err)
	}
	w.log.Error("the stream's first sequence moved past this partition's cursor: messages it had not applied may have been removed (recorded a removed_from_stream gap; the partition's next verified message confirms or clears it)",
		"cursor", w.pos.Cursor, "stream_first_seq", first)
	return nil
}

func nullLSNText(l event.LSN) any {
	if l == 0 {
		return nil
	}
	return l.String()
}

// streamRecreatedReason is the log and status reason of a gap recorded
// because the stream under the source's name is not the one the cursor
// counts in.
const streamRecreatedReason = "the stream was deleted and made anew: whatever the old stream held past this partition's cursor was never applied"

// checkStreamIdentity compares the stream's creation time with the one the
// partition's cursor was recorded against (epitaph.progress.stream_created,
// read with the progress row).
// A different one means the stream was deleted and made anew: its
// sequences start again and it holds nothing of the old stream, so what
// the old one held past the cursor is unknown and may be lost. That is
// recorded as a removed_from_stream gap of the partition, starting at the
// partition's watermark and open-ended (no to_lsn; from_seq NULL: the old
// stream's sequences mean nothing in the new one), which keeps the archive
// not ready until an operator acknowledges it (projector gaps ack). The
// cursor is then verified against the new stream as after any lost tail
// (verify rewinds it; re-applying is idempotent). All in the lease's
// epoch: a worker that lost the partition changes nothing.
func (w *partitionWorker) checkStreamIdentity(ctx context.Context, recorded *time.Time) error {
	info, err := w.stream.Info(ctx)
	if err != nil {
		return fmt.Errorf("stream info: %w", err)
	}
	created := info.Created.UTC().Truncate(time.Microsecond) // as Postgres keeps it
	if recorded != nil && recorded.Equal(created) {
		return nil
	}
	tx, err := w.pool.Begin(ctx)
	if err != nil {
		return fmt.Errorf("record the partition's stream identity: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	tag, err := tx.Exec(ctx, `UPDATE epitaph.progress SET stream_created = $5
		WHERE projection = $1 AND version = $2 AND partition = $3 AND epoch = $4`,
		w.lease.Projection, w.lease.Version, w.lease.Partition, w.lease.Epoch, created)
	if err != nil {
		return fmt.Errorf("record the partition's stream identity: %w", err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("record the partition's stream identity of %s: %w", w.lease.Key, progress.ErrLostOwnership)
	}
	recreated := recorded != nil // even at cursor 0: the old stream may have held this partition's first messages
	if recreated {
		if _, err := tx.Exec(ctx, `INSERT INTO `+archive.Ident(w.ver.Schema, "gaps")+` (kind, partition, from_lsn)
			VALUES ('removed_from_stream', $1, $2::pg_lsn)`, w.lease.Partition, nullLSNText(w.pos.SourceLSN)); err != nil {
			return fmt.Errorf("record a removed_from_stream gap: %w", err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("record the partition's stream identity: %w", err)
	}
	if recreated {
		w.log.Error("recorded a removed_from_stream gap: "+streamRecreatedReason,
			"cursor", w.pos.Cursor, "watermark", w.pos.SourceLSN.String(),
			"stream_created_before", recorded.Format(time.RFC3339Nano), "stream_created", created.Format(time.RFC3339Nano))
	}
	return nil
}

// stagePendingTruncate keeps a truncate whose transaction is not verified
// yet (its commit is in a later page) until it is: applyVerdict makes it a
// gap row then, or drops it with the transaction's other unverified
// messages. Readers never see a truncate that may be forged.
func stagePendingTruncate(ctx context.Context, tx pgx.Tx, schema string, partition int, e *event.Event) error {
	if _, err := tx.Exec(ctx, `INSERT INTO `+archive.Ident(schema, "pending_truncates")+`
		(partition, commit_lsn, seq, schema_name, table_name) VALUES ($1, $2::pg_lsn, $3, $4, $5)
		ON CONFLICT DO NOTHING`, partition, e.CommitLSN.String(), e.Seq, e.Schema, e.Table); err != nil {
		return fmt.Errorf("stage an unverified truncate: %w", err)
	}
	return nil
}
