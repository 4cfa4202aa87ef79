package projection

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/progress"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/erasure"
	"github.com/epitaph-dev/epitaph/projection/retention"
	"github.com/epitaph-dev/epitaph/projection/trust"
	"github.com/epitaph-dev/epitaph/projection/version"
	"github.com/epitaph-dev/epitaph/quarantine"
)

// ReplayConfig configures ReplayFunc.
type ReplayConfig struct {
	// Decoder decodes the quarantined bytes; nil = the default v1 decoder.
	// Teach it a new wire version through its Upgraders.
	Decoder *event.Decoder
	// ArchiveTTL and SnapshotRoots as in Config.
	ArchiveTTL    map[string]time.Duration
	SnapshotRoots []string
	// JetStream reads large rows (row_ref); nil makes such events fail
	// (they stay in quarantine).
	JetStream jetstream.JetStream
	// MaxRowBytes as in Config: a larger row stays quarantined (oversized).
	MaxRowBytes int64
	// Logger; nil = slog.Default().
	Logger *slog.Logger
}

// ReplayFunc returns the quarantine.ApplyFunc that applies a quarantined
// event, decoded with the current code, to the read model of its version,
// in the replay's transaction, through the runtime's apply path (applyPage,
// apply.go) — exactly what the runtime would have done, as a page of one
// event: a row is archived (idempotently; not when an erasure fences it;
// the snapshots of its transaction are rebuilt), a commit marks its
// transaction's roots, creates its snapshot jobs and releases its rows'
// deliveries, a gap or truncate is recorded; the row handlers' deliveries
// are queued as for a live page. Two things differ, because the event is
// applied after its neighbours: a row whose transaction's commit was
// applied already has its transaction's roots recomputed and its delivery
// released (as its commit would have), and hold mode is not applied
// (quarantine.Replay keeps the order of held entries). An event that still
// cannot be applied returns its permanent error (its category), and the
// replay's transaction is not written to.
func ReplayFunc(cfg ReplayConfig) quarantine.ApplyFunc {
	r := &replayer{cfg: cfg, dec: cfg.Decoder, objects: newObjectReader(cfg.JetStream),
		retention: retention.NewMetrics(prometheus.NewRegistry()), log: cfg.Logger}
	if r.dec == nil {
		r.dec = &event.Decoder{}
	}
	if r.log == nil {
		r.log = slog.Default()
	}
	r.extraDDL = snapshotHooks()
	return r.apply
}

// replayer holds what a ReplayFunc keeps between entries.
type replayer struct {
	cfg       ReplayConfig
	dec       *event.Decoder
	objects   *objectReader
	retention *retention.Metrics
	log       *slog.Logger
	extraDDL  func(schema string) string
}

func (r *replayer) apply(ctx context.Context, tx pgx.Tx, e quarantine.Entry) error {
	if e.Projection != archive.Projection {
		return fmt.Errorf("replay: projection %q is not known to this projector", e.Projection)
	}
	v := version.Version{Projection: e.Projection, Version: e.Version}
	err := tx.QueryRow(ctx, `SELECT schema_name FROM epitaph.projection_versions WHERE projection = $1 AND version = $2`,
		e.Projection, e.Version).Scan(&v.Schema)
	if err != nil {
		return fmt.Errorf("replay: version %d of %s: %w", e.Version, e.Projection, err)
	}
	if e.Category == trust.CategoryUnauthenticated {
		// Replaying one message alone would skip its verification.
		return quarantine.Permanent(quarantine.CategoryUnauthenticated, fmt.Errorf("not replayed: it failed verification (trust.go); "+
			"if its key is trusted now (projector trust-key), rebuild the version, which verifies the stream again; else discard it"))
	}
	ev, err := r.dec.Decode(e.Data)
	if err != nil {
		return err
	}
	if err := verifyBoundary(ctx, tx, e, ev); err != nil {
		return err
	}
	if err := notYetVerified(ctx, tx, v, e, ev); err != nil {
		return err
	}
	it := &item{seq: e.StreamSeq, subject: e.Subject, headers: e.Headers, data: e.Data, ev: ev, after: e.After}
	for {
		// An erasure recorded meanwhile (erasure.ErrFencesChanged): apply again,
		// with its fence, as the runtime does.
		sp, err := tx.Begin(ctx)
		if err != nil {
			return fmt.Errorf("replay: savepoint: %w", err)
		}
		err = r.applyOne(ctx, sp, v, e.Partition, it)
		if err == nil {
			return sp.Commit(ctx)
		}
		if rbErr := sp.Rollback(ctx); rbErr != nil {
			return fmt.Errorf("replay: rollback savepoint: %w (after %w)", rbErr, err)
		}
		if !errors.Is(err, erasure.ErrFencesChanged) {
			return err
		}
		it.category, it.failure = "", nil
	}
}

// applyOne applies the event of it as a page of its own, in tx.
func (r *replayer) applyOne(ctx context.Context, tx pgx.Tx, v version.Version, partition int, it *item) error {
	ev := it.ev
	s, err := r.service(ctx, tx, ev.Source)
	if err != nil {
		return err
	}
	vd := &verdict{pending: map[*item]bool{}}
	p := &applyPlan{v: v, l: progress.Lease{Key: progress.Key{Projection: v.Projection, Version: v.Version, Partition: partition}}, items: []*item{it}, vd: vd, open: map[event.LSN]*openTx{},
		// The partition went on without the event: its row is behind
		// the watermark, and a cursor handler's cursor may be past it.
		pos: progress.Position{SourceLSN: event.LSN(math.MaxUint64)}}
	if p.rows, err = s.pageRows(ctx, p.items, vd); err != nil {
		return err
	}
	if it.category != "" {
		return it.failure
	}
	var committed bool
	switch ev.Op {
	case event.OpCommit:
		p.commits = []*item{it}
	case event.OpDelete:
		if committed, err = transactionCommitted(ctx, tx, v.Schema, ev); err != nil {
			return err
		}
		if committed {
			// Its commit was applied before it: its deliveries are
			// released now, as that commit would have (applyVerdict and
			// queueDeliveries treat it as verified late).
			vd.promote = []event.LSN{ev.CommitLSN}
		}
	}
	p.inPage = rootsInPage(p.rows, p.commits)
	decideEarly(p.rows, p.inPage, nil)
	if _, err := s.applyPage(ctx, tx, p, true); err != nil {
		return err
	}
	if it.category != "" {
		return it.failure
	}
	if committed {
		// Its transaction's roots are decided again with it.
		return markRoots(ctx, tx, v.Schema, ev.Source, []event.LSN{ev.CommitLSN}, false)
	}
	return nil
}

// service is the apply path's collaborators for one replayed event: its
// source, the configuration of the replay, the row handlers and the erasure
// fences as of tx.
func (r *replayer) service(ctx context.Context, tx pgx.Tx, source string) (*Service, error) {
	s := &Service{
		cfg: Config{SourceName: source, ArchiveTTL: r.cfg.ArchiveTTL, SnapshotRoots: r.cfg.SnapshotRoots, MaxRowBytes: r.cfg.MaxRowBytes},
		log: r.log, objects: r.objects, retention: r.retention, extraDDL: r.extraDDL,
		fences: &erasure.FenceSet{}, handlers: handler.NewCache(tx, time.Second),
	}
	if err := s.fences.Load(ctx, tx); err != nil {
		return nil, err
	}
	if err := s.handlers.Refresh(ctx); err != nil {
		return nil, err
	}
	return s, nil
}

// transactionCommitted says whether the commit of row event ev's
// transaction was applied already (its rows have roots decided).
func transactionCommitted(ctx context.Context, tx pgx.Tx, schema string, ev *event.Event) (bool, error) {
	var committed bool
	err := tx.QueryRow(ctx, fmt.Sprintf(`SELECT EXISTS (SELECT 1 FROM %s.rows
		WHERE source = $1 AND commit_lsn = $2::pg_lsn AND is_root IS NOT NULL)`, archive.Ident(schema)),
		ev.Source, ev.CommitLSN.String()).Scan(&committed)
	if err != nil {
		return false, fmt.Errorf("replay: look up transaction: %w", err)
	}
	return committed, nil
}

// verifyBoundary checks the signature of a replayed commit, gap or mark,
// as verification does at arrival (keyring.verify): a boundary quarantined
// because this build could not decode it (unknown_version) was never
// verified, and applying a forger's would record a gap that never
// happened, or decide a transaction's roots. Only messages at or before
// the partition's legacy boundary (written before signing) are believed
// unsigned. A boundary that fails is refused as unauthenticated; rows are
// not signed one by one (their transaction's commit covers them:
// notYetVerified).
func verifyBoundary(ctx context.Context, tx pgx.Tx, e quarantine.Entry, ev *event.Event) error {
	if ev.Op != event.OpCommit && ev.Op != event.OpGap && ev.Op != event.OpMark {
		return nil
	}
	var legacy int64
	err := tx.QueryRow(ctx, `SELECT COALESCE((SELECT boundary_seq FROM epitaph.legacy_boundaries WHERE stream = $1 AND partition = $2), 0)`,
		event.StreamName(ev.Source), e.Partition).Scan(&legacy)
	if err != nil {
		return fmt.Errorf("replay: read the legacy boundary: %w", err)
	}
	if e.StreamSeq <= uint64(legacy) {
		return nil
	}
	h := nats.Header(e.Headers)
	refused := func(why string) error {
		return quarantine.Permanent(quarantine.CategoryUnauthenticated, fmt.Errorf("not replayed: the %s message failed verification: %s", ev.Op, why))
	}
	if h.Get(event.HeaderSignature) == "" {
		return refused("it is unsigned")
	}
	keys, err := trust.TrustedKeys(ctx, tx)
	if err != nil {
		return fmt.Errorf("replay: %w", err)
	}
	id := h.Get(event.HeaderKeyID)
	for _, k := range keys {
		if k.KeyID != id {
			continue
		}
		if err := event.VerifyMessage(k.PublicKey, e.Subject, h, e.Data); err != nil {
			return refused(err.Error())
		}
		return nil
	}
	return refused(fmt.Sprintf("signed with key %q, which this target does not trust", id))
}

// notYetVerified refuses, for now, to replay a row whose transaction is
// not verified yet: replay archives a row visible (verified), as its
// signed commit would have, so the entry must lie in a window a signed
// commit closed. A row of the partition's open window (after its last
// verified boundary, with rows pending) waits for that commit: its
// transaction may yet be refused, and the entry with it (unauthenticated).
// A transaction whose commit was applied must have no row claiming it
// still unverified: replay makes them visible with it (they are copies or
// forgeries pending in the open window, which its boundary refuses).
func notYetVerified(ctx context.Context, tx pgx.Tx, v version.Version, e quarantine.Entry, ev *event.Event) error {
	if ev.Op == event.OpCommit {
		return nil
	}
	var open, unverified bool
	err := tx.QueryRow(ctx, fmt.Sprintf(`SELECT
		EXISTS (SELECT 1 FROM epitaph.progress WHERE projection = $1 AND version = $2 AND partition = $3
		               AND tx_pending > 0 AND $4 > COALESCE(tx_start, 0)),
		EXISTS (SELECT 1 FROM %s.rows WHERE source = $5 AND commit_lsn = $6::pg_lsn AND NOT verified)`, archive.Ident(v.Schema)),
		v.Projection, v.Version, e.Partition, int64(e.StreamSeq), ev.Source, ev.CommitLSN.String()).Scan(&open, &unverified)
	if err != nil {
		return fmt.Errorf("replay: look up the partition's open transaction: %w", err)
	}
	// The entry stays open under its own category, its error saying why:
	// a later replay takes it.
	cat := quarantine.Category(e.Category)
	if open {
		return quarantine.Permanent(cat, errors.New("not replayed yet: its transaction's signed commit is not applied "+
			"(the row is in the partition's open window); replay it once the partition has passed the commit"))
	}
	if unverified {
		return quarantine.Permanent(cat, fmt.Errorf("not replayed yet: rows not verified yet claim its transaction (commit LSN %s) "+
			"in the partition's open window; replay it once the partition has passed them", ev.CommitLSN))
	}
	return nil
}
