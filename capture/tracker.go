package capture

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/epitaph-dev/epitaph/event"
)

// ackFuture is the part of jetstream.PubAckFuture the tracker uses.
type ackFuture interface {
	Ok() <-chan *jetstream.PubAck
	Err() <-chan error
}

// trackItem is either an in-flight acknowledged publish (fut != nil),
// covering msgs messages (itself and the unacknowledged ones published
// before it), or a position marker: "once everything before me is
// acknowledged, lsn may be confirmed".
type trackItem struct {
	fut  ackFuture
	msgs int
	size int
	what string
	lsn  event.LSN
	// part and partSeq of a signed message (partSeq 0: a row, or a
	// tracker without partitions).
	part    int
	partSeq uint64
}

// safePos is a bucket of written positions: lsn, the highest, may be
// confirmed at safeAt; since is when its first position was written.
type safePos struct {
	lsn    event.LSN
	safeAt time.Time
	since  time.Time
	// seqs: every partition's last acknowledged signed message when lsn
	// was written (nil without partitions).
	seqs []uint64
}

// tracker decides which LSN may be confirmed to Postgres. Publishes and
// position markers are queued in stream order; a marker's LSN becomes
// "written" when every publish queued before it is acknowledged, and
// "safe" (confirmable) once those acknowledgements are older than the
// broker's sync delay, because a 1-replica JetStream acknowledges before it
// fsyncs. Memory is bounded: at most MaxInFlight messages, consecutive
// markers coalesce, and written positions are bucketed: buckets come due
// at least a second apart, and a position is safe at most a second after
// its own acknowledgements are synced, whatever is written after it.
//
// Not every message asks for an acknowledgement: a message published
// without one is "loose" until the next acknowledged publish, which covers
// it, because every message expects its predecessor as the stream's last
// message id: an acknowledged message proves every message before it
// stored, in order, and a refused loose message makes every later one fail.
type tracker struct {
	q         []trackItem
	head      int
	msgs      int // in flight: loose and acknowledged publishes
	bytes     int
	looseMsgs int // published without acknowledgement, not yet covered
	looseSize int
	deferred  event.LSN // a mark made while messages were loose
	syncDelay time.Duration

	lastAckAt time.Time // when the newest acknowledged publish was acknowledged
	pending   []safePos // written, not yet safe; ascending
	written   event.LSN
	safe      event.LSN

	// unsentSince is when the oldest safe position not yet confirmed to
	// the slot (sent) was written; zero when every safe one is confirmed.
	unsentSince time.Time
	// lag, when set, holds unconfirmedSince as Unix nanoseconds (0: none)
	// for the confirm lag gauge, read by the metrics scrape.
	lag *atomic.Int64

	// acked is every partition's last acknowledged signed message's
	// partition sequence; safeSeqs is acked as it was when safe was
	// written: the partition sequences the capture keeps outside the
	// stream (seqrecord.go) along with the slot's confirmed position. A
	// position is written only once everything before it is acknowledged
	// and positions are marked at transaction boundaries, so safeSeqs never
	// names a message of an unfinished transaction.
	acked    []uint64
	safeSeqs []uint64

	// stalled, when set, is called while the oldest publish has been
	// unanswered for stalledCheck, and again every stalledCheck, to find
	// out (and report: true) whether the broker cannot answer it now;
	// unstalled is called on the next acknowledgement after a report.
	// Neither ends the session, but for a leader other than the session's
	// (abandon): the acknowledgement's own timeout does (a session started
	// while a leader without its quorum still answers reads a stale tail,
	// and what the old one had in flight would be stored twice).
	stalled   func() bool
	unstalled func()
	stalledOn bool // stalled reported since the last acknowledgement
	// abandon, set by stalled, ends the session at the next poll or
	// check (errLeaderChanged: the publishes in flight will never be
	// answered).
	abandon error
	// pops counts the acknowledged publishes popped: the front's identity
	// for checkStalled, with frontSince (when poll first found it
	// unanswered) and asked (when stalled was last asked about it).
	pops       uint64
	frontPops  uint64
	frontSince time.Time
	asked      time.Time
}

// startSeqs starts the partition sequences at seqs (copied) and the safe
// ones at recorded, those recorded with the slot's confirmed position
// (copied, as long as seqs). The stream's tail a session starts from is
// no safer than it was when the previous session left it: until a position
// of this session is safe, the records must not claim it, or a broker that
// loses that tail within its sync interval would have the next session
// number the replayed messages after it (a false gap, stored rows not
// adopted).
func (t *tracker) startSeqs(seqs, recorded []uint64) {
	t.acked = append([]uint64(nil), seqs...)
	t.safeSeqs = make([]uint64, len(seqs))
	copy(t.safeSeqs, recorded)
}

// newTracker starts a tracker at now: the stream's tail, written by an
// earlier run, may not be synced yet, so nothing is confirmed before
// now+syncDelay.
func newTracker(syncDelay time.Duration, now time.Time) *tracker {
	if syncDelay < 0 {
		syncDelay = 0
	}
	return &tracker{syncDelay: syncDelay, lastAckAt: now}
}

func (t *tracker) len() int { return len(t.q) - t.head }

// loose counts a message published without an acknowledgement: the next
// acknowledged publish covers it.
func (t *tracker) loose(size int) {
	t.looseMsgs++
	t.looseSize += size
	t.msgs++
	t.bytes += size
}

// add queues an in-flight acknowledged publish, covering the loose
// messages before it.
func (t *tracker) add(fut ackFuture, size int, what string) { t.addSigned(fut, size, what, 0, 0) }

// addSigned is add for a signed message of partition part with partition
// sequence partSeq.
func (t *tracker) addSigned(fut ackFuture, size int, what string, part int, partSeq uint64) {
	t.q = append(t.q, trackItem{fut: fut, msgs: t.looseMsgs + 1, size: t.looseSize + size, what: what, part: part, partSeq: partSeq})
	t.msgs++
	t.bytes += size
	t.looseMsgs, t.looseSize = 0, 0
	if t.deferred != 0 {
		t.q = append(t.q, trackItem{lsn: t.deferred})
		t.deferred = 0
	}
}

// mark queues a position: lsn may be confirmed once everything queued
// before it is acknowledged (and synced). While messages are loose the
// mark waits for the acknowledged publish that covers them.
func (t *tracker) mark(lsn event.LSN, now time.Time) {
	if t.looseMsgs > 0 {
		t.deferred = max(t.deferred, lsn)
		return
	}
	if t.len() == 0 {
		t.written0(lsn, now)
		return
	}
	if last := &t.q[len(t.q)-1]; last.fut == nil {
		if lsn > last.lsn {
			last.lsn = lsn
		}
		return
	}
	t.q = append(t.q, trackItem{lsn: lsn})
}

func (t *tracker) written0(lsn event.LSN, now time.Time) {
	if lsn <= t.written {
		return
	}
	t.written = lsn
	if lsn <= t.safe {
		return // already confirmable (a keepalive at the resume position)
	}
	safeAt := t.lastAckAt.Add(t.syncDelay)
	n := len(t.pending)
	if n > 0 && !safeAt.After(t.pending[n-1].safeAt) {
		// The previous bucket comes due no earlier than this position is
		// synced: it may carry it, and keeps its time.
		p := &t.pending[n-1]
		p.lsn = lsn
		copy(p.seqs, t.acked)
		return
	}
	if n > 0 {
		// A bucket's time never moves: a later one would postpone every
		// position in it, forever under steady traffic. A new bucket comes
		// due at least a second after the previous one, so at most
		// syncDelay/1s+2 are pending, and no position waits more than a
		// second past its own safe time.
		if next := t.pending[n-1].safeAt.Add(time.Second); safeAt.Before(next) {
			safeAt = next
		}
	}
	var seqs []uint64
	if t.acked != nil {
		seqs = append([]uint64(nil), t.acked...)
	}
	t.pending = append(t.pending, safePos{lsn: lsn, safeAt: safeAt, since: now, seqs: seqs})
	if n == 0 {
		t.reportLag()
	}
}

// poll pops every acknowledged publish and marker at the front of the
// queue without blocking. It returns the first publish error.
func (t *tracker) poll(now time.Time) error {
	for t.len() > 0 {
		it := t.q[t.head]
		if it.fut != nil {
			select {
			case a := <-it.fut.Ok():
				if err := it.duplicate(a); err != nil {
					return err
				}
			case err := <-it.fut.Err():
				return it.err(err)
			default:
				t.compact()
				t.checkStalled(now)
				return t.abandon
			}
			t.popFuture(now)
			continue
		}
		t.written0(it.lsn, now)
		t.q[t.head] = trackItem{}
		t.head++
	}
	t.compact()
	return nil
}

// waitFront blocks until the oldest publish is resolved (or ctx ends),
// pops it, then polls the rest. While it waits, stalled (when set) is
// called every stalledCheck.
func (t *tracker) waitFront(ctx context.Context, now func() time.Time) error {
	var check *time.Ticker
	for t.len() > 0 {
		it := t.q[t.head]
		if it.fut == nil {
			if err := t.poll(now()); err != nil {
				return err
			}
			continue
		}
		if t.stalled != nil && check == nil {
			check = time.NewTicker(stalledCheck)
			defer check.Stop()
		}
		var checkC <-chan time.Time
		if check != nil {
			checkC = check.C
		}
		select {
		case a := <-it.fut.Ok():
			if err := it.duplicate(a); err != nil {
				return err
			}
			// The ack is consumed from the channel here: pop the item now,
			// poll would not see it again.
			t.popFuture(now())
			return t.poll(now())
		case err := <-it.fut.Err():
			return it.err(err)
		case <-checkC:
			t.stalledOn = t.stalled() || t.stalledOn
			if t.abandon != nil {
				return t.abandon
			}
		case <-ctx.Done():
			return fmt.Errorf("wait for publish acknowledgement: %w", ctx.Err())
		}
	}
	return nil
}

// checkStalled calls stalled, at most every stalledCheck, once poll has
// found the same oldest publish unanswered for stalledCheck.
func (t *tracker) checkStalled(now time.Time) {
	if t.stalled == nil {
		return
	}
	if t.frontSince.IsZero() || t.frontPops != t.pops {
		t.frontPops, t.frontSince, t.asked = t.pops, now, time.Time{}
		return
	}
	if now.Sub(t.frontSince) < stalledCheck || now.Sub(t.asked) < stalledCheck {
		return
	}
	t.asked = now
	t.stalledOn = t.stalled() || t.stalledOn
}

// stalledCheck is how long waitFront (and poll) wait for the oldest
// publish's acknowledgement before they call stalled, and again between
// two calls.
const stalledCheck = 2 * time.Second

func (it trackItem) err(err error) error {
	if it.msgs > 1 {
		// A refused message fails every later one on its expected last
		// message id: the first cause may be one of the loose messages.
		return fmt.Errorf("publish %s (acknowledging it and the %d messages before it): %w", it.what, it.msgs-1, brokerIO(err))
	}
	return fmt.Errorf("publish %s: %w", it.what, brokerIO(err))
}

// duplicate: JetStream acknowledges a message dropped as a duplicate of a
// stored one as if it were stored. The capture never publishes a message
// twice in a session (re-sends are skipped by position or adopted), so the
// stored one is not ours: nothing after it is proven.
func (it trackItem) duplicate(a *jetstream.PubAck) error {
	if a == nil || !a.Duplicate {
		return nil
	}
	return fmt.Errorf("publish %s: %w", it.what, &collisionError{what: it.what, seq: a.Sequence})
}

func (t *tracker) popFuture(now time.Time) {
	it := t.q[t.head]
	t.pops++
	if t.stalledOn {
		t.stalledOn = false
		if t.unstalled != nil {
			t.unstalled()
		}
	}
	t.lastAckAt = now
	if it.partSeq > 0 && it.part < len(t.acked) {
		t.acked[it.part] = max(t.acked[it.part], it.partSeq)
	}
	t.msgs -= it.msgs
	t.bytes -= it.size
	t.q[t.head] = trackItem{}
	t.head++
}

// drain waits until no acknowledged publish is in flight. Loose messages
// after the last one (a transaction cut short by a stop) stay unproven:
// nothing after them is confirmed (a mark made meanwhile stays deferred),
// and the next start resumes after the stream's last message, whether they
// were stored or not.
func (t *tracker) drain(ctx context.Context, now func() time.Time) error {
	for t.len() > 0 {
		if err := t.waitFront(ctx, now); err != nil {
			return err
		}
	}
	return nil
}

func (t *tracker) compact() {
	if t.head > 1024 && t.head*2 > len(t.q) {
		n := copy(t.q, t.q[t.head:])
		clear(t.q[n:])
		t.q = t.q[:n]
		t.head = 0
	}
	if t.len() == 0 {
		t.q = t.q[:0]
		t.head = 0
	}
}

// safeLSN returns the highest LSN whose publishes are acknowledged and
// older than the sync delay.
func (t *tracker) safeLSN(now time.Time) event.LSN {
	i := 0
	for i < len(t.pending) && !t.pending[i].safeAt.After(now) {
		t.safe = max(t.safe, t.pending[i].lsn)
		if t.pending[i].seqs != nil {
			t.safeSeqs = t.pending[i].seqs
		}
		i++
	}
	if i > 0 {
		t.popPending(i)
	}
	return t.safe
}

// popPending drops the first n buckets, now safe: they wait for sent.
func (t *tracker) popPending(n int) {
	if t.unsentSince.IsZero() {
		t.unsentSince = t.pending[0].since
	}
	t.pending = append(t.pending[:0], t.pending[n:]...)
	t.reportLag()
}

// sent records that lsn was confirmed to the slot.
func (t *tracker) sent(lsn event.LSN) {
	if lsn >= t.safe && !t.unsentSince.IsZero() {
		t.unsentSince = time.Time{}
		t.reportLag()
	}
}

// unconfirmedSince is when the oldest written position not yet confirmed
// to the slot was written (zero: none).
func (t *tracker) unconfirmedSince() time.Time {
	if !t.unsentSince.IsZero() {
		return t.unsentSince
	}
	if len(t.pending) > 0 {
		return t.pending[0].since
	}
	return time.Time{}
}

// reportLagTo makes the tracker keep unconfirmedSince in a, as Unix
// nanoseconds (0: none), for a reader on another goroutine.
func (t *tracker) reportLagTo(a *atomic.Int64) {
	t.lag = a
	t.reportLag()
}

func (t *tracker) reportLag() {
	if t.lag == nil {
		return
	}
	var n int64
	if s := t.unconfirmedSince(); !s.IsZero() {
		n = s.UnixNano()
	}
	t.lag.Store(n)
}

// trustAll makes every written position safe: used after the broker has
// been shut down cleanly (its files are synced).
func (t *tracker) trustAll() {
	if len(t.pending) > 0 {
		last := t.pending[len(t.pending)-1]
		t.safe = max(t.safe, last.lsn)
		if last.seqs != nil {
			t.safeSeqs = last.seqs
		}
		t.popPending(len(t.pending))
	}
}
