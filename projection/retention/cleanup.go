package retention

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/epitaph-dev/epitaph/internal/startstop"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/quarantine"
)

// CleanupOptions bound one retention batch.
type CleanupOptions struct {
	// Projection whose versions are cleaned; default "archive".
	Projection string
	// Batch is the most rows deleted by the batch, over all versions;
	// default DefaultCleanupBatch, at most MaxCleanupBatch.
	Batch int
	// StatementTimeout bounds each statement; default 10s.
	StatementTimeout time.Duration
}

// Batch bounds of retention cleanup.
const (
	DefaultCleanupBatch = 5000
	MinCleanupBatch     = 100
	MaxCleanupBatch     = 100000
)

// CleanupResult is what one batch did. It never holds row values.
type CleanupResult struct {
	// Deleted is the number of archive rows deleted, over all versions.
	Deleted int `json:"deleted"`
	// ByTable counts them by "schema.table".
	ByTable map[string]int `json:"by_table"`
	// ByVersion counts them by version schema.
	ByVersion map[string]int `json:"by_version"`
	// Snapshots and Groups are the snapshot documents (jobs) and snapshot
	// groups pruned with their rows.
	Snapshots int `json:"snapshots"`
	Groups    int `json:"groups"`
	// Deliveries are the terminal deliveries (done, stopped, dead) deleted
	// with their rows: those of rows no other version's archive holds.
	Deliveries int `json:"deliveries"`
	// Statements is how many SQL statements deleted rows (one per version
	// with expired rows, each bounded by the batch).
	Statements int `json:"statements"`
	// Full: the batch deleted as many rows as it could; more may be due.
	Full bool `json:"full"`
	// Dropped are the partitions ("schema.table") dropped whole, their rows
	// all expired, none held, none with an open delivery, none after a
	// cursor handler's cursor (their rows are counted in Deleted, ByTable
	// and ByVersion too).
	Dropped []string `json:"dropped,omitempty"`
	// droppedRows: how many of Deleted went with Dropped (a DROP each,
	// not a write per row: not paced).
	droppedRows int
	// Skipped are the version schemas another cleaner was cleaning (this
	// batch left them to it).
	Skipped []string `json:"skipped,omitempty"`
	// OldestDue is the expires_at of the oldest row still expired, present
	// and deletable (not held, no open delivery, not after a cursor handler's
	// cursor) after the batch; nil: none.
	// After a full batch it is the newest expires_at the batch deleted (the
	// oldest left is at least as new; not looked up).
	OldestDue *time.Time    `json:"oldest_due"`
	Duration  time.Duration `json:"duration_ns"`
}

// cleanupSQL is one version's batch. The victims are found by the
// expires_at index in expiry order (each checked against the holds and the
// open deliveries by index, and against the cursor handlers' positions of
// its table: cursorKeptSQL) and deleted by their tuple ids in the same
// statement: a join back to the table on its key made Postgres hash the
// whole archive (a sequential scan of every row) for each batch. They are
// not locked first (FOR UPDATE SKIP LOCKED wrote a lock record per row, a
// third of the batch's WAL and a quarter of its CPU): one cleaner at a time
// cleans a version (cleanupLockSQL), and a row a concurrent erase or apply
// changed in between is left to the next batch (the delete re-checks its
// tuple id). The holds are probed per row only when there is a hold at
// all (read once, in the statement's snapshot). The deleted rows' terminal
// deliveries go in the same statement, unless another version's archive
// still holds the row (%[4]s: a NOT EXISTS per other version): a row that
// expired leaves neither its key nor a record of its side effects behind,
// and epitaph.deliveries does not outgrow the archive (open deliveries
// keep their row, above). They are found per deleted row by the
// deliveries' (source, commit_lsn, seq) index (a join on the CTE could hash
// the whole table) and deleted by tuple id: one a concurrent retry moved
// back to pending is left. Without any delivery at all (no handlers) the
// probes are skipped, as the holds' are. It returns, per table, the
// newest expires_at deleted: a full batch's OldestDue. A tuple id names a
// row only within its partition (every partition of a partitioned rows
// table has a tuple (0,1)), so the delete matches the victims' table too.
const cleanupSQL = `
WITH cursors AS MATERIALIZED (` + cursorHoldsSQL + `),
victims AS (
    SELECT r.tableoid AS rel, r.ctid AS tid FROM %[1]s r
    WHERE r.expires_at <= now()
      AND NOT EXISTS (SELECT 1 FROM epitaph.deliveries d
                      WHERE d.source = r.source AND d.commit_lsn = r.commit_lsn AND d.seq = r.seq
                        AND d.state IN ('pending', 'in_flight'))
      AND (NOT (SELECT EXISTS (SELECT 1 FROM epitaph.legal_holds))
           OR NOT EXISTS (SELECT 1 FROM epitaph.legal_holds h
                          WHERE h.schema_name = r.schema_name AND h.table_name = r.table_name
                            AND (h.key = r.key OR r.row @> h.match)))` + cursorKeptSQL + `
    ORDER BY r.expires_at
    LIMIT $1
), del AS (
    DELETE FROM %[1]s r
    WHERE r.ctid = ANY (ARRAY(SELECT tid FROM victims)) AND (r.tableoid, r.ctid) IN (SELECT rel, tid FROM victims)
    RETURNING r.source, r.commit_lsn, r.seq, r.correlation_id, r.schema_name, r.table_name, r.expires_at
)%[2]s, dels AS (
    DELETE FROM epitaph.deliveries d
    WHERE d.ctid = ANY (ARRAY(
        SELECT e.tid FROM del x CROSS JOIN LATERAL (
            SELECT o.ctid AS tid FROM epitaph.deliveries o
            WHERE o.source = x.source AND o.commit_lsn = x.commit_lsn AND o.seq = x.seq
              AND o.state IN ('done', 'stopped', 'dead')) e
        WHERE (SELECT EXISTS (SELECT 1 FROM epitaph.deliveries))%[4]s))
    RETURNING 1
)
SELECT schema_name || '.' || table_name, count(*)::int, max(expires_at), %[3]s, (SELECT count(*)::int FROM dels) FROM del GROUP BY 1`

// cleanupLockSQL is taken by a batch before it cleans a version (in its
// transaction): a version held by another cleaner is skipped by this batch.
// Two-key form, its own advisory lock space.
const cleanupLockSQL = `SELECT pg_try_advisory_xact_lock(hashtext('epitaph.cleanup'), hashtext($1))`

// cleanupSnapshotsSQL prunes, in the same statement, the documents rooted
// at deleted rows (found by correlation id, the prefix of the documents'
// unique index) and the groups of transactions left without rows (by
// correlation id: the groups' key and an index of the rows).
const cleanupSnapshotsSQL = `, snaps AS (
    DELETE FROM %[1]s s USING del d
    WHERE s.correlation_id = d.correlation_id
      AND s.source = d.source AND s.commit_lsn = d.commit_lsn AND s.root_seq = d.seq
    RETURNING 1
), groups AS (
    DELETE FROM %[2]s g
    WHERE g.correlation_id IN (SELECT correlation_id FROM del)
      AND NOT EXISTS (SELECT 1 FROM %[3]s r WHERE r.correlation_id = g.correlation_id
                      AND NOT EXISTS (SELECT 1 FROM del x WHERE x.source = r.source AND x.commit_lsn = r.commit_lsn AND x.seq = r.seq))
    RETURNING 1
)`

const oldestDueSQL = `
WITH cursors AS MATERIALIZED (` + cursorHoldsSQL + `)
SELECT r.expires_at FROM %[1]s r
WHERE r.expires_at <= now()
  AND NOT EXISTS (SELECT 1 FROM epitaph.deliveries d
                  WHERE d.source = r.source AND d.commit_lsn = r.commit_lsn AND d.seq = r.seq
                    AND d.state IN ('pending', 'in_flight'))
  AND NOT EXISTS (SELECT 1 FROM epitaph.legal_holds h
                  WHERE h.schema_name = r.schema_name AND h.table_name = r.table_name
                    AND (h.key = r.key OR r.row @> h.match))` + cursorKeptSQL + `
ORDER BY r.expires_at LIMIT 1`

// CleanupBatch runs one retention batch and returns: it deletes at most
// opts.Batch expired rows (oldest first) over every version of the
// projection whose archive exists, with the snapshots and groups that go
// with them, each version in one statement under the statement timeout.
// Rows locked by a concurrent batch are skipped, so several projectors can
// clean at once. It is the whole of "projector cleanup"; the projector's
// Cleaner calls it in a loop.
func CleanupBatch(ctx context.Context, pool *pgxpool.Pool, opts CleanupOptions) (CleanupResult, error) {
	start := time.Now()
	if opts.Projection == "" {
		opts.Projection = archive.Projection
	}
	if opts.Batch <= 0 {
		opts.Batch = DefaultCleanupBatch
	}
	opts.Batch = min(opts.Batch, MaxCleanupBatch)
	if opts.StatementTimeout <= 0 {
		opts.StatementTimeout = 10 * time.Second
	}
	res := CleanupResult{ByTable: map[string]int{}, ByVersion: map[string]int{}}
	schemas, err := VersionSchemas(ctx, pool, opts.Projection)
	if err != nil {
		return res, err
	}
	p := cleanupParams{pool: pool, all: schemas, timeout: opts.StatementTimeout, res: &res}
	for _, vs := range schemas {
		if err := dropExpiredPartitions(ctx, p, vs); err != nil {
			return res, err
		}
	}
	budget := opts.Batch
	var newest *time.Time
	for _, vs := range schemas {
		if budget == 0 {
			break
		}
		n, last, err := cleanupVersion(ctx, p, vs, budget)
		if err != nil {
			return res, err
		}
		budget -= n
		if last != nil && (newest == nil || last.After(*newest)) {
			newest = last
		}
	}
	res.Full = budget == 0
	if res.Full {
		// More is due: the oldest left is at least as new as the newest
		// row deleted (oldest first). Looking it up would walk the
		// index entries of every row just deleted, which stay until vacuum.
		res.OldestDue = newest
		res.Duration = time.Since(start)
		return res, nil
	}
	if res.OldestDue, err = oldestDue(ctx, pool, schemas); err != nil {
		return res, err
	}
	res.Duration = time.Since(start)
	return res, nil
}

// oldestDue is the expires_at of the oldest row of the versions that is
// expired, present and deletable; nil: none.
func oldestDue(ctx context.Context, pool *pgxpool.Pool, schemas []archive.VersionSchema) (*time.Time, error) {
	var oldest *time.Time
	for _, vs := range schemas {
		var t *time.Time
		if err := pool.QueryRow(ctx, fmt.Sprintf(oldestDueSQL, archive.Ident(vs.Schema, "rows"))).Scan(&t); err != nil && !errors.Is(err, pgx.ErrNoRows) {
			return nil, fmt.Errorf("oldest expired row of %s: %w", vs.Schema, err)
		}
		if t != nil && (oldest == nil || t.Before(*oldest)) {
			oldest = t
		}
	}
	return oldest, nil
}

// failedDue sets the oldest-due gauge after a failed batch: a batch that
// fails deletes nothing, so the rows due keep ageing (a cleanup failing
// every batch must raise EpitaphRetentionBehind). Read without the batch's
// writes (a batch failing on a lock or a timeout leaves reads possible);
// when that fails too, the oldest due row known from the last batch keeps
// ageing.
func (c *Cleaner) failedDue(ctx context.Context) {
	t, err := c.readDue(ctx)
	if err != nil {
		t = c.lastDue
	}
	if t != nil {
		c.m.oldestDue.Set(max(0, time.Since(*t).Seconds()))
	}
}

// measureDue is a step of a cleaner that only measures: the oldest-due
// gauge follows the rows due (0 when none), as read now; when they cannot
// be read, the oldest known keeps ageing.
func (c *Cleaner) measureDue(ctx context.Context) {
	t, err := c.readDue(ctx)
	if err != nil {
		t = c.lastDue
	} else {
		c.lastDue = t
		c.m.oldestDue.Set(0)
	}
	if t != nil {
		c.m.oldestDue.Set(max(0, time.Since(*t).Seconds()))
	}
}

// readDue reads the expires_at of the oldest row due (nil: none), without
// writing.
func (c *Cleaner) readDue(ctx context.Context) (*time.Time, error) {
	rctx, cancel := context.WithTimeout(ctx, c.cfg.StatementTimeout)
	defer cancel()
	projection := c.cfg.Projection
	if projection == "" {
		projection = archive.Projection
	}
	schemas, err := VersionSchemas(rctx, c.pool, projection)
	if err != nil {
		return nil, err
	}
	return oldestDue(rctx, c.pool, schemas)
}

// VersionSchemas are the schemas of every version of projection whose
// rows table exists (retired ones included: every version's rows expire).
func VersionSchemas(ctx context.Context, db interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}, projection string) ([]archive.VersionSchema, error) {
	rows, err := db.Query(ctx, `
		SELECT schema_name, to_regclass(quote_ident(schema_name) || '.snapshots') IS NOT NULL
		FROM epitaph.projection_versions
		WHERE projection = $1 AND to_regclass(quote_ident(schema_name) || '.rows') IS NOT NULL
		ORDER BY version`, projection)
	if err != nil {
		return nil, fmt.Errorf("list version schemas: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (archive.VersionSchema, error) {
		var v archive.VersionSchema
		return v, r.Scan(&v.Schema, &v.Snapshots)
	})
	if err != nil {
		return nil, fmt.Errorf("list version schemas: %w", err)
	}
	return out, nil
}

// cleanupParams is what the steps of one CleanupBatch share.
type cleanupParams struct {
	pool    *pgxpool.Pool
	all     []archive.VersionSchema // every version of the projection
	timeout time.Duration           // each statement's statement_timeout
	res     *CleanupResult          // filled in
}

// cleanupVersion deletes up to limit expired rows of version vs.
func cleanupVersion(ctx context.Context, p cleanupParams, vs archive.VersionSchema, limit int) (int, *time.Time, error) {
	all, timeout, res := p.all, p.timeout, p.res
	tx, err := p.pool.Begin(ctx)
	if err != nil {
		return 0, nil, fmt.Errorf("begin cleanup of %s: %w", vs.Schema, err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // after commit, a no-op
	// No JIT: compiling a large batch's plan costs more than it saves.
	if _, err := tx.Exec(ctx, fmt.Sprintf(`SET LOCAL statement_timeout = %d; SET LOCAL jit = off`, timeout.Milliseconds())); err != nil {
		return 0, nil, fmt.Errorf("cleanup of %s: %w", vs.Schema, err)
	}
	var mine bool
	if err := tx.QueryRow(ctx, cleanupLockSQL, vs.Schema).Scan(&mine); err != nil {
		return 0, nil, fmt.Errorf("cleanup lock of %s: %w", vs.Schema, err)
	}
	if !mine { // another cleaner is on this version
		res.Skipped = append(res.Skipped, vs.Schema)
		return 0, nil, nil
	}
	// No hold added while the batch is in flight: the statement reads the
	// holds in its snapshot, so a hold committed after it (and reported
	// added) would not keep its row. A hold being added waits for the
	// batch, and the batch for it (as the partition drop does).
	if _, err := tx.Exec(ctx, `LOCK TABLE epitaph.legal_holds IN SHARE MODE`); err != nil {
		return 0, nil, fmt.Errorf("lock the legal holds for %s: %w", vs.Schema, err)
	}
	extra, counts := "", "0, 0"
	if vs.Snapshots {
		extra = fmt.Sprintf(cleanupSnapshotsSQL, archive.Ident(vs.Schema, "snapshots"), archive.Ident(vs.Schema, "snapshot_groups"), archive.Ident(vs.Schema, "rows"))
		counts = "(SELECT count(*)::int FROM snaps), (SELECT count(*)::int FROM groups)"
	}
	var others strings.Builder
	for _, o := range all {
		if o.Schema != vs.Schema {
			fmt.Fprintf(&others, "\n          AND NOT EXISTS (SELECT 1 FROM %s v WHERE v.source = x.source AND v.commit_lsn = x.commit_lsn AND v.seq = x.seq)", archive.Ident(o.Schema, "rows"))
		}
	}
	rows, err := tx.Query(ctx, fmt.Sprintf(cleanupSQL, archive.Ident(vs.Schema, "rows"), extra, counts, others.String()), limit)
	if err != nil {
		return 0, nil, fmt.Errorf("delete expired rows of %s: %w", vs.Schema, err)
	}
	res.Statements++
	total := 0
	var table string
	var n, snaps, groups, dels int
	var last, newest *time.Time
	// The pruned snapshots, groups and deliveries are the statement's
	// totals, the same on every row.
	_, err = pgx.ForEachRow(rows, []any{&table, &n, &last, &snaps, &groups, &dels}, func() error {
		res.ByTable[table] += n
		total += n
		if last != nil && (newest == nil || last.After(*newest)) {
			t := *last
			newest = &t
		}
		return nil
	})
	if err != nil {
		return 0, nil, fmt.Errorf("delete expired rows of %s: %w", vs.Schema, err)
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, nil, fmt.Errorf("commit cleanup of %s: %w", vs.Schema, err)
	}
	if total > 0 {
		res.ByVersion[vs.Schema] += total
		res.Snapshots += snaps
		res.Groups += groups
		res.Deliveries += dels
	}
	res.Deleted += total
	return total, newest, nil
}

// Metrics are the cleanup's and the fences' metrics.
type Metrics struct {
	expired   *prometheus.CounterVec
	oldestDue prometheus.Gauge
	errors    prometheus.Counter
	batch     prometheus.Gauge
	Fenced    *prometheus.CounterVec
}

// NewMetrics registers the cleanup's and the fences' metrics with reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		expired: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "epitaph_projector_rows_expired_total",
			Help: "Archive rows deleted by retention cleanup (every version), by source table."}, []string{"table"}),
		oldestDue: prometheus.NewGauge(prometheus.GaugeOpts{Name: "epitaph_projector_expired_oldest_seconds",
			Help: "Age past expires_at of the oldest archive row that is expired, deletable (not held, no open delivery) and still present; 0 when none."}),
		errors: prometheus.NewCounter(prometheus.CounterOpts{Name: "epitaph_projector_cleanup_errors_total",
			Help: "Retention cleanup batches that failed."}),
		batch: prometheus.NewGauge(prometheus.GaugeOpts{Name: "epitaph_projector_cleanup_batch_size",
			Help: "The retention cleanup's current batch size (adapted to how long batches take)."}),
		Fenced: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "epitaph_projector_fenced_rows_total",
			Help: "Rows not archived because an erasure fences them, by projection version."}, []string{"projection", "version"}),
	}
	reg.MustRegister(m.expired, m.oldestDue, m.errors, m.batch, m.Fenced)
	return m
}

// CleanerConfig configures the retention worker of a projector.
type CleanerConfig struct {
	Projection string
	// Interval between batches while nothing is due; default 10s. A full
	// batch is followed by the next at once.
	Interval time.Duration
	// Batch is the first batch size (default DefaultCleanupBatch); it
	// adapts between MinCleanupBatch and MaxCleanupBatch so that a batch
	// takes about a quarter of StatementTimeout.
	Batch            int
	StatementTimeout time.Duration
	// Rate paces the cleaner while Busy reports true (the projector is
	// applying): after a full batch of n rows it waits until n/Rate seconds
	// have passed since the batch began, and a batch is at most a quarter
	// second of Rate. Unpaced while Busy is false, when Rate is 0, and
	// while catching up: once full batches have deleted rows expired more
	// than cleanupBehind ago for cleanupBehind on end, the batches follow
	// at once until one deletes rows expired within it (so retention never
	// falls behind for good, whatever the apply does).
	Rate   int
	Busy   func() bool
	Logger *slog.Logger
	// MeasureOnly: delete nothing, only keep the oldest-due gauge current
	// every Interval (a projector whose cleanup is off still reports the
	// rows nobody deletes: EpitaphRetentionBehind).
	MeasureOnly bool
}

// cleanupBehind is how far past expiry the newest row a full batch
// deleted may be, and for how long, before pacing is lifted: the alert
// EpitaphRetentionBehind's threshold.
const cleanupBehind = time.Hour

// DefaultCleanupRate is the retention worker's pace while the projector
// applies (rows per second; Config.CleanupRate).
const DefaultCleanupRate = 60000

// Cleaner runs retention batches in the background (internal/startstop).
type Cleaner struct {
	pool  *pgxpool.Pool
	cfg   CleanerConfig
	m     *Metrics
	batch int
	// behindSince: since when full batches have deleted rows expired
	// more than cleanupBehind ago (zero: the last one did not).
	behindSince time.Time
	// lastDue: the last successful batch's OldestDue.
	lastDue *time.Time
	ss      startstop.Base
}

// NewCleaner returns a Cleaner of pool; zero fields of cfg take their
// defaults.
func NewCleaner(pool *pgxpool.Pool, cfg CleanerConfig, m *Metrics) *Cleaner {
	if cfg.Interval <= 0 {
		cfg.Interval = 10 * time.Second
	}
	if cfg.StatementTimeout <= 0 {
		cfg.StatementTimeout = 10 * time.Second
	}
	if cfg.Batch <= 0 {
		cfg.Batch = DefaultCleanupBatch
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return &Cleaner{pool: pool, cfg: cfg, m: m, batch: min(max(cfg.Batch, MinCleanupBatch), MaxCleanupBatch)}
}

// Start runs batches until Stop (the batch in flight finishes) or ctx is
// cancelled (it rolls back).
func (c *Cleaner) Start(ctx context.Context) error {
	soft, hard, ok := c.ss.StartInit(ctx)
	if !ok {
		return errors.New("retention cleaner already started")
	}
	go c.loop(soft, hard)
	return nil
}

// Stop is the soft stop (see internal/startstop).
func (c *Cleaner) Stop(ctx context.Context) error { return c.ss.Stop(ctx) }

// Wait blocks until the cleaner has stopped.
func (c *Cleaner) Wait() error { return c.ss.Wait() }

func (c *Cleaner) loop(soft, hard context.Context) {
	defer c.ss.Finish(nil)
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-soft.Done():
			return
		case <-t.C:
		}
		full, pace := c.step(hard)
		wait := c.cfg.Interval
		if full {
			wait = pace
		}
		t.Reset(wait)
	}
}

// step runs one batch, records it and adapts the batch size; it reports
// whether more is due, and how long to wait before it (the pace).
func (c *Cleaner) step(ctx context.Context) (bool, time.Duration) {
	if c.cfg.MeasureOnly {
		c.measureDue(ctx)
		return false, 0
	}
	paced := c.paced(nil)
	batch := c.batch
	if paced {
		batch = min(batch, max(MinCleanupBatch, c.cfg.Rate/4))
	}
	c.m.batch.Set(float64(batch))
	res, err := CleanupBatch(ctx, c.pool, CleanupOptions{Projection: c.cfg.Projection, Batch: batch, StatementTimeout: c.cfg.StatementTimeout})
	if err != nil {
		if ctx.Err() != nil {
			return false, 0
		}
		c.m.errors.Inc()
		var pg *pgconn.PgError
		if errors.As(err, &pg) && pg.Code == "57014" { // statement timeout: smaller batches
			c.batch = max(MinCleanupBatch, c.batch/4)
		}
		c.cfg.Logger.Warn("retention cleanup batch failed", "err", quarantine.Sanitize(err), "batch", c.batch)
		c.failedDue(ctx)
		return false, 0
	}
	for _, tbl := range slices.Sorted(maps.Keys(res.ByTable)) {
		c.m.expired.WithLabelValues(tbl).Add(float64(res.ByTable[tbl]))
	}
	c.m.oldestDue.Set(0)
	c.lastDue = res.OldestDue
	if res.OldestDue != nil {
		c.m.oldestDue.Set(max(0, time.Since(*res.OldestDue).Seconds()))
	}
	if res.Deleted > 0 {
		c.cfg.Logger.Info("retention cleanup: expired rows deleted", "rows", res.Deleted, "by_table", res.ByTable,
			"snapshots", res.Snapshots, "groups", res.Groups, "deliveries", res.Deliveries, "duration", res.Duration, "batch", batch)
	}
	target := c.cfg.StatementTimeout / 4
	switch {
	case res.Duration > target:
		c.batch = max(MinCleanupBatch, c.batch/2)
	case res.Full && res.Duration < target/2 && batch == c.batch:
		c.batch = min(MaxCleanupBatch, c.batch*2)
	}
	if !res.Full || !c.paced(res.OldestDue) {
		return res.Full, 0
	}
	// Paced by the rows deleted one by one: a dropped partition costs a
	// DROP, whatever its rows.
	return true, max(0, time.Duration(float64(res.Deleted-res.droppedRows)/float64(c.cfg.Rate)*float64(time.Second))-res.Duration)
}

// paced: the next batch is paced (Rate set, the projector applying, and
// not catching up). newest, when known, is the newest expires_at a full
// batch deleted: a backlog whose rows expired more than cleanupBehind ago
// for cleanupBehind on end (the rate is below the rows expiring, the
// alert is firing) is deleted unpaced until a batch is within the hour.
func (c *Cleaner) paced(newest *time.Time) bool {
	if newest != nil {
		switch {
		case time.Since(*newest) <= cleanupBehind:
			c.behindSince = time.Time{}
		case c.behindSince.IsZero():
			c.behindSince = time.Now()
		}
	}
	if c.cfg.Rate <= 0 || c.cfg.Busy == nil || !c.cfg.Busy() {
		return false
	}
	return c.behindSince.IsZero() || time.Since(c.behindSince) <= cleanupBehind
}
