package snapshot

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/epitaph-dev/epitaph/internal/startstop"
)

// DB is what the Batcher needs: a *pgxpool.Pool.
type DB interface {
	Beginner
	Querier
}

// BatcherConfig configures the background snapshot batcher.
type BatcherConfig struct {
	// Batch is the per-batch configuration. Batch.Schema is the schema
	// worked on when Schemas is nil.
	Batch Config
	// Schemas, when set, lists the version schemas to work on at each tick
	// (every version of the archive projection that has a snapshots
	// table), so versions built side by side all get their snapshots.
	Schemas func(ctx context.Context) ([]string, error)
	// Interval between ticks when there is nothing to do. A tick runs
	// batches until one claims fewer than BatchSize jobs. Default 1s.
	Interval time.Duration
	// StatsInterval is how often job counts are read for the metrics (a
	// count over the table). Default 15s.
	StatsInterval time.Duration
	Logger        *slog.Logger
	// Registerer receives epitaph_projector_snapshot_jobs{status} and
	// epitaph_projector_snapshot_oldest_pending_age_seconds; nil registers
	// nothing.
	Registerer prometheus.Registerer
}

func (c *BatcherConfig) setDefaults() {
	c.Batch.setDefaults()
	if c.Interval == 0 {
		c.Interval = time.Second
	}
	if c.StatsInterval == 0 {
		c.StatsInterval = 15 * time.Second
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
}

func (c *BatcherConfig) validate() error {
	if c.Schemas == nil && c.Batch.Schema == "" {
		return errors.New("snapshot batcher config: Batch.Schema or Schemas is required")
	}
	if c.Interval < 0 || c.StatsInterval < 0 {
		return errors.New("snapshot batcher config: intervals must be positive")
	}
	probe := c.Batch
	if probe.Schema == "" {
		probe.Schema = "probe"
	}
	return probe.validate()
}

// Batcher runs RunBatch on an interval over one or more version schemas
// and exports the job metrics. It is a service (internal/startstop):
// Start, then Stop.
type Batcher struct {
	db  DB
	cfg BatcherConfig

	jobs   *prometheus.GaugeVec
	oldest prometheus.GaugeFunc

	mu        sync.Mutex
	stats     Stats
	statsAt   time.Time // local time the stats were read
	statsRead bool

	ss startstop.Base
}

// NewBatcher builds a batcher and registers its metrics.
func NewBatcher(db DB, cfg BatcherConfig) (*Batcher, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	b := &Batcher{db: db, cfg: cfg}
	b.jobs = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "epitaph_projector_snapshot_jobs",
		Help: "Snapshot jobs by status (pending, complete, failed), summed over the version schemas this batcher serves.",
	}, []string{"status"})
	for _, s := range []string{StatusPending, StatusComplete, StatusFailed} {
		b.jobs.WithLabelValues(s)
	}
	b.oldest = prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "epitaph_projector_snapshot_oldest_pending_age_seconds",
		Help: "Age of the oldest pending snapshot job (since created or invalidated); 0 when none is pending.",
	}, func() float64 { return b.Stats().OldestPendingAge.Seconds() })
	if cfg.Registerer != nil {
		for _, c := range []prometheus.Collector{b.jobs, b.oldest} {
			if err := cfg.Registerer.Register(c); err != nil {
				return nil, fmt.Errorf("register snapshot metrics: %w", err)
			}
		}
	}
	return b, nil
}

// Start runs the batcher in the background until Stop or until ctx is
// cancelled (a hard stop: the batch in flight is rolled back and its jobs
// stay pending).
func (b *Batcher) Start(ctx context.Context) error {
	soft, hard, ok := b.ss.StartInit(ctx)
	if !ok {
		return errors.New("snapshot batcher already started")
	}
	go b.loop(soft, hard)
	return nil
}

// Stop is the soft stop: it lets the batch in flight commit, then returns;
// when ctx ends first, the batch is rolled back (the hard stop).
func (b *Batcher) Stop(ctx context.Context) error { return b.ss.Stop(ctx) }

// Wait blocks until the batcher has stopped.
func (b *Batcher) Wait() error { return b.ss.Wait() }

// Stats returns the job counts last read, with the oldest pending age
// advanced to now.
func (b *Batcher) Stats() Stats {
	b.mu.Lock()
	defer b.mu.Unlock()
	s := b.stats
	if s.Pending > 0 {
		s.OldestPendingAge += b.cfg.Batch.Clock().Sub(b.statsAt)
	}
	return s
}

func (b *Batcher) stopping() bool { return b.ss.StopRequested() }

// loop runs ticks until soft is done; batches run on ctx (the hard stop).
func (b *Batcher) loop(soft, ctx context.Context) {
	defer b.ss.Finish(nil)
	log := b.cfg.Logger.With("component", "snapshot-batcher")
	timer := time.NewTimer(0)
	defer timer.Stop()
	// Transient failures (database down): back off with jitter, up to a
	// minute.
	bo := backoff.NewExponentialBackOff()
	bo.InitialInterval = 2 * b.cfg.Interval
	bo.MaxInterval = max(time.Minute, bo.InitialInterval)
	bo.MaxElapsedTime = 0 // never backoff.Stop
	bo.Reset()
	for {
		select {
		case <-soft.Done():
			return
		case <-timer.C:
		}
		err := b.tick(ctx)
		wait := b.cfg.Interval
		if err != nil && ctx.Err() == nil {
			wait = bo.NextBackOff()
			log.Warn("snapshot batch failed; retrying", "err", err, "retry_in", wait)
		} else {
			bo.Reset()
		}
		timer.Reset(wait)
	}
}

// tick runs batches on every schema until each is drained, then refreshes
// the stats when due.
func (b *Batcher) tick(ctx context.Context) error {
	schemas := []string{b.cfg.Batch.Schema}
	if b.cfg.Schemas != nil {
		var err error
		if schemas, err = b.cfg.Schemas(ctx); err != nil {
			return fmt.Errorf("list snapshot schemas: %w", err)
		}
	}
	var errs []error
	for _, schema := range schemas {
		cfg := b.cfg.Batch
		cfg.Schema = schema
		for !b.stopping() {
			res, err := RunBatch(ctx, b.db, cfg)
			if err != nil {
				errs = append(errs, fmt.Errorf("snapshot batch on %s: %w", schema, err))
				break
			}
			if res.Claimed > 0 {
				b.cfg.Logger.Debug("snapshot batch", "schema", schema, "claimed", res.Claimed,
					"completed", res.Completed, "retried", res.Retried, "failed", res.Failed)
			}
			if res.Claimed < cfg.BatchSize {
				break
			}
		}
	}
	b.mu.Lock()
	due := !b.statsRead || b.cfg.Batch.Clock().Sub(b.statsAt) >= b.cfg.StatsInterval
	b.mu.Unlock()
	if due {
		if err := b.refreshStats(ctx, schemas); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// RefreshStats reads the job counts now (the batcher does it every
// StatsInterval).
func (b *Batcher) RefreshStats(ctx context.Context) error {
	schemas := []string{b.cfg.Batch.Schema}
	if b.cfg.Schemas != nil {
		var err error
		if schemas, err = b.cfg.Schemas(ctx); err != nil {
			return fmt.Errorf("list snapshot schemas: %w", err)
		}
	}
	return b.refreshStats(ctx, schemas)
}

func (b *Batcher) refreshStats(ctx context.Context, schemas []string) error {
	var total Stats
	for _, schema := range schemas {
		s, err := GetStats(ctx, b.db, schema)
		if err != nil {
			return err
		}
		total = total.Add(s)
	}
	b.mu.Lock()
	b.stats, b.statsAt, b.statsRead = total, b.cfg.Batch.Clock(), true
	b.mu.Unlock()
	b.jobs.WithLabelValues(StatusPending).Set(float64(total.Pending))
	b.jobs.WithLabelValues(StatusComplete).Set(float64(total.Complete))
	b.jobs.WithLabelValues(StatusFailed).Set(float64(total.Failed))
	return nil
}
