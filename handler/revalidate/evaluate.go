package revalidate

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/epitaph-dev/epitaph/internal/pgdial"
)

// DB is the target database: a pool (or a connection) on which the
// evaluator reads and records.
type DB interface {
	querier
	Begin(ctx context.Context) (pgx.Tx, error)
}

// Config configures an Evaluator.
type Config struct {
	// SourceURL is the source database read for handlers without a
	// source_url_file (the projector's --source-url). Never logged.
	SourceURL string
	// SourceTimeout bounds each read of the source (connecting included);
	// default 10 s. A read that does not finish in time defers.
	SourceTimeout time.Duration
	// SourceMaxConns is the size of each source pool; default 4.
	SourceMaxConns int32
	// SourceTCPTimeout is the TCP_USER_TIMEOUT of the source pools'
	// connections (pgdial.Set): a path to the source that died silently
	// fails a read about this long after it was sent. 0 or negative: the
	// system's default.
	SourceTCPTimeout time.Duration
	// SourceTracer, when set, traces every query on the source pools
	// (tests count the reads with it).
	SourceTracer pgx.QueryTracer
	// Logger; default slog.Default().
	Logger *slog.Logger
	// Registerer for the metrics; nil: not registered.
	Registerer prometheus.Registerer
}

func (c *Config) defaults() {
	if c.SourceTimeout <= 0 {
		c.SourceTimeout = 10 * time.Second
	}
	if c.SourceMaxConns <= 0 {
		c.SourceMaxConns = 4
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
}

// Evaluator revalidates deliveries. One read path for every handler: the
// target database for the archive and the deliveries, and one pgx pool per
// source URL for the source tables. Safe for concurrent use.
type Evaluator struct {
	db      DB
	cfg     Config
	metrics *metrics

	mu      sync.Mutex
	sources map[string]*pgxpool.Pool // by URL (never logged)
	closed  bool
	// live and urlFiles: the live archive schema and the handlers'
	// source_url_file as EvaluateClaimed last read them, its guesses for
	// the next call (checked against that call's fresh read).
	live     *string
	urlFiles map[string]*string
}

// New returns an Evaluator on the target db. Close it to close the source
// pools it opened.
func New(db DB, cfg Config) (*Evaluator, error) {
	cfg.defaults()
	m, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, err
	}
	return &Evaluator{db: db, cfg: cfg, metrics: m, sources: map[string]*pgxpool.Pool{}}, nil
}

// Close closes the source pools.
func (e *Evaluator) Close() {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, p := range e.sources {
		p.Close()
	}
	e.sources = map[string]*pgxpool.Pool{}
	e.closed = true
}

// ErrNoDelivery is returned for a delivery id that does not exist.
var ErrNoDelivery = errors.New("no such delivery")

// delivery is what the evaluation reads of a delivery, its handler and the
// archive's live version, in one query.
type delivery struct {
	id, handlerID, source, lsn string
	seq, generation            int
	schemaName, table          string
	key                        []byte
	correlationID              string
	fingerprint                *string
	groupRows                  *int
	groupMax                   *string
	handlerExists, enabled     bool
	revoked, revalidate        bool
	sourceURLFile              *string
	laterDelivery              bool
	liveSchema                 *string
	erasures                   bool
}

// deliveriesSQL reads the claimed batch's deliveries in one statement
// (the later-delivery check of every one included).
const deliveriesSQL = `
SELECT d.id::text, d.handler_id::text, d.source, d.commit_lsn::text, d.seq, d.generation,
       d.schema_name, d.table_name, d.key, d.correlation_id,
       d.fingerprint, d.group_rows, d.group_max,
       h.id IS NOT NULL, COALESCE(h.enabled, false), h.revoked_at IS NOT NULL,
       COALESCE(h.revalidate, true), h.source_url_file,
       EXISTS (SELECT 1 FROM epitaph.deliveries l
               WHERE l.handler_id = d.handler_id AND l.schema_name = d.schema_name
                 AND l.table_name = d.table_name AND jsonb_hash(l.key) = jsonb_hash(d.key) AND l.key = d.key AND l.source = d.source
                 AND (l.commit_lsn, l.seq) > (d.commit_lsn, d.seq)
                 -- A row not (yet) authenticated is no later deletion: a
                 -- forgery must not silence a real one.
                 AND l.verified AND l.outcome IS DISTINCT FROM 'unverified'),
       (SELECT schema_name FROM epitaph.projection_versions WHERE projection = 'archive' AND state = 'live'),
       to_regclass('epitaph.erasures') IS NOT NULL
FROM epitaph.deliveries d LEFT JOIN epitaph.handlers h ON h.id = d.handler_id
WHERE d.id = ANY($1::text[]::uuid[])`

// readDeliveries reads the deliveries ids, by id (a missing one is absent).
func (e *Evaluator) readDeliveries(ctx context.Context, ids []string) (map[string]delivery, error) {
	rows, err := e.db.Query(ctx, deliveriesSQL, ids)
	if err != nil {
		return nil, fmt.Errorf("read %d deliveries: %w", len(ids), err)
	}
	ds, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (delivery, error) {
		var d delivery
		err := r.Scan(&d.id, &d.handlerID, &d.source, &d.lsn, &d.seq, &d.generation,
			&d.schemaName, &d.table, &d.key, &d.correlationID, &d.fingerprint, &d.groupRows, &d.groupMax,
			&d.handlerExists, &d.enabled, &d.revoked, &d.revalidate, &d.sourceURLFile, &d.laterDelivery,
			&d.liveSchema, &d.erasures)
		return d, err
	})
	if err != nil {
		return nil, fmt.Errorf("read %d deliveries: %w", len(ids), err)
	}
	byID := make(map[string]delivery, len(ds))
	for _, d := range ds {
		byID[d.id] = d
	}
	return byID, nil
}

// Evaluate decides what to do with delivery id now, from fresh reads of the
// target (the delivery, its handler, the live archive) and of the source
// (whether the key exists again). Nothing is cached between calls. State
// that cannot be read gives Defer, never Send; the error is non-nil only
// for a delivery that does not exist (ErrNoDelivery). Evaluate changes
// nothing: Record does. It is EvaluateBatch of one: the checks run in
// order, the handler (target only), the delivery's own row in the live
// archive (cheap aggregate), the source (is the key back?), then the set
// (full read only when the pair differs).
func (e *Evaluator) Evaluate(ctx context.Context, id string) (Result, error) {
	res, errs := e.EvaluateBatch(ctx, []string{id})
	return res[0], errs[0]
}

// decideHandler: the handler's own state, and supersession by a later
// delivery (target-only checks, before anything costs a read of the set).
func (e *Evaluator) decideHandler(d delivery) Result {
	switch {
	case !d.handlerExists:
		return Result{Outcome: StopCompleted, Reason: ReasonHandlerRemoved}
	case d.revoked:
		return Result{Outcome: StopRevoked, Reason: ReasonHandlerRevoked}
	case !d.enabled:
		return Result{Outcome: Defer, Reason: ReasonHandlerDisabled}
	case !d.revalidate:
		return Result{Outcome: Send, Reason: ReasonNotRevalidated}
	case d.laterDelivery:
		return Result{Outcome: StopSuperseded, Reason: ReasonLaterDelivery}
	}
	return Result{}
}

// archiveResult: is the delivery's own row still in the live archive, and
// is the cheap pair c the stamped one? Retention keeps rows with open
// deliveries, so a row gone while its delivery is open was erased when an
// erasure fence names its table or erased_rows names it (stop_revoked),
// else removed otherwise (a discard, a version without it:
// stop_completed).
func (e *Evaluator) archiveResult(ctx context.Context, d delivery, c set, present, live bool) Result {
	switch {
	case present && !live:
		return Result{Outcome: StopCompleted, Reason: ReasonRowExpired}
	case !present:
		return e.gone(ctx, d)
	}
	if d.groupRows != nil && d.groupMax != nil && d.fingerprint != nil && c.rows == *d.groupRows && c.max == *d.groupMax {
		return Result{ObservedFingerprint: *d.fingerprint, Path: PathCheap}
	}
	return Result{Path: PathFull, current: c}
}

// erasedSQL: is there an erasure fence for the row's table? The fences
// hold no values (a keyed hash), so the table is what can be told. And can
// erased_rows (rows erased with their parent) be asked?
const erasedSQL = `
SELECT EXISTS (SELECT 1 FROM epitaph.erasures WHERE schema_name = $1 AND table_name = $2),
       to_regclass('epitaph.erased_rows') IS NOT NULL`

const erasedRowSQL = `
SELECT EXISTS (SELECT 1 FROM epitaph.erased_rows WHERE source = $1 AND commit_lsn = $2::pg_lsn AND seq = $3)`

// gone decides for a delivery whose row is no longer in the live archive.
func (e *Evaluator) gone(ctx context.Context, d delivery) Result {
	if !d.erasures {
		return Result{Outcome: StopCompleted, Reason: ReasonRowRemoved}
	}
	var fenced, rowsTable bool
	err := e.db.QueryRow(ctx, erasedSQL, d.schemaName, d.table).Scan(&fenced, &rowsTable)
	if err == nil && !fenced && rowsTable {
		err = e.db.QueryRow(ctx, erasedRowSQL, d.source, d.lsn, d.seq).Scan(&fenced)
	}
	if err != nil {
		e.cfg.Logger.Warn("revalidation deferred: erasures unreadable", "delivery", d.id, "err", err)
		return Result{Outcome: Defer, Reason: ReasonTargetUnreadable}
	}
	if fenced {
		return Result{Outcome: StopRevoked, Reason: ReasonRowErased}
	}
	return Result{Outcome: StopCompleted, Reason: ReasonRowRemoved}
}

// decideSet: the full read, when the cheap pair differed. The set is the
// same when its fingerprint is; a delivery never stamped takes the set it
// sees now as its promise.
func (e *Evaluator) decideSet(ctx context.Context, d delivery, a Result) Result {
	if a.Path == PathCheap {
		return Result{Outcome: Send, Reason: ReasonUnchanged, ObservedFingerprint: a.ObservedFingerprint, Path: PathCheap}
	}
	s, err := readFull(ctx, e.db, *d.liveSchema, d)
	if err != nil {
		e.cfg.Logger.Warn("revalidation deferred: archive unreadable", "delivery", d.id, "err", err)
		return Result{Outcome: Defer, Reason: ReasonTargetUnreadable}
	}
	res := Result{ObservedFingerprint: s.fingerprint, Path: PathFull, current: s}
	if d.fingerprint == nil || *d.fingerprint == s.fingerprint {
		res.Outcome, res.Reason = Send, ReasonUnchanged
		return res
	}
	res.Outcome, res.Reason = StopChanged, ReasonSetChanged
	return res
}

// sourceURL resolves the handler's source: its source_url_file, read on
// every evaluation (a rotated file takes effect at once), or the default.
func (e *Evaluator) sourceURL(d delivery) (string, string) {
	if d.sourceURLFile != nil && *d.sourceURLFile != "" {
		b, err := os.ReadFile(*d.sourceURLFile)
		if err != nil || strings.TrimSpace(string(b)) == "" {
			e.cfg.Logger.Warn("revalidation deferred: the handler's source URL file cannot be read",
				"handler", d.handlerID, "file", *d.sourceURLFile)
			return "", ReasonSourceURLFile
		}
		return strings.TrimSpace(string(b)), ""
	}
	if e.cfg.SourceURL == "" {
		return "", ReasonNoSourceURL
	}
	return e.cfg.SourceURL, ""
}

func (e *Evaluator) pool(ctx context.Context, url string) (*pgxpool.Pool, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return nil, errors.New("evaluator closed")
	}
	if p, ok := e.sources[url]; ok {
		return p, nil
	}
	pc, err := pgxpool.ParseConfig(url)
	if err != nil {
		// The parse error can quote the URL: never pass it on.
		return nil, errors.New("parse source URL: invalid")
	}
	pc.MaxConns = e.cfg.SourceMaxConns
	pc.ConnConfig.Tracer = e.cfg.SourceTracer
	pgdial.Set(&pc.ConnConfig.Config, e.cfg.SourceTCPTimeout)
	p, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		return nil, fmt.Errorf("open source pool: %w", err)
	}
	e.sources[url] = p
	return p, nil
}

// sourceReason classifies a failed source read: every one defers, the
// reason says who should act.
func sourceReason(err error) string {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		switch {
		case pe.Code == "42501":
			return ReasonSourcePermission
		case pe.Code == "42P01" || pe.Code == "3F000" || pe.Code == "42703":
			return ReasonSourceNoTable
		case strings.HasPrefix(pe.Code, "22"):
			return ReasonSourceKeyInvalid
		}
	}
	return ReasonSourceDown
}
