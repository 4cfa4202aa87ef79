package quarantine

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/prometheus/client_golang/prometheus"
)

// Stat is the unresolved quarantine of one projection version.
type Stat struct {
	Projection string
	Version    int
	// Unresolved is the number of open entries; ByCategory splits it.
	Unresolved int
	ByCategory map[Category]int
	// OldestAge is how long the oldest open entry has waited (by the
	// database clock); zero when nothing is open.
	OldestAge time.Duration
}

// Stats returns, per projection version that has ever quarantined an event,
// its unresolved entries and the age of the oldest (zero values once all are
// resolved, so gauges fall back to 0 rather than vanish). A version with
// Unresolved > 0 is in health state "quarantined".
func Stats(ctx context.Context, db Querier) ([]Stat, error) {
	rows, err := db.Query(ctx, `
SELECT projection, version, category,
       count(*) FILTER (WHERE status = 'open'),
       coalesce(extract(epoch FROM now() - min(first_seen) FILTER (WHERE status = 'open')), 0)::float8
FROM epitaph.quarantine
GROUP BY projection, version, category
ORDER BY projection, version, category`)
	if err != nil {
		return nil, fmt.Errorf("quarantine stats: %w", err)
	}
	defer rows.Close()
	var out []Stat
	for rows.Next() {
		var proj, cat string
		var version, n int
		var age float64
		if err := rows.Scan(&proj, &version, &cat, &n, &age); err != nil {
			return nil, fmt.Errorf("quarantine stats: %w", err)
		}
		if len(out) == 0 || out[len(out)-1].Projection != proj || out[len(out)-1].Version != version {
			out = append(out, Stat{Projection: proj, Version: version, ByCategory: map[Category]int{}})
		}
		s := &out[len(out)-1]
		if n > 0 {
			s.Unresolved += n
			s.ByCategory[Category(cat)] = n
		}
		if d := time.Duration(age * float64(time.Second)); d > s.OldestAge {
			s.OldestAge = d
		}
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("quarantine stats: %w", err)
	}
	return out, nil
}

// collector exports Stats at scrape time.
type collector struct {
	db         Querier
	logger     *slog.Logger
	timeout    time.Duration
	unresolved *prometheus.Desc
	oldest     *prometheus.Desc
}

// NewCollector returns a Prometheus collector of
// epitaph_projector_quarantine_unresolved{projection,version} and
// epitaph_projector_quarantine_oldest_age_seconds{projection,version}, read
// from db (a pool) at each scrape. When the table cannot be read (target
// down, not migrated yet) it exports nothing and logs at debug level, so
// /metrics keeps working.
func NewCollector(db Querier, logger *slog.Logger) prometheus.Collector {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	labels := []string{"projection", "version"}
	return &collector{
		db: db, logger: logger, timeout: 5 * time.Second,
		unresolved: prometheus.NewDesc("epitaph_projector_quarantine_unresolved",
			"Open (unresolved) quarantine entries of a projection version.", labels, nil),
		oldest: prometheus.NewDesc("epitaph_projector_quarantine_oldest_age_seconds",
			"Age of the oldest open quarantine entry of a projection version (0 when none).", labels, nil),
	}
}

func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.unresolved
	ch <- c.oldest
}

func (c *collector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), c.timeout)
	defer cancel()
	stats, err := Stats(ctx, c.db)
	if err != nil {
		var pg *pgconn.PgError
		if errors.As(err, &pg) && pg.Code == "42P01" {
			return // not migrated yet
		}
		c.logger.Debug("quarantine metrics unavailable", "err", Sanitize(err))
		return
	}
	for _, s := range stats {
		v := strconv.Itoa(s.Version)
		ch <- prometheus.MustNewConstMetric(c.unresolved, prometheus.GaugeValue, float64(s.Unresolved), s.Projection, v)
		ch <- prometheus.MustNewConstMetric(c.oldest, prometheus.GaugeValue, s.OldestAge.Seconds(), s.Projection, v)
	}
}
