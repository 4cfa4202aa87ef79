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
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/erasure"
	"github.com/epitaph-dev/epitaph/projection/snapshot"
	"github.com/epitaph-dev/epitaph/projection/trust"
	"github.com/epitaph-dev/epitaph/projection/version"
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
// page's verification (verify.go): refused items carry their category
// already, rows of transactions not verified yet are inserted invisible.
func (s *Service) apply(ctx context.Context, in applyParams) (applyResult, error) {
	v, l, pos, items, open, vd := in.v, in.l, in.pos, in.items, in.open, in.vd
	if vd == nil {
		vd = &verdict{trust: pos.Trust}
	}
	if s.handlers != nil {
		if err := s.handlers.Refresh(ctx); err != nil { // cheap: at most once a second
			return applyResult{quarantined: map[string]int{}}, err
		}
	}
	rows, err := s.pageRows(ctx, items, vd)
	if err != nil {
		return applyResult{quarantined: map[string]int{}}, err
	}
	s.ensurePartitions(ctx, v, rows)
	p := &applyPlan{v: v, l: l, pos: pos, items: items, rows: rows, vd: vd}
	p.next, p.commits = s.advance(v, pos, vd, items)
	// Transactions complete in this page get their roots computed here and
	// inserted with the rows (no second write); the others are marked in
	// SQL when their commit is applied.
	p.inPage = rootsInPage(rows, p.commits)
	// Rows of transactions spanning pages: decide what is certain now, the
	// rest at their commit.
	after := decideEarly(rows, p.inPage, open)
	p.open = map[event.LSN]*openTx{}
	if open != nil {
		p.open[open.lsn] = open
	}
	if after != nil {
		p.open[after.lsn] = after
	}

	careful := false
	res, err := s.applyTx(ctx, p, careful)
	for errors.Is(err, errCareful) || errors.Is(err, erasure.ErrFencesChanged) {
		// Something in the page is rejected: apply again, isolating it
		// (again when hold mode holds more rows behind it: holdonquarantine.go). Or
		// an erasure was recorded meanwhile: apply again with its fence.
		careful = careful || errors.Is(err, errCareful)
		res, err = s.applyTx(ctx, p, careful)
	}
	if err == nil {
		res.open = after
		for _, c := range p.commits {
			if after != nil && c.ev.CommitLSN == after.lsn {
				res.open = nil
			}
		}
	}
	return res, err
}

// applyParams is a page of one partition as its worker hands it to apply.
type applyParams struct {
	v     version.Version
	l     progress.Lease
	pos   progress.Position // the cursor before the page
	items []*item
	open  *openTx  // the partition's transaction open before the page, if any
	vd    *verdict // the page's verification; nil: a verdict from pos.Trust alone
}

// applyPlan is one page of a partition on the apply path, prepared once by
// apply (or by a replay: replay.go) and written by applyPage, again with
// isolation when something in it is rejected.
type applyPlan struct {
	v         version.Version
	l         progress.Lease
	pos, next progress.Position // the cursor before and after the page
	items     []*item
	rows      []*archiveRow // the delete events to archive, large rows read
	commits   []*item
	// inPage: transactions whose roots were computed in memory (a rejected
	// row turns its transaction's entry false); open: the transactions
	// spanning pages, before and after this one.
	inPage map[event.LSN]bool
	open   map[event.LSN]*openTx
	vd     *verdict
	// fenced: the transactions of which this attempt left rows out
	// (erasure fences): their documents are assembled from the archive.
	fenced map[event.LSN]bool
}

// pageRows are the page's delete events to archive (with the rows of
// earlier pages verification chose: vd.extraRows). Large rows live in the
// object store: they are read here, before the transaction opens, so it is
// never held across NATS round trips; one that cannot be read for good
// quarantines its event.
func (s *Service) pageRows(ctx context.Context, items []*item, vd *verdict) ([]*archiveRow, error) {
	var rows []*archiveRow
	for _, it := range append(vd.extraRows[:len(vd.extraRows):len(vd.extraRows)], items...) {
		if it.ev == nil || it.ev.Op != event.OpDelete || it.category != "" || it.replay {
			continue
		}
		r := &archiveRow{item: it, ev: it.ev, row: it.ev.Row, pending: vd.pending[it]}
		if it.ev.RowRef != nil {
			if it.ev.RowRef.Size > archive.StageRowsAbove {
				// Until the page is written: the row's chunks and copies are
				// collected as they fall (internal/lowgc).
				defer lowgc.Hold()()
			}
			b, err := s.fetchRow(ctx, it.ev.RowRef) // oversized.go: size limit
			if err != nil {
				cat, permanent := quarantine.Classify(err)
				if !permanent {
					return nil, err
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
	return rows, nil
}

// advance returns the partition's position after the page and the page's
// commits; it logs what the archive will miss (truncates, gaps).
func (s *Service) advance(v version.Version, pos progress.Position, vd *verdict, items []*item) (progress.Position, []*item) {
	next := pos
	next.Trust = vd.trust
	var commits []*item
	for _, it := range items {
		it.after = next.SourceLSN
		next.Cursor, next.MsgID, next.Seq = it.seq, it.id, -1
		if it.ev == nil || it.category == trust.CategoryUnauthenticated || it.replay {
			continue // undecodable, not authentic or a replay: keep the last known source position
		}
		next.CommitLSN = version.PositionLSN(it.ev)
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
			s.logGap(v, it.ev)
			next.SourceLSN = max(next.SourceLSN, it.ev.ToLSN)
			next.SourceTime = laterTime(next.SourceTime, it.ev.Time)
		}
	}
	return next, commits
}

func (s *Service) logGap(v version.Version, e *event.Event) {
	if e.Table != "" {
		// A table the capture took out of its publication (it lost
		// its replica identity): its deletes from here on are missed.
		s.log.Error("deletes of a table are lost upstream (the capture stopped publishing it): the archive misses them from this position",
			"table", e.QualifiedTable(), "from_lsn", e.FromLSN.String(), "reason", e.Reason, "version", v.Version)
		return
	}
	s.log.Error("deletes were lost upstream (replication slot dropped or invalidated): the archive misses this range",
		"from_lsn", e.FromLSN.String(), "to_lsn", e.ToLSN.String(), "reason", e.Reason, "version", v.Version)
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
func gapOf(e *event.Event, partition int) archive.Gap {
	g := archive.Gap{Kind: e.GapKind()}
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

// applyTx applies page p in one transaction of its own: the page's writes
// (applyPage), its quarantined events, the cursor; then builds the documents
// of the transactions the page completed that it left to the batcher
// (snapshotsCommitted).
func (s *Service) applyTx(ctx context.Context, p *applyPlan, careful bool) (applyResult, error) {
	res := applyResult{quarantined: map[string]int{}}
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return res, fmt.Errorf("begin apply: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx))

	if res.snapshotsPending, err = s.applyPage(ctx, tx, p, careful); err != nil {
		return res, err
	}
	for _, it := range p.vd.extraQuar {
		res.quarantined[it.category]++ // inserted by applyVerdict
	}
	for _, it := range p.items {
		if it.category != "" {
			if err := s.quarantineItem(ctx, tx, p, it); err != nil {
				return res, err
			}
			res.quarantined[it.category]++
			continue
		}
		if it.ev != nil && !it.replay {
			res.applied++
		}
	}
	if err := progress.Advance(ctx, tx, p.l, p.pos.Cursor, p.next, s.cfg.LeaseTTL); err != nil {
		return res, err
	}
	if err := tx.Commit(ctx); err != nil {
		return res, fmt.Errorf("commit apply: %w", err)
	}
	if f := s.archived.Load(); f != nil && p.v.Projection == archive.Projection {
		(*f)()
	}
	if res.snapshotsPending > 0 && s.batcher != nil {
		s.snapshotsCommitted(ctx, p.v, p.commits, res.snapshotsPending)
	}
	res.pos = p.next
	return res, nil
}

func (s *Service) quarantineItem(ctx context.Context, tx pgx.Tx, p *applyPlan, it *item) error {
	err := quarantine.Insert(ctx, tx, quarantine.Entry{
		Projection: p.v.Projection, Version: p.v.Version, Partition: p.l.Partition,
		StreamSeq: it.seq, Subject: it.subject, Headers: it.headers, Data: it.data,
		Category: it.category, Error: quarantine.Sanitize(it.failure), After: it.after,
	})
	if err != nil {
		return err
	}
	s.log.Warn("event quarantined", "projection", p.v.Projection, "version", p.v.Version, "partition", p.l.Partition,
		"stream_seq", it.seq, "category", it.category, "err", quarantine.Sanitize(it.failure))
	return nil
}

// applyPage is the apply path proper, the runtime's and a replay's: it
// writes page p into tx — verification's decisions, the rows (hold mode,
// erasure fences), the commits (roots, snapshot jobs), gaps and truncates,
// the row handlers' deliveries — and sets a category on every event it
// rejects (the caller quarantines them). It returns the number of snapshot
// jobs left to the batcher. Careful isolates rejected events with
// savepoints; without it a rejection returns errCareful.
func (s *Service) applyPage(ctx context.Context, tx pgx.Tx, p *applyPlan, careful bool) (int, error) {
	// Verification's decisions about earlier pages and its gaps (verify.go).
	if err := s.applyVerdict(ctx, tx, p.v, p.l, p.vd); err != nil {
		return 0, err
	}
	// Hold mode (holdonquarantine.go): rows waiting behind a quarantined one are left out.
	hold, ins, err := s.holdBefore(ctx, tx, p.v, p.items, p.rows)
	if err != nil {
		return 0, err
	}
	archived, ins, err := s.archiveRows(ctx, tx, p, ins, careful)
	if err == nil {
		err = hold.holdAfter(p.items)
	}
	if err != nil {
		return 0, err
	}
	pending, err := s.applyCommits(ctx, tx, p, archived, careful)
	if err != nil {
		return 0, err
	}
	if err := s.applyGaps(ctx, tx, p, careful); err != nil {
		return 0, err
	}
	// Deliveries of the rows archived (an erased row gets none: its image
	// would be stored again in the delivery's payload).
	if err := s.queueDeliveries(ctx, tx, p, ins); err != nil {
		return 0, err
	}
	return pending, nil
}

// archiveRows inserts the rows ins, set-based; a rejected row is isolated
// by bisection. Erased rows are never archived again (package erasure's fences): the rows
// are filtered by the fences of erasure counter "fenced"; an insert that
// reads another counter returns erasure.ErrFencesChanged (apply again). It returns
// what it archived per source transaction, and the rows it tried (ins
// without the fenced ones; the rejected ones have their category).
func (s *Service) archiveRows(ctx context.Context, tx pgx.Tx, p *applyPlan, ins []*archiveRow, careful bool) (map[string]archive.Inserted, []*archiveRow, error) {
	ins, fenced, left, err := s.unfenced(ctx, tx, p.v, ins)
	if err != nil {
		return nil, nil, err
	}
	p.fenced = left
	seen := fenced
	archived := map[string]archive.Inserted{} // what this transaction archived, per source transaction
	err = isolate(ctx, tx, careful, ins, func(sp pgx.Tx, part []*archiveRow) error {
		inserted, epoch, err := insertRowsCounted(ctx, sp, p.v.Schema, part)
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
				ids[i] = t.CorrelationID
			}
			if _, err := snapshot.Invalidate(ctx, sp, p.v.Schema, ids); err != nil {
				return err
			}
		}
		for _, t := range inserted {
			a := archived[t.CorrelationID]
			a.Rows, a.ArchivedAt = a.Rows+t.Rows, t.ArchivedAt
			archived[t.CorrelationID] = a
		}
		return nil
	}, rejectRow)
	if err == nil && seen != fenced {
		s.fences.Saw(seen)
		err = erasure.ErrFencesChanged
	}
	return archived, ins, err
}

func rejectRow(r *archiveRow, err error) error {
	reject(r.item, err)
	return nil
}

func rejectItem(it *item, err error) error {
	reject(it, err)
	return nil
}

func reject(it *item, err error) {
	cat, _ := quarantine.Classify(err)
	it.category, it.failure = string(cat), err
}

// applyCommits completes the page's transactions at their commits: roots,
// then snapshot jobs. A row of a transaction complete in this page that was
// rejected has its transaction's roots recomputed in SQL from what is
// archived. It returns the number of snapshot jobs left to the batcher.
func (s *Service) applyCommits(ctx context.Context, tx pgx.Tx, p *applyPlan, archived map[string]archive.Inserted, careful bool) (int, error) {
	full := map[event.LSN]bool{}
	for _, r := range p.rows {
		if r.item.category == "" {
			continue
		}
		p.inPage[r.ev.CommitLSN] = false
		full[r.ev.CommitLSN] = true
		if o := p.open[r.ev.CommitLSN]; o != nil {
			o.full = true
		}
	}
	pending := 0
	err := isolate(ctx, tx, careful, p.commits, func(sp pgx.Tx, part []*item) error {
		var undecided, all []event.LSN
		for _, c := range part {
			lsn := c.ev.CommitLSN
			switch o := p.open[lsn]; {
			case p.inPage[lsn]:
			case full[lsn] || o == nil || o.full:
				// Started before this worker saw it, or a row of it was
				// quarantined: decide every row again.
				all = append(all, lsn)
			default:
				undecided = append(undecided, lsn)
			}
		}
		if err := markRoots(ctx, sp, p.v.Schema, s.cfg.SourceName, all, false); err != nil {
			return err
		}
		if err := markRoots(ctx, sp, p.v.Schema, s.cfg.SourceName, undecided, true); err != nil {
			return err
		}
		n, err := s.snapshotJobs(ctx, sp, p, part, archived)
		if err == nil {
			pending += n
		}
		return err
	}, rejectItem)
	return pending, err
}

// applyGaps records the page's gaps and truncates for readers
// (archive.gaps) in this transaction: the partition is never seen past one
// without it. A truncate of a transaction not verified yet (its commit is
// in a later page) may be a forgery (verify.go): it waits in
// pending_truncates and becomes a gap row when its commit verifies
// (applyVerdict).
func (s *Service) applyGaps(ctx context.Context, tx pgx.Tx, p *applyPlan, careful bool) error {
	var gaps []*item
	for _, it := range append(p.vd.extraRows[:len(p.vd.extraRows):len(p.vd.extraRows)], p.items...) {
		if it.ev == nil || it.category != "" || it.replay || (it.ev.Op != event.OpGap && it.ev.Op != event.OpTruncate) {
			continue // a replay's truncate was recorded with the transaction it copies
		}
		if p.vd.pending[it] {
			if err := stagePendingTruncate(ctx, tx, p.v.Schema, p.l.Partition, it.ev); err != nil {
				return err
			}
			continue
		}
		gaps = append(gaps, it)
	}
	return isolate(ctx, tx, careful, gaps, func(sp pgx.Tx, part []*item) error {
		for _, it := range part {
			if err := archive.InsertGap(ctx, sp, p.v.Schema, gapOf(it.ev, p.l.Partition)); err != nil {
				return err
			}
		}
		return nil
	}, rejectItem)
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
