package projection

import (
	"bytes"
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"strings"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/internal/startstop"
	"github.com/epitaph-dev/epitaph/progress"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/trust"
	"github.com/epitaph-dev/epitaph/projection/version"
	"github.com/epitaph-dev/epitaph/quarantine"
)

// errReset asks the partition loop to re-read its progress row, verify the
// stream and reset the consumer to the cursor before fetching again.
var errReset = errors.New("partition needs a reset to its cursor")

// resetError is an errReset that says which condition asked for it (the
// partition loop logs it; the consumer reset that may follow names it).
type resetError struct {
	cause string // short, for logs: "pending_elsewhere", "stalled", ...
	msg   string
}

func (e *resetError) Error() string { return e.msg + ": " + errReset.Error() }
func (e *resetError) Unwrap() error { return errReset }

// resetCause is the cause a reset error names ("unnamed" for a bare errReset).
func resetCause(err error) string {
	if re := (*resetError)(nil); errors.As(err, &re) {
		return re.cause
	}
	return "unnamed"
}

// resetf is errReset for cause, with a message saying what was seen.
func resetf(cause, format string, args ...any) error {
	return &resetError{cause: cause, msg: fmt.Sprintf(format, args...)}
}

// item is one fetched message.
type item struct {
	msg     jetstream.Msg // nil for messages read directly from the stream
	seq     uint64
	dseq    uint64
	subject string
	headers map[string][]string
	data    []byte
	stored  time.Time
	id      string // Nats-Msg-Id, or a digest of the body
	ev      *event.Event
	// after is the partition's watermark before this message: a
	// quarantined message lies after it (archive.status, wait).
	after event.LSN
	// quarantine: set when the event cannot be applied (permanent)
	category string
	failure  error
	// replay: a verified message applied already, published again; it is
	// ignored (verify.go, replayed).
	replay bool
}

func identityOf(headers map[string][]string, data []byte) string {
	if v := headers[event.HeaderMsgID]; len(v) > 0 && v[0] != "" {
		return v[0]
	}
	sum := sha256.Sum256(data)
	return "sha256:" + hex.EncodeToString(sum[:16])
}

// partitionWorker applies one partition of one version while this worker
// holds its lease. It is a service (internal/startstop): a soft stop
// finishes the page (applies, commits the cursor, acks), the hard stop
// rolls it back.
type partitionWorker struct {
	startstop.Base
	workerEnv
	svc    workerRuntime
	ver    version.Version
	lease  progress.Lease
	filter string
	log    *slog.Logger

	pos     progress.Position
	stream  jetstream.Stream
	cons    jetstream.Consumer
	next    chan page // the page being fetched in the background, if any
	carry   []*item   // fetched, not applied: the next group starts with them (splitAtCommit)
	open    *openTx   // keys of the transaction still open (see decideEarly)
	applied uint64    // events applied by this worker (metrics)
	legacy  uint64    // the partition's legacy boundary (verify.go)
	// recorded is the consumer named on the progress row (version.UnitConsumer).
	recorded string
	// stalled counts idle rounds in a row in which the consumer had
	// messages pending but delivered none; at maxStalled the consumer is
	// recreated at the cursor (stuck, as seen after a JetStream cluster
	// lost the node that led it). recreate asks ensureConsumer for that.
	stalled      int
	stalledSince time.Time // the first of those rounds
	// elsewhere counts idle rounds in a row that saw deliveries pending
	// though this worker had acknowledged all it was given.
	elsewhere int
	recreate  bool
	// restart is why init runs again ("start", "transient failure",
	// "reset: <cause>"): a consumer reset it leads to logs it.
	restart string
}

// maxStalled is how many idle rounds (each a fetch of up to FetchWait) a
// consumer with pending messages may deliver nothing before it is
// recreated, and minStalled how long at least: on a loaded machine a server
// can be slow to deliver for several short fetches in a row, and a consumer
// recreated for that is a reset for nothing.
const (
	maxStalled = 3
	minStalled = 5 * time.Second
)

// workerEnv is what a partition worker uses of its service, handed to it
// when it is made instead of read through a pointer to the Service: the
// connections, the configuration, the consumer group, the stream's
// partition count (known before any worker starts), the trusted signing
// keys and the metrics.
type workerEnv struct {
	cfg        *Config
	pool       *pgxpool.Pool
	js         jetstream.JetStream
	group      string
	partitions int
	keys       *keyring
	metrics    *metrics
}

// workerRuntime is the service's part around a worker's pages: the rebuild
// share (states.go), the apply path (apply.go), the live
// version's side effects, and the hand-over of a lost lease.
type workerRuntime interface {
	admit(ctx context.Context, v version.Version) (release func(), err error)
	apply(ctx context.Context, in applyParams) (applyResult, error)
	afterPage(ctx context.Context, v version.Version, partition int, items []*item)
	leaseLost(w *partitionWorker)
	// firstBackoffWait is the first wait after a transient failure.
	firstBackoffWait() time.Duration
	// reconnectedCh is closed at the next NATS reconnection.
	reconnectedCh() <-chan struct{}
}

func newPartitionWorker(s *Service, v version.Version, l progress.Lease) *partitionWorker {
	return &partitionWorker{
		workerEnv: workerEnv{cfg: &s.cfg, pool: s.pool, js: s.js, group: s.group, partitions: s.partitions, keys: s.keys, metrics: s.metrics},
		svc:       s, ver: v, lease: l,
		filter: event.PartitionFilter(s.cfg.SourceName, l.Partition),
		log:    s.log.With("projection", v.Projection, "version", v.Version, "partition", l.Partition),
	}
}

// Start runs the partition loop in the background; cancelling ctx is the
// hard stop. It fails only when the worker was started (or ended) before.
func (w *partitionWorker) Start(ctx context.Context) error {
	_, hard, ok := w.StartInit(ctx)
	if !ok {
		return fmt.Errorf("partition worker %s already started", w.lease.ConsumerName())
	}
	go w.run(hard)
	return nil
}

// run is the partition loop. It returns on a soft stop, when ctx is done,
// or when the lease is lost.
func (w *partitionWorker) run(ctx context.Context) {
	defer w.Finish(nil)
	defer w.dropPrefetch()
	bo := backoff.NewExponentialBackOff()
	bo.InitialInterval = w.svc.firstBackoffWait()
	bo.MaxInterval = w.cfg.MaxBackoff
	bo.MaxElapsedTime = 0
	needInit, resets := true, 0
	w.restart = "start"
	failed := false // a failure is recorded and not yet cleared
	for !w.StopRequested() && ctx.Err() == nil {
		// Taken before the step: a reconnection during a failing step
		// ends the wait after it at once.
		back := w.svc.reconnectedCh()
		var err error
		if needInit {
			err = w.init(ctx)
			if err == nil {
				needInit = false
			}
		}
		if err == nil {
			err = w.step(ctx)
		}
		if err != nil {
			w.dropPrefetch()
		}
		switch {
		case err == nil:
			bo.Reset()
			resets = 0
			if failed {
				// Working again (an applied page cleared the count
				// already; an idle round did not): not failing.
				failed = w.clearFailures(ctx) != nil
			}
			continue
		case errors.Is(err, progress.ErrLostOwnership):
			w.log.Warn("lost the partition lease to another worker; stopping it", "err", err)
			w.svc.leaseLost(w)
			return
		case errors.Is(err, errReset):
			needInit = true
			resets++
			w.restart = "reset: " + resetCause(err)
			w.log.Info("partition resets to its cursor", "cause", resetCause(err), "err", err)
			if resets <= 3 {
				continue
			}
			// Resetting again and again: back off rather than spin.
			w.log.Warn("partition keeps resetting", "err", err)
			w.wait(ctx, bo.NextBackOff())
			continue
		case ctx.Err() != nil:
			return
		}
		needInit = true
		w.restart = "transient failure"
		kind := quarantine.TransientKind(err)
		w.metrics.transient.WithLabelValues(kind).Inc()
		wait := bo.NextBackOff()
		w.log.Warn("transient failure; retrying", "kind", kind, "err", quarantine.Sanitize(err), "retry_in", wait)
		w.recordFailure(ctx, kind)
		failed = true
		if w.waitOrReconnect(ctx, wait, back) {
			// The broker is back: a failure it caused is over, and the
			// next one, if any, starts the backoff again.
			w.log.Info("NATS connection back; retrying now")
			bo.Reset()
		}
	}
}

// wait sleeps for d unless the worker is stopped first.
func (w *partitionWorker) wait(ctx context.Context, d time.Duration) {
	w.waitOrReconnect(ctx, d, nil)
}

// waitOrReconnect sleeps for d unless the worker is stopped first or back
// is closed (the NATS connection came back); it reports the latter.
func (w *partitionWorker) waitOrReconnect(ctx context.Context, d time.Duration, back <-chan struct{}) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-w.Stopping():
	case <-ctx.Done():
	case <-back:
		return true
	}
	return false
}

func (w *partitionWorker) clearFailures(ctx context.Context) error {
	c, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	return progress.ClearFailures(c, w.pool, w.lease)
}

func (w *partitionWorker) recordFailure(ctx context.Context, kind string) {
	c, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	_ = progress.RecordFailure(c, w.pool, w.lease, "transient:"+kind)
}

// init reads the cursor, checks the stream still holds the last applied
// message at the cursor (rewinding if it lost its tail) and makes the
// durable consumer start right after the cursor.
func (w *partitionWorker) init(ctx context.Context) error {
	row, err := progress.Get(ctx, w.pool, w.lease.Key)
	if err != nil {
		return err
	}
	if row.Epoch != w.lease.Epoch {
		return fmt.Errorf("init %s: epoch is %d, lease has %d: %w", w.lease.Key, row.Epoch, w.lease.Epoch, progress.ErrLostOwnership)
	}
	w.pos = row.Position
	w.recorded = row.Consumer
	w.open = nil
	w.stream, err = w.js.Stream(ctx, event.StreamName(w.cfg.SourceName))
	if err != nil {
		return fmt.Errorf("open stream: %w", err)
	}
	if err := w.checkStreamIdentity(ctx, row.StreamCreated); err != nil { // verify.go
		return err
	}
	if w.legacy, err = w.legacyBoundary(ctx); err != nil {
		return err
	}
	if _, err := w.verify(ctx); err != nil {
		return err
	}
	return w.ensureConsumer(ctx)
}

// verify checks that the message at the cursor is still the one applied
// there. When the stream lost its tail (the cursor is past the stream's end,
// or another message sits at the cursor), it rewinds the cursor so that
// everything after the last surely-present applied event is applied again
// (idempotently). A cursor below the stream's first sequence is fine: old
// messages were purged or aged out.
func (w *partitionWorker) verify(ctx context.Context) (rewound bool, err error) {
	if w.pos.Cursor == 0 {
		return false, nil
	}
	var raw *jetstream.RawStreamMsg
	if w.pos.MsgID != "" {
		var err error
		raw, err = w.stream.GetMsg(ctx, w.pos.Cursor)
		if err == nil {
			if identityOf(raw.Header, raw.Data) == w.pos.MsgID {
				return false, nil
			}
		} else if !errors.Is(err, jetstream.ErrMsgNotFound) {
			return false, fmt.Errorf("read message at cursor %d: %w", w.pos.Cursor, err)
		}
	}
	info, err := w.stream.Info(ctx)
	if err != nil {
		return false, fmt.Errorf("stream info: %w", err)
	}
	first, last := info.State.FirstSeq, info.State.LastSeq
	switch {
	case w.pos.Cursor > last:
		return true, w.rewind(ctx, first, last, fmt.Sprintf("cursor %d is past the stream's last sequence %d", w.pos.Cursor, last))
	case raw != nil:
		return true, w.rewind(ctx, first, last, fmt.Sprintf("another message sits at cursor %d", w.pos.Cursor))
	case w.pos.Cursor < first || w.pos.MsgID == "":
		// Purged or aged out; or the identity at the cursor is unknown
		// (after a rewind onto a deleted sequence) and cannot be checked.
		return false, nil
	default:
		return true, w.rewind(ctx, first, last, fmt.Sprintf("the message at cursor %d is gone", w.pos.Cursor))
	}
}

// rewind moves the cursor back to just before the first message of the
// partition whose source position is at or after the last applied event's
// commit LSN (messages of a partition are in source order), or to the start
// of the partition when that cannot be told. Re-applying is idempotent.
func (w *partitionWorker) rewind(ctx context.Context, first, last uint64, why string) error {
	bound := min(last, w.pos.Cursor)
	target, err := w.rewindTarget(ctx, first, bound)
	if err != nil {
		return err
	}
	target = min(target, w.pos.Cursor)
	// Verification starts afresh at the target (a transaction boundary),
	// but the last verified partition sequence is kept: the messages
	// re-applied up to the old cursor are replays of it (ignored), and the
	// first verified message past it must continue it, or what the stream
	// lost of the partition after the cursor is a removed_from_stream gap
	// (forgetting it would take any next message as a continuation).
	next := progress.Position{Cursor: target, CommitLSN: w.pos.CommitLSN, Seq: -1, SourceLSN: w.pos.SourceLSN,
		Trust: progress.Trust{TxStart: target, PartSeq: w.pos.Trust.PartSeq}}
	if target > 0 {
		raw, err := w.stream.GetMsg(ctx, target)
		switch {
		case err == nil:
			next.MsgID = identityOf(raw.Header, raw.Data)
		case errors.Is(err, jetstream.ErrMsgNotFound):
			// Unknown identity: checked again once a message is applied.
		default:
			return fmt.Errorf("read message at %d: %w", target, err)
		}
	}
	lost, err := w.lostWindowEntries(ctx)
	if err != nil {
		return err
	}
	tx, err := w.pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	dropped, err := w.dropOpenWindow(ctx, tx)
	if err != nil {
		return err
	}
	if err := w.refuseEntries(ctx, tx, lost); err != nil {
		return err
	}
	if err := progress.Advance(ctx, tx, w.lease, w.pos.Cursor, next, w.cfg.LeaseTTL); err != nil {
		return err
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("commit rewind: %w", err)
	}
	w.log.Warn("stream lost its tail: rewound the partition to re-apply idempotently",
		"reason", why, "from", w.pos.Cursor, "to", target, "last_commit_lsn", w.pos.CommitLSN.String(),
		"unverified_rows_dropped", dropped)
	w.metrics.rewinds.WithLabelValues(w.ver.Projection, itoa(w.ver.Version)).Inc()
	w.pos = next
	return nil
}

// dropOpenWindow deletes, in the rewind's transaction tx, what the
// partition archived of transactions not verified yet at or after the last
// applied commit LSN (the open window: rows inserted invisible, truncates
// waiting) and stops their deliveries, as verification's slow path drops
// rows it refuses; it returns how many. The rewind applies those messages
// again from the stream, and the copies written before must not stay: a
// transaction re-applied whole in one page inserts its rows verified, ON
// CONFLICT DO NOTHING would keep the invisible copies instead, and the
// transaction's rows would never be seen, with no gap; and a copy of a
// message the stream lost and nobody sent again is not to be kept.
func (w *partitionWorker) dropOpenWindow(ctx context.Context, tx pgx.Tx) (int, error) {
	rs, _ := tx.Query(ctx, `SELECT commit_lsn::text, seq FROM `+archive.Ident(w.ver.Schema, "rows")+`
		WHERE source = $1 AND NOT verified AND commit_lsn >= $2::pg_lsn
		UNION ALL
		SELECT commit_lsn::text, seq FROM `+archive.Ident(w.ver.Schema, "pending_truncates")+`
		WHERE partition = $3 AND commit_lsn >= $2::pg_lsn`,
		w.cfg.SourceName, w.pos.CommitLSN.String(), w.lease.Partition)
	window, err := pgx.CollectRows(rs, func(r pgx.CollectableRow) (rowID, error) {
		var lsn string
		var id rowID
		err := r.Scan(&lsn, &id.seq)
		if err == nil {
			id.lsn, err = event.ParseLSN(lsn)
		}
		return id, err
	})
	if err != nil {
		return 0, fmt.Errorf("read the open window: %w", err)
	}
	drop := window[:0]
	for _, id := range window {
		if event.Partition(id.lsn, w.partitions) == w.lease.Partition {
			drop = append(drop, id)
		}
	}
	if len(drop) == 0 {
		return 0, nil
	}
	if err := dropUnverified(ctx, tx, w.ver.Schema, w.cfg.SourceName, w.lease.Partition, drop); err != nil {
		return 0, err
	}
	var live bool
	if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM epitaph.projection_versions
		WHERE projection = $1 AND version = $2 AND state = 'live')`, w.ver.Projection, w.ver.Version).Scan(&live); err != nil {
		return 0, fmt.Errorf("read the version's state: %w", err)
	}
	if !live {
		return len(drop), nil // deliveries are the live version's (a rebuild makes none)
	}
	lsns, seqs := rowIDArgs(drop)
	return len(drop), handler.StopUnverified(ctx, tx, w.cfg.SourceName, lsns, seqs)
}

// openWindowLost is the error of a quarantined row of the open window
// that the stream lost (lostWindowEntries).
const openWindowLost = "row message of a transaction whose signed commit was not seen, lost from the stream with its tail; " +
	"the partition applied the stream again from before it (what the stream still holds of it is quarantined anew)"

// lostWindowEntries returns the open quarantine entries of the row
// messages in the partition's open window (after its last verified
// boundary, up to the cursor) that the stream no longer holds at their
// sequence: the rewind refuses them (refuseEntries), as verification
// refuses the rows of a window no signed commit closes. Their invisible
// siblings are dropped (dropOpenWindow), and the open window's trust state
// with the rewind: nothing would tell a replay any more that no signed
// commit covers them, and it would archive such a row visible. An entry
// whose message is still there is left as it is: the partition applies it
// again, in its window.
func (w *partitionWorker) lostWindowEntries(ctx context.Context) ([]int64, error) {
	if w.pos.Trust.Pending == 0 {
		return nil, nil
	}
	type entry struct {
		id, seq int64
		subject string
		headers map[string][]string
		data    []byte
	}
	rs, err := w.pool.Query(ctx, `SELECT id, stream_seq, subject, headers, data FROM epitaph.quarantine
		WHERE projection = $1 AND version = $2 AND partition = $3 AND status = 'open' AND category <> $4
		  AND stream_seq > $5 AND stream_seq <= $6`,
		w.ver.Projection, w.ver.Version, w.lease.Partition, trust.CategoryUnauthenticated,
		int64(w.pos.Trust.TxStart), int64(w.pos.Cursor))
	if err != nil {
		return nil, fmt.Errorf("read the open window's quarantine entries: %w", err)
	}
	entries, err := pgx.CollectRows(rs, func(r pgx.CollectableRow) (entry, error) {
		var e entry
		err := r.Scan(&e.id, &e.seq, &e.subject, &e.headers, &e.data)
		return e, err
	})
	if err != nil {
		return nil, fmt.Errorf("read the open window's quarantine entries: %w", err)
	}
	var lost []int64
	for _, e := range entries {
		if kindOf(e.subject) != kindRow {
			continue
		}
		raw, err := w.stream.GetMsg(ctx, uint64(e.seq))
		switch {
		case errors.Is(err, jetstream.ErrMsgNotFound):
		case err != nil:
			return nil, fmt.Errorf("read message at %d: %w", e.seq, err)
		case identityOf(raw.Header, raw.Data) == identityOf(e.headers, e.data) && bytes.Equal(raw.Data, e.data):
			continue
		}
		lost = append(lost, e.id)
	}
	return lost, nil
}

// refuseEntries refuses, in the rewind's transaction tx, the quarantine
// entries ids (lostWindowEntries) as unauthenticated.
func (w *partitionWorker) refuseEntries(ctx context.Context, tx pgx.Tx, ids []int64) error {
	if len(ids) == 0 {
		return nil
	}
	tag, err := tx.Exec(ctx, `UPDATE epitaph.quarantine SET category = $2, error = $3, last_attempt_at = now()
		WHERE id = ANY($1::bigint[]) AND status = 'open'`, ids, trust.CategoryUnauthenticated, openWindowLost)
	if err != nil {
		return fmt.Errorf("refuse the open window's lost quarantine entries: %w", err)
	}
	w.log.Warn("rewind: refused the quarantined row messages of the open transaction that the stream lost (its signed commit was not seen)",
		"entries", tag.RowsAffected(), "from_seq", w.pos.Trust.TxStart+1, "to_seq", w.pos.Cursor)
	return nil
}

// rewindTarget binary-searches the stream in [first, bound] for the first
// partition message whose position is >= the last applied commit LSN and
// returns the sequence just before it (bound when there is none).
//
// When there is none, the partition's next message past bound may be the
// tail of a copy of a transaction applied before (the stream holds the
// partition's messages at other sequences than before, another
// partition's first): the target is then before that copy's first message,
// so that the copy is applied again whole (a replay, ignored). Started
// inside it, its tail would open the next transaction's window and be
// refused with it, quarantined as not part of a verified transaction.
func (w *partitionWorker) rewindTarget(ctx context.Context, first, bound uint64) (uint64, error) {
	want := w.pos.CommitLSN
	if want == 0 || first == 0 || bound < first {
		if first > 0 {
			return first - 1, nil
		}
		return 0, nil
	}
	target, err := w.searchPosition(ctx, first, bound, want)
	if err != nil || target < bound {
		return target, err
	}
	_, lsn, ok, err := w.partitionMsgFrom(ctx, bound+1, math.MaxUint64)
	if err != nil || !ok || lsn >= want {
		return bound, err
	}
	return w.searchPosition(ctx, first, bound, lsn)
}

// searchPosition binary-searches the stream in [first, bound] for the
// first partition message whose position is >= want and returns the
// sequence just before it (bound when there is none).
func (w *partitionWorker) searchPosition(ctx context.Context, first, bound uint64, want event.LSN) (uint64, error) {
	lo, hi := first, bound+1 // invariant: the answer m is in [lo, hi]
	for lo < hi {
		mid := lo + (hi-lo)/2
		_, lsn, ok, err := w.partitionMsgFrom(ctx, mid, bound)
		if err != nil {
			return 0, err
		}
		if !ok || lsn >= want {
			hi = mid
		} else {
			lo = mid + 1
		}
	}
	seq, _, ok, err := w.partitionMsgFrom(ctx, lo, bound)
	if err != nil {
		return 0, err
	}
	if !ok {
		return bound, nil
	}
	return seq - 1, nil
}

// partitionMsgFrom returns the first partition message at or after seq
// (within bound), its position (unknownPosition when it cannot be
// decoded), and whether there is one.
func (w *partitionWorker) partitionMsgFrom(ctx context.Context, seq, bound uint64) (uint64, event.LSN, bool, error) {
	raw, err := w.stream.GetMsg(ctx, seq, jetstream.WithGetMsgSubject(w.filter))
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return 0, 0, false, nil
	}
	if err != nil {
		return 0, 0, false, fmt.Errorf("search stream from %d: %w", seq, err)
	}
	if raw.Sequence > bound {
		return 0, 0, false, nil
	}
	e, err := w.cfg.Decoder.Decode(raw.Data)
	if err != nil {
		return raw.Sequence, unknownPosition, true, nil
	}
	return raw.Sequence, version.PositionLSN(e), true, nil
}

// unknownPosition is the position of a message that cannot be decoded: at
// or after any, so that a rewind starts before it rather than after (a row
// of the transaction it rewinds to, skipped, would make the transaction
// fail its signed digest).
const unknownPosition = event.LSN(math.MaxUint64)

// ensureConsumer keeps the durable consumer if it stands exactly at the
// cursor with nothing in flight, else deletes and recreates it to start at
// cursor+1: the Postgres cursor is the truth. The consumer is the one
// recorded on the progress row when it is the group's
// (version.IsUnitConsumer), reused on every start. Otherwise a new name is
// made (version.NewUnitConsumer): the consumer used before (recorded on the
// row: one with a deterministic name, or another group's) and the
// deterministic names are deleted, then the new name is recorded, and only
// then is the consumer made, so that the row always names every consumer
// of the unit that may exist and none is left behind by a crash.
func (w *partitionWorker) ensureConsumer(ctx context.Context) error {
	name := w.recorded
	if !version.IsUnitConsumer(name, w.lease.Key, w.group) {
		var err error
		if name, err = version.NewUnitConsumer(w.lease.Key, w.group); err != nil {
			return err
		}
		if err := deleteConsumers(ctx, w.stream, w.recorded, w.lease.GroupConsumerName(w.group), w.lease.ConsumerName()); err != nil {
			return fmt.Errorf("delete the consumer used before: %w", err)
		}
		if err := w.recordConsumer(ctx, name); err != nil {
			return err
		}
		w.log.Info("new consumer name recorded", "consumer", name)
	}
	return w.openConsumer(ctx, name)
}

func (w *partitionWorker) recordConsumer(ctx context.Context, name string) error {
	if w.recorded == name {
		return nil
	}
	if err := progress.RecordConsumer(ctx, w.pool, w.lease, name); err != nil {
		return err
	}
	w.recorded = name
	return nil
}

// openConsumer is the consumer name at the cursor (see ensureConsumer).
func (w *partitionWorker) openConsumer(ctx context.Context, name string) error {
	c, err := w.stream.Consumer(ctx, name)
	if err == nil {
		info := c.CachedInfo()
		reason := w.resetReason(info)
		if reason == "" {
			w.cons = c
			return nil
		}
		want := w.wantConsumer(name)
		w.log.Info("resetting consumer to the cursor", "consumer", name, "reason", reason, "setting", consumerMismatch(&info.Config, &want), "after", w.restart,
			"cursor", w.pos.Cursor, "ack_floor", info.AckFloor.Stream, "ack_pending", info.NumAckPending,
			"num_pending", info.NumPending, "delivered", info.Delivered.Stream)
		w.metrics.consumerResets.WithLabelValues(w.ver.Projection, itoa(w.ver.Version), reason).Inc()
		if err := w.stream.DeleteConsumer(ctx, name); err != nil && !errors.Is(err, jetstream.ErrConsumerNotFound) {
			return fmt.Errorf("delete consumer %s: %w", name, err)
		}
	} else if !errors.Is(err, jetstream.ErrConsumerNotFound) {
		return fmt.Errorf("look up consumer %s: %w", name, err)
	}
	c, err = w.stream.CreateConsumer(ctx, w.wantConsumer(name))
	if err != nil {
		return fmt.Errorf("create consumer %s at %d: %w", name, w.pos.Cursor+1, err)
	}
	w.cons, w.recreate, w.stalled, w.elsewhere = c, false, 0, 0
	return nil
}

// wantConsumer is the configuration of the partition's durable consumer,
// starting after the cursor.
func (w *partitionWorker) wantConsumer(name string) jetstream.ConsumerConfig {
	return jetstream.ConsumerConfig{
		Durable:       name,
		Description:   "epitaph projector " + name,
		FilterSubject: w.filter,
		DeliverPolicy: jetstream.DeliverByStartSequencePolicy,
		OptStartSeq:   w.pos.Cursor + 1,
		AckPolicy:     jetstream.AckAllPolicy,
		AckWait:       5 * time.Minute,
		MaxAckPending: maxAckPending,
		MaxDeliver:    -1,
	}
}

// serverMaxWaiting is the pull requests a consumer holds at once when its
// configuration does not say (the server's default).
const serverMaxWaiting = 512

// consumerMismatch names the first setting of got (a consumer on the
// server) that differs from want (wantConsumer), or "". The whole
// configuration is compared, not only what a worker sets: whoever may
// create consumers can make one under the partition's name that delivers
// headers only, skips, throttles, pauses or forgets deliveries; a worker
// that kept it would quarantine or miss what it delivers. The start
// sequence is not compared (the cursor moves on; resetReason checks the
// ack floor), nor the description, metadata and replicas, which change
// nothing delivered.
func consumerMismatch(got, want *jetstream.ConsumerConfig) string {
	switch {
	case got.HeadersOnly != want.HeadersOnly:
		return "headers_only"
	case got.FilterSubject != want.FilterSubject || len(got.FilterSubjects) > 1 ||
		len(got.FilterSubjects) == 1 && got.FilterSubjects[0] != want.FilterSubject:
		return "filter_subject"
	case got.AckPolicy != want.AckPolicy:
		return "ack_policy"
	case got.MaxAckPending != want.MaxAckPending:
		return "max_ack_pending"
	case got.DeliverPolicy != want.DeliverPolicy:
		return "deliver_policy"
	case got.AckWait != want.AckWait:
		return "ack_wait"
	case got.MaxDeliver != want.MaxDeliver:
		return "max_deliver"
	case len(got.BackOff) > 0:
		return "backoff"
	case got.ReplayPolicy != want.ReplayPolicy:
		return "replay_policy"
	}
	return limitsMismatch(got, want)
}

// limitsMismatch is consumerMismatch for the limits and modes a worker
// never sets: any of them set is a difference.
func limitsMismatch(got, want *jetstream.ConsumerConfig) string {
	switch {
	case got.RateLimit != 0:
		return "rate_limit"
	case got.SampleFrequency != "":
		return "sample_freq"
	case got.MaxWaiting != 0 && got.MaxWaiting < serverMaxWaiting:
		return "max_waiting"
	case got.MaxRequestBatch != 0 || got.MaxRequestExpires != 0 || got.MaxRequestMaxBytes != 0:
		return "max_request"
	case got.InactiveThreshold != 0:
		return "inactive_threshold"
	case got.MemoryStorage != want.MemoryStorage:
		return "mem_storage"
	case got.PauseUntil != nil && got.PauseUntil.After(time.Now()):
		return "paused"
	case got.PriorityPolicy != jetstream.PriorityPolicyNone || len(got.PriorityGroups) > 0:
		return "priority_policy"
	case got.DeliverSubject != "" || got.DeliverGroup != "":
		return "push"
	}
	return ""
}

// resetReason is why the consumer described by info cannot be kept as the
// partition's (the label of epitaph_projector_consumer_resets_total), or ""
// when it stands exactly at the cursor with nothing in flight.
func (w *partitionWorker) resetReason(info *jetstream.ConsumerInfo) string {
	want := w.wantConsumer(info.Name)
	switch {
	case w.recreate:
		return "stalled"
	case consumerMismatch(&info.Config, &want) != "":
		return "config"
	case info.NumAckPending > 0:
		return "ack_pending"
	case info.AckFloor.Stream != w.pos.Cursor:
		return "ack_floor"
	}
	return ""
}

// page is one fetched and decoded group of pages.
type page struct {
	items []*item
	full  bool // the first fetch came back full: the partition is behind
	err   error
}

// pagesPerTx is how many fetched pages (of at most Config.BatchSize events
// each) one target transaction may apply. A fetch stays bounded by the
// batch size; while a partition is behind (a rebuild, a backlog) every
// fetch comes back full, and the pages that are already waiting are
// fetched at once (no wait) and applied together: fewer transactions,
// cursor advances and acks per event, and more source transactions whole
// in one transaction (their roots are decided in memory on insert instead
// of in SQL at the commit). A partition that is caught up gets one short
// page per transaction, as before. The cursor still advances by CAS in the
// transaction, and the last message is acked after the commit. Only with
// the default (largest) batch size: a smaller Config.BatchSize is taken
// as the most events per transaction.
const pagesPerTx = 2

// maxGroupBytes bounds the message bytes of a group: no further page is
// fetched into a group once it holds this much (the first page is always
// fetched whole), so that groups of large rows stay near one page.
const maxGroupBytes = 4 << 20

// maxAckPending is the consumer's limit of unacknowledged deliveries: the
// group being applied (with a carried tail) plus the one fetched in the
// background.
const maxAckPending = 4 * pagesPerTx * MaxBatchSize

// fetchPage fetches a group of pages (see pagesPerTx) and decodes it.
func (w *partitionWorker) fetchPage() page {
	size, pages := w.cfg.BatchSize, 1
	if size == MaxBatchSize {
		pages = pagesPerTx
	}
	var items []*item
	bytes := 0
	for n := 0; n < pages; n++ {
		var batch jetstream.MessageBatch
		var err error
		if n == 0 {
			// The server ends the request: the batch is full, or its
			// expiry (FetchWait) passed and it says so (408). A deadline
			// of the client's own (a FetchContext with a timeout: nats.go
			// gives the server 90% of it) ends the fetch first whenever
			// the request reached the server more than that 10% late, as
			// it does on a loaded machine; what the server then still
			// delivered went to an inbox no longer read: delivered, never
			// seen, pending for the consumer's AckWait, and the partition
			// reset its consumer for it (a page gap, or deliveries
			// "pending elsewhere") or failed the idle fetch (timeout). The
			// batch is read to its end below, so that the fetch's
			// goroutine in nats.go has ended when this returns.
			batch, err = w.cons.Fetch(size, jetstream.FetchMaxWait(w.cfg.FetchWait))
		} else {
			batch, err = w.cons.FetchNoWait(size)
		}
		if err != nil {
			if len(items) > 0 {
				return page{items: items}
			}
			return page{err: fmt.Errorf("fetch: %w", err)}
		}
		got := 0
		var bad error
		for m := range batch.Messages() {
			md, err := m.Metadata()
			if err != nil || bad != nil {
				// Read on to the batch's end (see above); the page fails.
				bad = cmp.Or(bad, err)
				continue
			}
			it := &item{
				msg: m, seq: md.Sequence.Stream, dseq: md.Sequence.Consumer, subject: m.Subject(),
				headers: m.Headers(), data: m.Data(), stored: md.Timestamp,
			}
			it.id = identityOf(it.headers, it.data)
			if ev, err := w.cfg.Decoder.Decode(it.data); err != nil {
				cat, _ := quarantine.Classify(err)
				it.category, it.failure = string(cat), err
			} else {
				it.ev = ev
			}
			items = append(items, it)
			bytes += len(it.data)
			got++
		}
		if bad != nil {
			return page{err: fmt.Errorf("message metadata: %w", bad)}
		}
		if err := batch.Error(); err != nil {
			if len(items) == 0 {
				return page{err: fmt.Errorf("fetch: %w", err)}
			}
			w.log.Debug("fetch ended early", "err", err, "got", len(items))
			return page{items: items}
		}
		if got < size {
			// Drained: do not wait for more. A group whose first page came
			// back full is still one the partition was behind on: it is cut
			// at its last commit as well (splitAtCommit), or the open
			// transaction at its end would be written across two target
			// transactions (its rows unverified, then again at its commit).
			return page{items: items, full: n > 0}
		}
		if bytes >= maxGroupBytes {
			break
		}
	}
	return page{items: items, full: true}
}

// maxCarry bounds the events and bytes held back after a group's last
// commit (see splitAtCommit).
const (
	maxCarry      = 3 * MaxBatchSize
	maxCarryBytes = maxGroupBytes / 2
)

// splitAtCommit cuts a group that the partition is behind on after its
// last commit event when what follows is short: the tail (a transaction
// whose commit has not been fetched yet) is carried into the next group,
// so that source transactions are applied whole and their roots are
// decided in memory on insert. The tail stays delivered and unacked; the
// next group continues with it, so pages stay contiguous from the cursor.
func splitAtCommit(items []*item) (apply, carry []*item) {
	bytes := 0
	for i := len(items) - 1; i >= 0 && len(items)-1-i <= maxCarry && bytes <= maxCarryBytes; i-- {
		if ev := items[i].ev; ev != nil && ev.Op == event.OpCommit {
			return items[:i+1], items[i+1:]
		}
		bytes += len(items[i].data)
	}
	return items, nil
}

// step applies one page. While it is applied, the next page is fetched and
// decoded in the background (it stays unacknowledged until applied; when
// the partition resets, it is dropped and the consumer recreated).
func (w *partitionWorker) step(ctx context.Context) error {
	var p page
	if w.next != nil {
		p = <-w.next
		w.next = nil
	} else {
		p = w.fetchPage()
	}
	if p.err != nil {
		return p.err
	}
	items := p.items
	if len(w.carry) > 0 {
		items = append(w.carry, items...)
		w.carry = nil
	}
	if len(items) == 0 {
		return w.idle(ctx)
	}
	w.stalled, w.elsewhere = 0, 0
	if p.full && w.cfg.BatchSize == MaxBatchSize {
		items, w.carry = splitAtCommit(items)
	}
	if !w.StopRequested() {
		next := make(chan page, 1)
		w.next = next
		go func() { next <- w.fetchPage() }()
	}
	return w.process(ctx, items)
}

// dropPrefetch waits for a background fetch and forgets its page and the
// carried tail (the consumer is reset to the cursor after this).
func (w *partitionWorker) dropPrefetch() {
	if w.next != nil {
		<-w.next
		w.next = nil
	}
	w.carry = nil
}

// idle checks, while nothing arrives, that the consumer still exists, that
// no other reader holds deliveries of it, and that the stream did not lose
// its tail below the cursor.
func (w *partitionWorker) idle(ctx context.Context) error {
	ci, err := w.cons.Info(ctx)
	if err != nil {
		if errors.Is(err, jetstream.ErrConsumerNotFound) || errors.Is(err, jetstream.ErrStreamNotFound) {
			return resetf("consumer_missing", "consumer info: %v", err)
		}
		return fmt.Errorf("consumer info: %w", err)
	}
	if want := w.wantConsumer(ci.Name); consumerMismatch(&ci.Config, &want) != "" {
		// Made anew under the partition's name by someone else.
		return resetf("consumer_config", "consumer %s is not configured as the partition's (%s)", ci.Name, consumerMismatch(&ci.Config, &want))
	}
	if ci.NumAckPending > 0 {
		// This worker has acknowledged everything it was given, so these
		// deliveries went to another reader (a worker that lost its lease):
		// reset rather than wait for their ack timeout. Acks are not
		// synchronous: the server may answer this request before it has
		// processed the page's ack just sent, so only a second round in a
		// row counts.
		if w.elsewhere++; w.elsewhere >= 2 {
			return resetf("pending_elsewhere", "%d deliveries pending elsewhere (ack floor %d, cursor %d)", ci.NumAckPending, ci.AckFloor.Stream, w.pos.Cursor)
		}
		return nil
	}
	w.elsewhere = 0
	if ci.NumPending == 0 {
		w.stalled = 0
	} else if w.stalled++; w.stalled == 1 {
		w.stalledSince = time.Now()
	} else if w.stalled >= maxStalled && time.Since(w.stalledSince) >= minStalled {
		w.log.Warn("consumer delivers nothing though messages are pending; recreating it at the cursor",
			"consumer", ci.Name, "pending", ci.NumPending, "idle_fetches", w.stalled,
			"stalled_for", time.Since(w.stalledSince).Round(time.Millisecond))
		w.recreate = true
		return resetf("stalled", "consumer %s stalled with %d pending", ci.Name, ci.NumPending)
	}
	info, err := w.stream.Info(ctx)
	if err != nil {
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			return resetf("stream_missing", "stream info: %v", err)
		}
		return fmt.Errorf("stream info: %w", err)
	}
	if info.State.LastSeq < w.pos.Cursor {
		return resetf("stream_behind", "the stream's last sequence %d is before the cursor %d", info.State.LastSeq, w.pos.Cursor)
	}
	if first := info.State.FirstSeq; first > w.pos.Cursor+1 && w.pos.Cursor >= w.legacy && w.pos.Trust.PartSeq > 0 {
		return w.recordSuspectedGap(ctx, first) // verify.go
	}
	return nil
}

// process applies a fetched page: it drops what was applied already, checks
// the page continues the cursor exactly (no message of the partition between
// the cursor and the page, no delivery of this consumer to anyone else in
// between), decodes, and applies the page in one transaction with the cursor
// advance, then acks.
func (w *partitionWorker) process(ctx context.Context, items []*item) error {
	for _, it := range items {
		if len(it.data) > 0 || it.msg == nil {
			continue
		}
		// A delivery without a body: the stored message has one when the
		// consumer delivers headers only (made anew under the partition's
		// name by someone else). Read again from the cursor on a consumer
		// of the partition's own, never quarantined as malformed; a message
		// stored empty is malformed as it is.
		raw, err := w.stream.GetMsg(ctx, it.seq)
		if err != nil && !errors.Is(err, jetstream.ErrMsgNotFound) {
			return fmt.Errorf("read the message of a delivery without a body: %w", err)
		}
		if err != nil || len(raw.Data) > 0 {
			return resetf("headers_only", "a delivery without a body at stream sequence %d (a consumer delivering headers only)", it.seq)
		}
	}
	rewound, err := w.verify(ctx)
	if err != nil {
		return err
	}
	if rewound {
		return resetf("rewound", "rewound to %d", w.pos.Cursor)
	}
	fresh := items[:0]
	var stale *item
	for _, it := range items {
		if it.seq <= w.pos.Cursor {
			stale = it
			continue
		}
		fresh = append(fresh, it)
	}
	if stale != nil {
		// Redelivered, already applied (the cursor is past it and verified).
		_ = stale.msg.Ack()
	}
	if len(fresh) == 0 {
		return nil
	}
	for i := 1; i < len(fresh); i++ {
		if fresh[i].dseq != fresh[i-1].dseq+1 || fresh[i].seq <= fresh[i-1].seq {
			return resetf("out_of_order", "deliveries out of order at %d (another reader on %s?)", fresh[i].seq, w.lease.ConsumerName())
		}
	}
	if err := w.ownSubjects(fresh); err != nil {
		return err
	}
	raw, err := w.stream.GetMsg(ctx, w.pos.Cursor+1, jetstream.WithGetMsgSubject(w.filter))
	if err != nil {
		return fmt.Errorf("check the next message after cursor %d: %w", w.pos.Cursor, err)
	}
	if raw.Sequence != fresh[0].seq {
		return resetf("page_gap", "page starts at %d but the partition continues at %d", fresh[0].seq, raw.Sequence)
	}
	release, err := w.svc.admit(ctx, w.ver) // rebuild share (states.go)
	if err != nil {
		return err
	}
	vd, err := w.verifiedPage(ctx, fresh)
	if err != nil {
		release()
		return err
	}
	res, err := w.svc.apply(ctx, applyParams{v: w.ver, l: w.lease, pos: w.pos, items: fresh, open: w.open, vd: vd})
	release()
	if err != nil {
		w.open = nil
		return err
	}
	w.open = res.open
	last := fresh[len(fresh)-1]
	if err := last.msg.Ack(); err != nil {
		// The cursor is the truth; the consumer is reset to it if needed.
		w.log.Debug("ack failed after commit", "seq", last.seq, "err", err)
	}
	w.pos = res.pos
	w.svc.afterPage(ctx, w.ver, w.lease.Partition, fresh) // side effects: live version only
	w.applied += uint64(len(fresh))
	w.metrics.applied.WithLabelValues(w.ver.Projection, itoa(w.ver.Version)).Add(float64(res.applied))
	w.metrics.replayed.WithLabelValues(w.ver.Projection, itoa(w.ver.Version)).Add(float64(vd.replayed))
	for cat, n := range res.quarantined {
		w.metrics.quarantined.WithLabelValues(w.ver.Projection, itoa(w.ver.Version), cat).Add(float64(n))
	}
	return nil
}

// ownSubjects checks that every item of a page is of the partition: a
// consumer whose filter was widened or switched in place (the credential
// that may create consumers may update them) delivers messages of other
// partitions, authentic and not this partition's.
func (w *partitionWorker) ownSubjects(items []*item) error {
	prefix := strings.TrimSuffix(w.filter, ">")
	for _, it := range items {
		if !strings.HasPrefix(it.subject, prefix) {
			return resetf("foreign_subject", "the consumer delivered %s (stream sequence %d), outside the partition's %s", it.subject, it.seq, w.filter)
		}
	}
	return nil
}

// verifiedPage verifies a page (verify.go). A gap or a refusal is
// believed only of a page that holds every message of the partition
// between its first and its last: a consumer whose filter was narrowed in
// place (the credential that may create consumers may update them) skips
// messages the stream still holds, which would otherwise be taken as
// removed.
func (w *partitionWorker) verifiedPage(ctx context.Context, fresh []*item) (*verdict, error) {
	vd, err := w.verifyPage(ctx, fresh)
	if err != nil {
		return nil, err
	}
	if len(vd.gaps) > 0 || refusedAny(fresh) {
		if err := w.checkContiguous(ctx, fresh); err != nil {
			return nil, err
		}
	}
	return vd, nil
}

// refusedAny tells whether verification refused any item of the page.
func refusedAny(items []*item) bool {
	for _, it := range items {
		if it.category != "" {
			return true
		}
	}
	return false
}

// checkContiguous checks that the stream holds no message of the partition
// between two consecutive items of the page (a reset when it does: the
// consumer did not deliver it).
func (w *partitionWorker) checkContiguous(ctx context.Context, items []*item) error {
	for i := 1; i < len(items); i++ {
		if items[i].seq == items[i-1].seq+1 {
			continue
		}
		raw, err := w.stream.GetMsg(ctx, items[i-1].seq+1, jetstream.WithGetMsgSubject(w.filter))
		if err != nil {
			return fmt.Errorf("check the page after stream sequence %d: %w", items[i-1].seq, err)
		}
		if raw.Sequence != items[i].seq {
			return resetf("page_hole", "the page skips stream sequence %d of the partition (between %d and %d): its consumer did not deliver it",
				raw.Sequence, items[i-1].seq, items[i].seq)
		}
	}
	return nil
}
