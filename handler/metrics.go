package handler

import (
	"context"
	"fmt"
	"log/slog"
	"sort"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
)

// metrics of a dispatcher. Counters are this process's; the gauges
// (deliveries by handler and state, oldest pending age) are read from the
// target at each scrape and are the same on every worker.
type metrics struct {
	attempts  *prometheus.CounterVec
	duration  *prometheus.HistogramVec
	dead      *prometheus.CounterVec
	reclaimed prometheus.Counter
	stale     prometheus.Counter
	// alone: attempts revalidated alone at their start (no batch verdict,
	// or one older than verdictMaxAge).
	alone *prometheus.CounterVec
	// duplicates: deliveries a cursor batch sent that were queued as rows
	// too (the serialisation with the apply broken: sent twice, perhaps).
	duplicates *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer, db DB, log *slog.Logger) (*metrics, error) {
	m := &metrics{
		attempts: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "epitaph_projector_delivery_attempts_total",
			Help: "Delivery attempts run by this worker, by handler and result (done, failed)."}, []string{"handler", "result"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "epitaph_projector_delivery_attempt_seconds",
			Help: "Duration of delivery attempts, by handler.", Buckets: prometheus.DefBuckets}, []string{"handler"}),
		dead: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "epitaph_projector_delivery_dead_letters_total",
			Help: "Deliveries this worker dead-lettered (max attempts or a permanent failure), by handler."}, []string{"handler"}),
		reclaimed: prometheus.NewCounter(prometheus.CounterOpts{Name: "epitaph_projector_delivery_reclaims_total",
			Help: "In-flight deliveries whose claim expired and that this worker reclaimed."}),
		stale: prometheus.NewCounter(prometheus.CounterOpts{Name: "epitaph_projector_delivery_stale_settles_total",
			Help: "Attempt outcomes discarded because the delivery's claim had been reclaimed."}),
		alone: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "epitaph_projector_delivery_revalidations_alone_total",
			Help: "Attempts revalidated alone when they started, by handler: no verdict of their claimed batch, or one older than a second."}, []string{"handler"}),
		duplicates: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "epitaph_projector_delivery_duplicates_total",
			Help: "Deliveries a batching handler's cursor sent that were queued as rows too, so may be sent twice, by handler (should stay 0)."}, []string{"handler"}),
	}
	if reg == nil {
		return m, nil
	}
	for _, c := range []prometheus.Collector{m.attempts, m.duration, m.dead, m.reclaimed, m.stale, m.alone, m.duplicates, NewCollector(db, log)} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("register delivery metrics: %w", err)
		}
	}
	return m, nil
}

func (m *metrics) observe(def Def, outcome string, d time.Duration) {
	m.observeN(def, outcome, d, 1)
}

// observeN is observe for the n deliveries of one attempt of a batch:
// each counts as an attempt that took d; the children are looked up once.
func (m *metrics) observeN(def Def, outcome string, d time.Duration, n int) {
	m.attempts.WithLabelValues(def.ID, outcome).Add(float64(n))
	h := m.duration.WithLabelValues(def.ID)
	for range n {
		h.Observe(d.Seconds())
	}
}

// Stat is one handler's deliveries in one state.
type Stat struct {
	HandlerID string `json:"handler_id"`
	Name      string `json:"name,omitempty"`
	Table     string `json:"table"`
	State     string `json:"state"`
	Count     int64  `json:"count"`
	// AtLeast: Count is a lower bound (a cursor handler's backlog,
	// counted up to CursorCountCap rows).
	AtLeast bool `json:"at_least,omitempty"`
	// OldestAge: of the oldest delivery in this state (pending: the
	// backlog's age).
	OldestAge time.Duration `json:"-"`
	OldestSec float64       `json:"oldest_age_seconds"`
}

// Stats counts deliveries by handler and state, exactly (one read of the
// whole table; handlers with none appear with state "" and count 0). A
// cursor handler's pending and in-flight deliveries are the archived rows
// after its cursor (CursorBacklogs), counted up to CursorCountCap. The
// metrics and the status page read through a StatsReader instead.
func Stats(ctx context.Context, db DB) ([]Stat, error) {
	stats, err := queryStats(ctx, db, allStatsSQL)
	if err != nil {
		return nil, err
	}
	defs, err := List(ctx, db)
	if err != nil {
		return nil, err
	}
	cursors, err := cursorStats(ctx, db, defs)
	if err != nil {
		return nil, err
	}
	return mergeStats(defs, stats, cursors), nil
}

// allStatsSQL counts every delivery (Stats).
const allStatsSQL = `
SELECT handler_id::text, schema_name || '.' || table_name, state, count(*), COALESCE(extract(epoch FROM now() - min(created_at)), 0)::float8
FROM epitaph.deliveries
GROUP BY 1, 2, 3`

// openStatsSQL counts the pending, in-flight and dead deliveries through
// the partial indexes that hold exactly them (deliveries_due_idx and
// deliveries_unreleased_idx for pending, deliveries_claims_idx,
// deliveries_dead_idx): the backlog and the dead letters, never the
// finished deliveries, which are kept as long as their rows.
const openStatsSQL = `
SELECT d.handler_id::text, d.tbl, d.state, count(*), COALESCE(extract(epoch FROM now() - min(d.created_at)), 0)::float8
FROM (
    SELECT handler_id, schema_name || '.' || table_name AS tbl, state, created_at FROM epitaph.deliveries
        WHERE state = 'pending' AND released_at IS NOT NULL
    UNION ALL
    SELECT handler_id, schema_name || '.' || table_name, state, created_at FROM epitaph.deliveries
        WHERE released_at IS NULL AND state = 'pending'
    UNION ALL
    SELECT handler_id, schema_name || '.' || table_name, state, created_at FROM epitaph.deliveries
        WHERE state = 'in_flight'
    UNION ALL
    SELECT handler_id, schema_name || '.' || table_name, state, created_at FROM epitaph.deliveries
        WHERE state = 'dead'
) d
GROUP BY 1, 2, 3`

// OpenStats counts the open and dead deliveries by handler and state, as
// StatsReader does at each read (the pending, in-flight and dead ones
// through partial indexes, a cursor handler's pending and in-flight ones
// from the archived rows after its cursor, up to CursorCountCap), without
// the done and stopped ones. Handlers with none appear with state "" and
// count 0.
func OpenStats(ctx context.Context, db DB) ([]Stat, error) {
	open, err := queryStats(ctx, db, openStatsSQL)
	if err != nil {
		return nil, err
	}
	defs, err := List(ctx, db)
	if err != nil {
		return nil, err
	}
	cursors, err := cursorStats(ctx, db, defs)
	if err != nil {
		return nil, err
	}
	return mergeStats(defs, open, cursors), nil
}

// finishedStatsSQL counts the done and stopped deliveries: the whole
// table, so StatsReader runs it in the background, at most every
// FinishedStatsRefresh.
const finishedStatsSQL = `
SELECT handler_id::text, schema_name || '.' || table_name, state, count(*), 0::float8
FROM epitaph.deliveries WHERE state IN ('done', 'stopped')
GROUP BY 1, 2, 3`

// FinishedStatsRefresh is how often a StatsReader counts the done and
// stopped deliveries (a read of the whole table).
const FinishedStatsRefresh = 5 * time.Minute

// firstCountWait is how long the first read waits for the first count of
// the finished deliveries.
const firstCountWait = time.Second

// finishedStatsTimeout bounds one count of the finished deliveries.
const finishedStatsTimeout = 2 * time.Minute

// StatsReader reads deliveries by handler and state for the metrics: the
// pending, in-flight and dead ones exactly at every read (a look through
// partial indexes; a cursor handler's pending and in-flight ones, the
// archived rows after its cursor, up to CursorCountCap), the done and
// stopped ones from a count of the whole table taken in the background at
// most every refresh, served as of that count (none until the first one
// ends).
type StatsReader struct {
	db      DB
	refresh time.Duration
	log     *slog.Logger
	now     func() time.Time

	mu       sync.Mutex
	finished []Stat
	at       time.Time // when finished was counted (zero: never)
	counting bool
	done     chan struct{} // closed when the running count ends (tests)
}

// NewStatsReader returns a StatsReader of db counting the finished
// deliveries every refresh (FinishedStatsRefresh when <= 0).
func NewStatsReader(db DB, refresh time.Duration, log *slog.Logger) *StatsReader {
	if refresh <= 0 {
		refresh = FinishedStatsRefresh
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &StatsReader{db: db, refresh: refresh, log: log, now: time.Now}
}

// Read returns the open and dead deliveries' stats as of now and the
// finished ones' as of the last count, starting a count when that one is
// older than the refresh. Handlers without deliveries appear with state ""
// and count 0, as in Stats.
func (r *StatsReader) Read(ctx context.Context) ([]Stat, error) {
	open, err := queryStats(ctx, r.db, openStatsSQL)
	if err != nil {
		return nil, err
	}
	r.mu.Lock()
	if !r.counting && (r.at.IsZero() || r.now().Sub(r.at) >= r.refresh) {
		r.counting = true
		r.done = make(chan struct{})
		go r.countFinished(r.done)
	}
	first, done := r.at.IsZero(), r.done
	r.mu.Unlock()
	if first {
		// No count yet (the process's first scrape): a small table's is
		// waited for, a large one's is not (the read serves without it).
		select {
		case <-done:
		case <-time.After(firstCountWait):
		case <-ctx.Done():
		}
	}
	r.mu.Lock()
	finished := r.finished
	r.mu.Unlock()
	defs, err := List(ctx, r.db)
	if err != nil {
		return nil, err
	}
	cursors, err := cursorStats(ctx, r.db, defs)
	if err != nil {
		return nil, err
	}
	return mergeStats(defs, open, cursors, finished), nil
}

// countFinished counts the done and stopped deliveries and keeps the
// result (a failure keeps the last one and is tried again at the next
// read after the refresh).
func (r *StatsReader) countFinished(done chan struct{}) {
	defer close(done)
	ctx, cancel := context.WithTimeout(context.Background(), finishedStatsTimeout)
	defer cancel()
	start := r.now()
	stats, err := queryStats(ctx, r.db, finishedStatsSQL)
	r.mu.Lock()
	defer r.mu.Unlock()
	r.counting = false
	r.at = start
	if err != nil {
		r.log.Warn("counting finished deliveries for the metrics (the last count is kept)", "err", err)
		return
	}
	r.finished = stats
}

// queryStats runs a statement returning (handler, table, state, count,
// oldest age in seconds).
func queryStats(ctx context.Context, db DB, sql string) ([]Stat, error) {
	rows, err := db.Query(ctx, sql)
	if err != nil {
		return nil, fmt.Errorf("delivery stats: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Stat, error) {
		var s Stat
		err := r.Scan(&s.HandlerID, &s.Table, &s.State, &s.Count, &s.OldestSec)
		s.OldestAge = time.Duration(s.OldestSec * float64(time.Second))
		return s, err
	})
	if err != nil {
		return nil, fmt.Errorf("delivery stats: %w", err)
	}
	return out, nil
}

// mergeStats names the stats by their handlers (a delivery of a removed
// handler keeps its table), sums those of one handler and state (a
// cursor handler's pending rows after its cursor and its queued ones),
// adds the handlers without any, and orders them by table, handler and
// state, as Stats does.
func mergeStats(defs []Def, parts ...[]Stat) []Stat {
	byID := map[string]Def{}
	for _, d := range defs {
		byID[d.ID] = d
	}
	seen := map[string]bool{}
	at := map[[2]string]int{}
	var out []Stat
	for _, part := range parts {
		for _, s := range part {
			if d, ok := byID[s.HandlerID]; ok {
				s.Name, s.Table = d.Name, d.QualifiedTable()
			}
			seen[s.HandlerID] = true
			k := [2]string{s.HandlerID, s.State}
			if i, ok := at[k]; ok {
				o := &out[i]
				o.Count += s.Count
				o.AtLeast = o.AtLeast || s.AtLeast
				if s.OldestSec > o.OldestSec {
					o.OldestSec, o.OldestAge = s.OldestSec, s.OldestAge
				}
				continue
			}
			at[k] = len(out)
			out = append(out, s)
		}
	}
	for _, d := range defs {
		if !seen[d.ID] {
			out = append(out, Stat{HandlerID: d.ID, Name: d.Name, Table: d.QualifiedTable()})
		}
	}
	sort.Slice(out, func(i, j int) bool {
		a, b := out[i], out[j]
		if a.Table != b.Table {
			return a.Table < b.Table
		}
		if a.HandlerID != b.HandlerID {
			return a.HandlerID < b.HandlerID
		}
		return a.State < b.State
	})
	return out
}

type collector struct {
	stats         *StatsReader
	log           *slog.Logger
	deliveries    *prometheus.Desc
	oldestPending *prometheus.Desc
}

// NewCollector exports epitaph_projector_deliveries{handler,state} and
// epitaph_projector_delivery_oldest_pending_age_seconds{handler}, read
// from db at each scrape through a StatsReader (the done and stopped
// counts as of its last count, at most FinishedStatsRefresh old); nothing
// when the target cannot be read.
func NewCollector(db DB, log *slog.Logger) prometheus.Collector {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &collector{stats: NewStatsReader(db, FinishedStatsRefresh, log), log: log,
		deliveries: prometheus.NewDesc("epitaph_projector_deliveries",
			"Deliveries of row handlers, by handler and state (done and stopped: as of a count at most 5 minutes old).", []string{"handler", "state"}, nil),
		oldestPending: prometheus.NewDesc("epitaph_projector_delivery_oldest_pending_age_seconds",
			"Age of the oldest pending delivery of a handler (0 when none).", []string{"handler"}, nil),
	}
}

func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.deliveries
	ch <- c.oldestPending
}

func (c *collector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	stats, err := c.stats.Read(ctx)
	if err != nil {
		c.log.Debug("delivery metrics unavailable", "err", err)
		return
	}
	oldest := map[string]float64{}
	for _, s := range stats {
		if _, ok := oldest[s.HandlerID]; !ok {
			oldest[s.HandlerID] = 0
		}
		if s.State == "" {
			continue
		}
		ch <- prometheus.MustNewConstMetric(c.deliveries, prometheus.GaugeValue, float64(s.Count), s.HandlerID, s.State)
		if s.State == StatePending {
			oldest[s.HandlerID] = max(oldest[s.HandlerID], s.OldestSec)
		}
	}
	for h, age := range oldest {
		ch <- prometheus.MustNewConstMetric(c.oldestPending, prometheus.GaugeValue, age, h)
	}
}
