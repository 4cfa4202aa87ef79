package capture

import (
	"context"
	"fmt"
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

type safePos struct {
	lsn    event.LSN
	safeAt time.Time
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
// markers coalesce, and safe positions are bucketed per second.
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

	// acked is every partition's last acknowledged signed message's
	// partition sequence; safeSeqs is acked as it was when safe was
	// written: the partition sequences the capture keeps outside the
	// stream (seqrecord.go) along with the slot's confirmed position. A
	// position is written only once everything before it is acknowledged
	// and positions are marked at transaction boundaries, so safeSeqs never
	// names a message of an unfinished transaction.
	acked    []uint64
	safeSeqs []uint64
}

// startSeqs starts the partition sequences at seqs (copied).
func (t *tracker) startSeqs(seqs []uint64) {
	t.acked = append([]uint64(nil), seqs...)
	t.safeSeqs = append([]uint64(nil), seqs...)
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

func (t *tracker) written0(lsn event.LSN, _ time.Time) {
	if lsn <= t.written {
		return
	}
	t.written = lsn
	safeAt := t.lastAckAt.Add(t.syncDelay)
	if n := len(t.pending); n > 0 && !safeAt.After(t.pending[n-1].safeAt.Add(time.Second)) {
		// Coalesce into the previous bucket, keeping the later time: this
		// can only delay a confirmation, never advance it early.
		p := &t.pending[n-1]
		p.lsn = lsn
		copy(p.seqs, t.acked)
		if safeAt.After(p.safeAt) {
			p.safeAt = safeAt
		}
		return
	}
	var seqs []uint64
	if t.acked != nil {
		seqs = append([]uint64(nil), t.acked...)
	}
	t.pending = append(t.pending, safePos{lsn: lsn, safeAt: safeAt, seqs: seqs})
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
				return nil
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
// pops it, then polls the rest.
func (t *tracker) waitFront(ctx context.Context, now func() time.Time) error {
	for t.len() > 0 {
		it := t.q[t.head]
		if it.fut == nil {
			if err := t.poll(now()); err != nil {
				return err
			}
			continue
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
		case <-ctx.Done():
			return fmt.Errorf("wait for publish acknowledgement: %w", ctx.Err())
		}
	}
	return nil
}

func (it trackItem) err(err error) error {
	if it.msgs > 1 {
		// A refused message fails every later one on its expected last
		// message id: the first cause may be one of the loose messages.
		return fmt.Errorf("publish %s (acknowledging it and the %d messages before it): %w", it.what, it.msgs-1, err)
	}
	return fmt.Errorf("publish %s: %w", it.what, err)
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
		t.pending = append(t.pending[:0], t.pending[i:]...)
	}
	return t.safe
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
		t.pending = t.pending[:0]
	}
}
