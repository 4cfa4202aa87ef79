package handler

import (
	"context"
	"fmt"
	"log/slog"
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
	}
	if reg == nil {
		return m, nil
	}
	for _, c := range []prometheus.Collector{m.attempts, m.duration, m.dead, m.reclaimed, m.stale, m.alone, NewCollector(db, log)} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("register delivery metrics: %w", err)
		}
	}
	return m, nil
}

func (m *metrics) observe(def Def, outcome string, d time.Duration) {
	m.attempts.WithLabelValues(def.ID, outcome).Inc()
	m.duration.WithLabelValues(def.ID).Observe(d.Seconds())
}

// Stat is one handler's deliveries in one state.
type Stat struct {
	HandlerID string `json:"handler_id"`
	Name      string `json:"name,omitempty"`
	Table     string `json:"table"`
	State     string `json:"state"`
	Count     int64  `json:"count"`
	// OldestAge: of the oldest delivery in this state (pending: the
	// backlog's age).
	OldestAge time.Duration `json:"-"`
	OldestSec float64       `json:"oldest_age_seconds"`
}

// Stats counts deliveries by handler and state (handlers with none appear
// with state "" and count 0).
func Stats(ctx context.Context, db DB) ([]Stat, error) {
	rows, err := db.Query(ctx, `
		SELECT d.handler_id::text, COALESCE(h.name, ''), COALESCE(h.schema_name || '.' || h.table_name, d.schema_name || '.' || d.table_name),
		       d.state, count(*), COALESCE(extract(epoch FROM now() - min(d.created_at)), 0)::float8
		FROM epitaph.deliveries d LEFT JOIN epitaph.handlers h ON h.id = d.handler_id
		GROUP BY 1, 2, 3, 4
		UNION ALL
		SELECT h.id::text, COALESCE(h.name, ''), h.schema_name || '.' || h.table_name, '', 0, 0
		FROM epitaph.handlers h WHERE NOT EXISTS (SELECT 1 FROM epitaph.deliveries d WHERE d.handler_id = h.id)
		ORDER BY 3, 1, 4`)
	if err != nil {
		return nil, fmt.Errorf("delivery stats: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Stat, error) {
		var s Stat
		err := r.Scan(&s.HandlerID, &s.Name, &s.Table, &s.State, &s.Count, &s.OldestSec)
		s.OldestAge = time.Duration(s.OldestSec * float64(time.Second))
		return s, err
	})
	if err != nil {
		return nil, fmt.Errorf("delivery stats: %w", err)
	}
	return out, nil
}

type collector struct {
	db            DB
	log           *slog.Logger
	deliveries    *prometheus.Desc
	oldestPending *prometheus.Desc
}

// NewCollector exports epitaph_projector_deliveries{handler,state} and
// epitaph_projector_delivery_oldest_pending_age_seconds{handler}, read
// from db at each scrape; nothing when the target cannot be read.
func NewCollector(db DB, log *slog.Logger) prometheus.Collector {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &collector{db: db, log: log,
		deliveries: prometheus.NewDesc("epitaph_projector_deliveries",
			"Deliveries of row handlers, by handler and state.", []string{"handler", "state"}, nil),
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
	stats, err := Stats(ctx, c.db)
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
			oldest[s.HandlerID] = s.OldestSec
		}
	}
	for h, age := range oldest {
		ch <- prometheus.MustNewConstMetric(c.oldestPending, prometheus.GaugeValue, age, h)
	}
}
