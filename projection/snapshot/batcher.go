package snapshot

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
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

// Target is one version schema the batcher serves.
type Target struct {
	// Schema is the version schema, e.g. "archive_v2".
	Schema string
	// Projection and Version label the target's metrics.
	Projection string
	Version    int
	// Live: the version readers are served from. Its jobs are assembled
	// before any other version's.
	Live bool
}

// targetOf is the target of a schema named archive_v<N> (or any other
// name, version 0) for the Schemas and Batch.Schema forms of the config.
func targetOf(schema string) Target {
	t := Target{Schema: schema, Projection: "archive"}
	if i := strings.LastIndex(schema, "_v"); i >= 0 {
		if n, err := strconv.Atoi(schema[i+2:]); err == nil {
			t.Version = n
		}
	}
	return t
}

// BatcherConfig configures the background snapshot batcher.
type BatcherConfig struct {
	// Batch is the per-batch configuration. Batch.Schema is the schema
	// worked on when neither Targets nor Schemas is set.
	Batch Config
	// Targets, when set, lists the version schemas to work on (every
	// version of the archive projection that has a snapshots table), so
	// versions built side by side all get their snapshots; the live one is
	// served first. It is called at every tick and every stats refresh.
	Targets func(ctx context.Context) ([]Target, error)
	// Schemas is Targets for callers that only know schema names
	// (archive_v<N> gives version N; none is live).
	Schemas func(ctx context.Context) ([]string, error)
	// Interval between ticks when there is nothing to do. A tick runs
	// batches until every schema is drained. Wake starts one at once.
	// Default 1s.
	Interval time.Duration
	// StatsInterval is how often job counts are read for the metrics (a
	// count over each table), on a timer of its own: a long drain never
	// freezes them. Default 15s.
	StatsInterval time.Duration
	Logger        *slog.Logger
	// Registerer receives epitaph_projector_snapshot_jobs{projection,
	// version, status} and
	// epitaph_projector_snapshot_oldest_pending_age_seconds{projection,
	// version}; nil registers nothing.
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
	if c.Targets == nil && c.Schemas == nil && c.Batch.Schema == "" {
		return errors.New("snapshot batcher config: Batch.Schema, Schemas or Targets is required")
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

	mu      sync.Mutex
	stats   map[Target]Stats // by target, as last read
	statsAt time.Time        // clock time the stats were read

	ss   startstop.Base
	wake chan struct{}
}

var (
	jobsDesc = prometheus.NewDesc("epitaph_projector_snapshot_jobs",
		"Snapshot jobs by status (pending, complete, failed) per projection version.",
		[]string{"projection", "version", "status"}, nil)
	oldestDesc = prometheus.NewDesc("epitaph_projector_snapshot_oldest_pending_age_seconds",
		"Age of the oldest pending snapshot job of the projection version (since created or invalidated); 0 when none is pending.",
		[]string{"projection", "version"}, nil)
)

// NewBatcher builds a batcher and registers its metrics.
func NewBatcher(db DB, cfg BatcherConfig) (*Batcher, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	b := &Batcher{db: db, cfg: cfg, wake: make(chan struct{}, 1)}
	if cfg.Registerer != nil {
		if err := cfg.Registerer.Register(batcherCollector{b}); err != nil {
			return nil, fmt.Errorf("register snapshot metrics: %w", err)
		}
	}
	return b, nil
}

// batcherCollector exports the stats last read, the oldest pending age
// advanced to the time of the scrape.
type batcherCollector struct{ b *Batcher }

func (c batcherCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- jobsDesc
	ch <- oldestDesc
}

func (c batcherCollector) Collect(ch chan<- prometheus.Metric) {
	for t, s := range c.b.TargetStats() {
		v := strconv.Itoa(t.Version)
		for status, n := range map[string]int64{StatusPending: s.Pending, StatusComplete: s.Complete, StatusFailed: s.Failed} {
			ch <- prometheus.MustNewConstMetric(jobsDesc, prometheus.GaugeValue, float64(n), t.Projection, v, status)
		}
		ch <- prometheus.MustNewConstMetric(oldestDesc, prometheus.GaugeValue, s.OldestPendingAge.Seconds(), t.Projection, v)
	}
}

// Start runs the batcher in the background until Stop or until ctx is
// cancelled (a hard stop: the batch in flight is rolled back and its jobs
// stay pending).
func (b *Batcher) Start(ctx context.Context) error {
	soft, hard, ok := b.ss.StartInit(ctx)
	if !ok {
		return errors.New("snapshot batcher already started")
	}
	statsDone := make(chan struct{})
	go func() {
		defer close(statsDone)
		b.statsLoop(soft, hard)
	}()
	go func() {
		b.loop(soft, hard)
		<-statsDone
		b.ss.Finish(nil)
	}()
	return nil
}

// Stop is the soft stop: it lets the batch in flight commit, then returns;
// when ctx ends first, the batch is rolled back (the hard stop).
func (b *Batcher) Stop(ctx context.Context) error { return b.ss.Stop(ctx) }

// Wait blocks until the batcher has stopped.
func (b *Batcher) Wait() error { return b.ss.Wait() }

// Wake makes the batcher start a tick now instead of at the end of its
// interval (the projector calls it after committing pending jobs). It
// never blocks.
func (b *Batcher) Wake() {
	select {
	case b.wake <- struct{}{}:
	default:
	}
}

// Stats returns the job counts last read, summed over the targets, with
// the oldest pending age advanced to now.
func (b *Batcher) Stats() Stats {
	var total Stats
	for _, s := range b.TargetStats() {
		total = total.Add(s)
	}
	return total
}

// TargetStats returns the job counts last read per target, with the
// oldest pending ages advanced to now.
func (b *Batcher) TargetStats() map[Target]Stats {
	b.mu.Lock()
	defer b.mu.Unlock()
	out := make(map[Target]Stats, len(b.stats))
	since := b.cfg.Batch.Clock().Sub(b.statsAt)
	for t, s := range b.stats {
		if s.Pending > 0 {
			s.OldestPendingAge += since
		}
		out[t] = s
	}
	return out
}

func (b *Batcher) stopping() bool { return b.ss.StopRequested() }

// loop runs ticks until soft is done; batches run on ctx (the hard stop).
func (b *Batcher) loop(soft, ctx context.Context) {
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
		case <-b.wake:
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

// statsLoop refreshes the stats every StatsInterval, from the start,
// whatever the drain is doing. Until a refresh has found a version (a
// first start creates version 1 a moment later), it tries every Interval.
func (b *Batcher) statsLoop(soft, ctx context.Context) {
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-soft.Done():
			return
		case <-t.C:
		}
		err := b.RefreshStats(ctx)
		if err != nil && ctx.Err() == nil {
			b.cfg.Logger.Warn("read snapshot stats; retrying", "component", "snapshot-batcher", "err", err)
		}
		wait := b.cfg.StatsInterval
		b.mu.Lock()
		if err != nil || len(b.stats) == 0 {
			wait = min(wait, b.cfg.Interval)
		}
		b.mu.Unlock()
		t.Reset(wait)
	}
}

// targets lists the targets, the live ones first.
func (b *Batcher) targets(ctx context.Context) ([]Target, error) {
	var ts []Target
	switch {
	case b.cfg.Targets != nil:
		var err error
		if ts, err = b.cfg.Targets(ctx); err != nil {
			return nil, fmt.Errorf("list snapshot schemas: %w", err)
		}
	case b.cfg.Schemas != nil:
		schemas, err := b.cfg.Schemas(ctx)
		if err != nil {
			return nil, fmt.Errorf("list snapshot schemas: %w", err)
		}
		for _, s := range schemas {
			ts = append(ts, targetOf(s))
		}
	default:
		ts = []Target{targetOf(b.cfg.Batch.Schema)}
	}
	slices.SortStableFunc(ts, func(x, y Target) int {
		switch {
		case x.Live == y.Live:
			return 0
		case x.Live:
			return -1
		}
		return 1
	})
	return ts, nil
}

// tick runs batches until every target is drained. The live version is
// drained first, and again between any two batches of another version,
// so a rebuild's backlog never delays the documents readers are served.
func (b *Batcher) tick(ctx context.Context) error {
	targets, err := b.targets(ctx)
	if err != nil {
		return err
	}
	var errs []error
	failed := map[string]bool{}
	run := func(t Target) (full bool) {
		cfg := b.cfg.Batch
		cfg.Schema = t.Schema
		res, err := RunBatch(ctx, b.db, cfg)
		if err != nil {
			errs = append(errs, fmt.Errorf("snapshot batch on %s: %w", t.Schema, err))
			failed[t.Schema] = true
			return false
		}
		if res.Claimed > 0 {
			b.cfg.Logger.Debug("snapshot batch", "schema", t.Schema, "claimed", res.Claimed,
				"completed", res.Completed, "retried", res.Retried, "failed", res.Failed)
		}
		return res.Claimed >= cfg.BatchSize
	}
	drainLive := func() {
		for _, t := range targets {
			for t.Live && !failed[t.Schema] && !b.stopping() && run(t) {
			}
		}
	}
	drainLive()
	for busy := true; busy && !b.stopping() && ctx.Err() == nil; {
		busy = false
		for _, t := range targets {
			if t.Live || failed[t.Schema] || b.stopping() {
				continue
			}
			if run(t) {
				busy = true
				drainLive() // what the live version got meanwhile comes first
			}
		}
	}
	return errors.Join(errs...)
}

// RefreshStats reads the job counts of every target now (the batcher does
// it every StatsInterval).
func (b *Batcher) RefreshStats(ctx context.Context) error {
	targets, err := b.targets(ctx)
	if err != nil {
		return err
	}
	stats := make(map[Target]Stats, len(targets))
	for _, t := range targets {
		s, err := GetStats(ctx, b.db, t.Schema)
		if err != nil {
			return err
		}
		stats[t] = s
	}
	b.mu.Lock()
	b.stats, b.statsAt = stats, b.cfg.Batch.Clock()
	b.mu.Unlock()
	return nil
}
