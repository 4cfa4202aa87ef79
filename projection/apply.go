package projection

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/lowgc"
	"github.com/epitaph-dev/epitaph/progress"
	"github.com/epitaph-dev/epitaph/projection/snapshot"
	"github.com/epitaph-dev/epitaph/quarantine"
)

// applyResult is what one applied page did.
type applyResult struct {
	pos         progress.Position
	applied     int
	quarantined map[string]int
	open        *openTx // the partition's transaction still open after the page
	// snapshotsPending counts the snapshot jobs the page left to the batcher.
	snapshotsPending int
}

// apply writes a page of one partition into version v's read model and
// advances the cursor in the same transaction. Events that cannot be
// applied (undecodable, a missing large row, rejected by Postgres) are
// quarantined in that transaction and the partition moves past them; the
// failing event is isolated with savepoints so the rest of the page applies.
// Transient failures return an error and nothing is committed. vd is the
// page's verification (trust.go): refused items carry their category
// already, rows of transactions not verified yet are inserted invisible.
func (s *Service) apply(ctx context.Context, v Version, l progress.Lease, pos progress.Position, items []*item, open *openTx, vd *verdict) (applyResult, error) {
	res := applyResult{quarantined: map[string]int{}}
	if vd == nil {
		vd = &verdict{trust: pos.Trust}
	}
	if s.handlers != nil {
		if err := s.handlers.Refresh(ctx); err != nil { // cheap: at most once a second
			return res, err
		}
	}
	// Large rows live in the object store: read them before the
	// transaction opens so it is never held across NATS round trips.
	var rows []*archiveRow
	for _, it := range append(vd.extraRows[:len(vd.extraRows):len(vd.extraRows)], items...) {
		if it.ev == nil || it.ev.Op != event.OpDelete || it.category != "" {
			continue
		}
		r := &archiveRow{item: it, ev: it.ev, row: it.ev.Row, pending: vd.pending[it]}
		if it.ev.RowRef != nil {
			if it.ev.RowRef.Size > stageRowsAbove {
				// Until the page is written: the row's chunks and copies are
				// collected as they fall (internal/lowgc).
				defer lowgc.Hold()()
			}
			b, err := s.fetchRow(ctx, it.ev.RowRef) // oversized.go: size limit
			if err != nil {
				cat, permanent := quarantine.Classify(err)
				if !permanent {
					return res, err
				}
				it.category, it.failure = string(cat), err
				continue
			}
			r.row = b
		}
		if d, ok := s.cfg.ttlFor(it.ev.QualifiedTable()); ok && !it.ev.CommitTime.IsZero() {
			t := it.ev.CommitTime.Add(d)
			r.expiresAt = &t
		}
		rows = append(rows, r)
	}

	next := pos
	next.Trust = vd.trust
	var commits []*item
	for _, it := range items {
		it.after = next.SourceLSN
		next.Cursor, next.MsgID, next.Seq = it.seq, it.id, -1
		if it.ev == nil || it.category == CategoryUnauthenticated {
			continue // undecodable or not authentic: keep the last known source position
		}
		next.CommitLSN = positionLSN(it.ev)
		switch it.ev.Op {
		case event.OpDelete:
			next.Seq = it.ev.Seq
		case event.OpCommit:
			commits = append(commits, it)
			next.SourceLSN = max(next.SourceLSN, it.ev.CommitLSN)
			next.SourceTime = laterTime(next.SourceTime, it.ev.CommitTime)
		case event.OpMark:
			next.SourceLSN = max(next.SourceLSN, it.ev.LSN)
			next.SourceTime = laterTime(next.SourceTime, it.ev.Time)
		case event.OpTruncate:
			s.log.Warn("source table was TRUNCATEd: its rows are not in the WAL and were NOT archived",
				"table", it.ev.QualifiedTable(), "commit_lsn", it.ev.CommitLSN.String(), "version", v.Version)
		case event.OpGap:
			if it.ev.Table != "" {
				// A table the capture took out of its publication (it lost
				// its replica identity): its deletes from here on are missed.
				s.log.Error("deletes of a table are lost upstream (the capture stopped publishing it): the archive misses them from this position",
					"table", it.ev.QualifiedTable(), "from_lsn", it.ev.FromLSN.String(), "reason", it.ev.Reason, "version", v.Version)
			} else {
				s.log.Error("deletes were lost upstream (replication slot dropped or invalidated): the archive misses this range",
					"from_lsn", it.ev.FromLSN.String(), "to_lsn", it.ev.ToLSN.String(), "reason", it.ev.Reason, "version", v.Version)
			}
			next.SourceLSN = max(next.SourceLSN, it.ev.ToLSN)
			next.SourceTime = laterTime(next.SourceTime, it.ev.Time)
		}
	}

	// Transactions complete in this page get their roots computed here and
	// inserted with the rows (no second write); the others are marked in
	// SQL when their commit is applied.
	inPage := rootsInPage(rows, commits)
	// Rows of transactions spanning pages: decide what is certain now, the
	// rest at their commit.
	before := open
	after := decideEarly(rows, inPage, open)
	continuing := map[event.LSN]*openTx{}
	if before != nil {
		continuing[before.lsn] = before
	}
	if after != nil {
		continuing[after.lsn] = after
	}

	var err error
	careful := false
	res, err = s.applyTx(ctx, v, l, pos, next, items, rows, commits, inPage, continuing, vd, careful)
	for errors.Is(err, errCareful) || errors.Is(err, errFencesChanged) {
		// Something in the page is rejected: apply again, isolating it
		// (again when hold mode holds more rows behind it: hold.go). Or
		// an erasure was recorded meanwhile: apply again with its fence.
		careful = careful || errors.Is(err, errCareful)
		res, err = s.applyTx(ctx, v, l, pos, next, items, rows, commits, inPage, continuing, vd, careful)
	}
	if err == nil {
		res.open = after
		for _, c := range commits {
			if after != nil && c.ev.CommitLSN == after.lsn {
				res.open = nil
			}
		}
	}
	return res, err
}

func laterTime(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// gapOf is the gap row an applied gap or truncate event records. A gap
// event is published to every partition and concerns them all (partition
// NULL, recorded once); a truncate is its partition's.
func gapOf(e *event.Event, partition int) Gap {
	g := Gap{Kind: e.GapKind()}
	if e.Schema != "" {
		g.Schema, g.Table = &e.Schema, &e.Table
	}
	if e.Op == event.OpTruncate {
		g.Kind, g.Partition = event.GapTruncate, &partition
		g.FromLSN, g.ToLSN = &e.CommitLSN, &e.CommitLSN
		return g
	}
	g.FromLSN, g.ToLSN = &e.FromLSN, &e.ToLSN
	return g
}

// errCareful says a page failed permanently without savepoints and must be
// applied again with isolation.
var errCareful = errors.New("page needs isolation")

func (s *Service) applyTx(ctx context.Context, v Version, l progress.Lease, pos, next progress.Position, items []*item,
	rows []*archiveRow, commits []*item, inPage map[event.LSN]bool, open map[event.LSN]*openTx, vd *verdict, careful bool) (applyResult, error) {
	res := applyResult{quarantined: map[string]int{}}
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return res, fmt.Errorf("begin apply: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx))

	quarantineItem := func(it *item) error {
		err := quarantine.Insert(ctx, tx, quarantine.Entry{
			Projection: v.Projection, Version: v.Version, Partition: l.Partition,
			StreamSeq: it.seq, Subject: it.subject, Headers: it.headers, Data: it.data,
			Category: it.category, Error: quarantine.Sanitize(it.failure), After: it.after,
		})
		if err != nil {
			return err
		}
		res.quarantined[it.category]++
		s.log.Warn("event quarantined", "projection", v.Projection, "version", v.Version, "partition", l.Partition,
			"stream_seq", it.seq, "category", it.category, "err", quarantine.Sanitize(it.failure))
		return nil
	}

	// Verification's decisions about earlier pages and its gaps (trust.go).
	if err := s.applyVerdict(ctx, tx, v, l, vd); err != nil {
		return res, err
	}
	for _, it := range vd.extraQuar {
		res.quarantined[it.category]++
	}
	// Hold mode (hold.go): rows waiting behind a quarantined one are left out.
	hold, ins, err := s.holdBefore(ctx, tx, v, items, rows)
	if err != nil {
		return res, err
	}
	// Erased rows are never archived again (fence.go): the page is
	// filtered by the fences of erasure counter "fenced"; an insert that
	// reads another counter makes it apply again.
	var fenced int64
	if ins, fenced, err = s.unfenced(ctx, v, ins); err != nil {
		return res, err
	}
	seen := fenced
	// Rows, set-based; a rejected row is isolated by bisection.
	archived := map[string]insertedTx{} // what this transaction archived, per source transaction
	err = isolate(ctx, tx, careful, ins, func(sp pgx.Tx, part []*archiveRow) error {
		inserted, epoch, err := insertRowsCounted(ctx, sp, v.Schema, part)
		if err == nil && epoch != fenced {
			seen = epoch
		}
		if err != nil || len(inserted) == 0 {
			return err
		}
		if s.extraDDL != nil {
			// Rows arriving for a transaction whose snapshot jobs exist (a
			// replayed or re-published event): rebuild those snapshots.
			ids := make([]string, len(inserted))
			for i, t := range inserted {
				ids[i] = t.correlationID
			}
			if _, err := snapshot.Invalidate(ctx, sp, v.Schema, ids); err != nil {
				return err
			}
		}
		for _, t := range inserted {
			a := archived[t.correlationID]
			a.rows, a.archivedAt = a.rows+t.rows, t.archivedAt
			archived[t.correlationID] = a
		}
		return nil
	}, func(r *archiveRow, err error) error {
		cat, _ := quarantine.Classify(err)
		r.item.category, r.item.failure = string(cat), err
		return nil
	})
	if err == nil && seen != fenced {
		s.fences.saw(seen)
		err = errFencesChanged
	}
	if err == nil {
		err = hold.holdAfter(items)
	}
	if err != nil {
		return res, err
	}
	// A row of a transaction complete in this page was rejected: its
	// roots are recomputed in SQL from what is archived.
	full := map[event.LSN]bool{}
	for _, r := range rows {
		if r.item.category == "" {
			continue
		}
		inPage[r.ev.CommitLSN] = false
		full[r.ev.CommitLSN] = true
		if o := open[r.ev.CommitLSN]; o != nil {
			o.full = true
		}
	}
	// Commits complete their transactions: roots, then snapshot jobs.
	err = isolate(ctx, tx, careful, commits, func(sp pgx.Tx, part []*item) error {
		var undecided, all []event.LSN
		for _, c := range part {
			lsn := c.ev.CommitLSN
			switch o := open[lsn]; {
			case inPage[lsn]:
			case full[lsn] || o == nil || o.full:
				// Started before this worker saw it, or a row of it was
				// quarantined: decide every row again.
				all = append(all, lsn)
			default:
				undecided = append(undecided, lsn)
			}
		}
		if err := markRoots(ctx, sp, v.Schema, s.cfg.SourceName, all, false); err != nil {
			return err
		}
		if err := markRoots(ctx, sp, v.Schema, s.cfg.SourceName, undecided, true); err != nil {
			return err
		}
		pending, err := s.snapshotJobs(ctx, sp, v, part, rows, inPage, archived)
		if err == nil {
			res.snapshotsPending += pending
		}
		return err
	}, func(c *item, err error) error {
		cat, _ := quarantine.Classify(err)
		c.category, c.failure = string(cat), err
		return nil
	})
	if err != nil {
		return res, err
	}
	// Gaps and truncates are recorded for readers (archive.gaps) in this
	// transaction: the partition is never seen past one without it.
	// A truncate of a transaction not verified yet (its commit is in a later
	// page) may be a forgery (trust.go): it waits in pending_truncates and
	// becomes a gap row when its commit verifies (applyVerdict).
	var gaps []*item
	for _, it := range append(vd.extraRows[:len(vd.extraRows):len(vd.extraRows)], items...) {
		if it.ev == nil || it.category != "" || (it.ev.Op != event.OpGap && it.ev.Op != event.OpTruncate) {
			continue
		}
		if vd.pending[it] {
			if err := stagePendingTruncate(ctx, tx, v.Schema, l.Partition, it.ev); err != nil {
				return res, err
			}
			continue
		}
		gaps = append(gaps, it)
	}
	err = isolate(ctx, tx, careful, gaps, func(sp pgx.Tx, part []*item) error {
		for _, it := range part {
			if err := insertGap(ctx, sp, v.Schema, gapOf(it.ev, l.Partition)); err != nil {
				return err
			}
		}
		return nil
	}, func(it *item, err error) error {
		cat, _ := quarantine.Classify(err)
		it.category, it.failure = string(cat), err
		return nil
	})
	if err != nil {
		return res, err
	}
	if err := s.queueDeliveries(ctx, tx, v, rows, commits, inPage, vd); err != nil {
		return res, err
	}
	for _, it := range items {
		if it.category != "" {
			if err := quarantineItem(it); err != nil {
				return res, err
			}
			continue
		}
		if it.ev != nil {
			res.applied++
		}
	}
	if err := progress.Advance(ctx, tx, l, pos.Cursor, next, s.cfg.LeaseTTL); err != nil {
		return res, err
	}
	if err := tx.Commit(ctx); err != nil {
		return res, fmt.Errorf("commit apply: %w", err)
	}
	if res.snapshotsPending > 0 && s.batcher != nil {
		s.batcher.Wake()
	}
	res.pos = next
	return res, nil
}

// isolate runs fn on all of xs in a savepoint; when that fails permanently
// it bisects, so that only the events that fail on their own are handed to
// bad (and the rest are applied). Transient errors are returned at once.
func isolate[T any](ctx context.Context, tx pgx.Tx, careful bool, xs []T, fn func(pgx.Tx, []T) error, bad func(T, error) error) error {
	if len(xs) == 0 {
		return nil
	}
	if !careful {
		// Optimistic: no savepoint round trips; a permanent failure makes
		// the caller redo the page carefully.
		err := fn(tx, xs)
		if _, permanent := quarantine.Classify(err); err != nil && permanent {
			return fmt.Errorf("%w: %w", errCareful, err)
		}
		return err
	}
	sp, err := tx.Begin(ctx)
	if err != nil {
		return fmt.Errorf("savepoint: %w", err)
	}
	err = fn(sp, xs)
	if err == nil {
		return sp.Commit(ctx)
	}
	if rbErr := sp.Rollback(ctx); rbErr != nil {
		return fmt.Errorf("rollback savepoint: %w (after %w)", rbErr, err)
	}
	if _, permanent := quarantine.Classify(err); !permanent {
		return err
	}
	if len(xs) == 1 {
		return bad(xs[0], err)
	}
	mid := len(xs) / 2
	if err := isolate(ctx, tx, true, xs[:mid], fn, bad); err != nil {
		return err
	}
	return isolate(ctx, tx, true, xs[mid:], fn, bad)
}

// objectReader reads large rows from JetStream object stores, keeping the
// bucket handles.
type objectReader struct {
	js     jetstream.JetStream
	mu     sync.Mutex
	stores map[string]jetstream.ObjectStore
}

func newObjectReader(js jetstream.JetStream) *objectReader {
	return &objectReader{js: js, stores: map[string]jetstream.ObjectStore{}}
}

// fetch reads a large row from the object store and checks it.
// A missing bucket or object, a digest mismatch or a body that is not a
// JSON object are permanent (missing_payload); anything else is transient.
func (o *objectReader) fetch(ctx context.Context, ref *event.ObjectRef) ([]byte, error) {
	if o.js == nil {
		return nil, fmt.Errorf("read object %s/%s: no JetStream connection", ref.Bucket, ref.Name)
	}
	o.mu.Lock()
	obs, ok := o.stores[ref.Bucket]
	o.mu.Unlock()
	if !ok {
		var err error
		obs, err = o.js.ObjectStore(ctx, ref.Bucket)
		if errors.Is(err, jetstream.ErrBucketNotFound) || errors.Is(err, jetstream.ErrStreamNotFound) {
			return nil, quarantine.Permanent(quarantine.CategoryMissingPayload, fmt.Errorf("object bucket %q not found", ref.Bucket))
		}
		if err != nil {
			return nil, fmt.Errorf("open object bucket %q: %w", ref.Bucket, err)
		}
		o.mu.Lock()
		o.stores[ref.Bucket] = obs
		o.mu.Unlock()
	}
	c, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	b, err := readObject(c, obs, ref)
	switch {
	case errors.Is(err, jetstream.ErrObjectNotFound):
		return nil, quarantine.Permanent(quarantine.CategoryMissingPayload, fmt.Errorf("object %s/%s not found", ref.Bucket, ref.Name))
	case errors.Is(err, jetstream.ErrDigestMismatch):
		return nil, quarantine.Permanent(quarantine.CategoryMissingPayload, fmt.Errorf("object %s/%s is corrupt (digest mismatch)", ref.Bucket, ref.Name))
	case err != nil:
		return nil, fmt.Errorf("read object %s/%s: %w", ref.Bucket, ref.Name, err)
	}
	if ref.SHA256 != "" {
		sum := sha256.Sum256(b) // over the one copy read: no second buffer
		if hex.EncodeToString(sum[:]) != ref.SHA256 {
			return nil, quarantine.Permanent(quarantine.CategoryMissingPayload, fmt.Errorf("object %s/%s: sha256 does not match the event", ref.Bucket, ref.Name))
		}
	}
	if t := bytes.TrimSpace(b); len(t) == 0 || t[0] != '{' {
		return nil, quarantine.Permanent(quarantine.CategoryMissingPayload, fmt.Errorf("object %s/%s is not a JSON object", ref.Bucket, ref.Name))
	}
	return b, nil
}

// readObject reads an object into one buffer of the size the event states
// (the object store's own chunk digest is checked at its end), instead of
// a buffer doubling as it grows: a row of S bytes costs S here, plus the
// chunks in flight. An object of another size than the event's is corrupt.
func readObject(ctx context.Context, obs jetstream.ObjectStore, ref *event.ObjectRef) ([]byte, error) {
	res, err := obs.Get(ctx, ref.Name)
	if err != nil {
		return nil, err
	}
	defer res.Close()
	if ref.Size < 0 { // the size limit was checked before (fetchLimited)
		return nil, quarantine.Permanent(quarantine.CategoryMissingPayload, fmt.Errorf("object %s/%s: size %d in the event", ref.Bucket, ref.Name, ref.Size))
	}
	b := make([]byte, ref.Size)
	if _, err := io.ReadFull(res, b); err != nil {
		if errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) {
			return nil, quarantine.Permanent(quarantine.CategoryMissingPayload, fmt.Errorf("object %s/%s is shorter than the event's %d bytes", ref.Bucket, ref.Name, ref.Size))
		}
		return nil, err
	}
	// The end: the store checks its digest of the chunks here, and an
	// object longer than the event says is corrupt.
	var one [1]byte
	switch n, err := res.Read(one[:]); {
	case n > 0:
		return nil, quarantine.Permanent(quarantine.CategoryMissingPayload, fmt.Errorf("object %s/%s is longer than the event's %d bytes", ref.Bucket, ref.Name, ref.Size))
	case err != nil && !errors.Is(err, io.EOF):
		return nil, err
	}
	return b, nil
}
