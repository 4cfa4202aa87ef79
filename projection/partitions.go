package projection

import (
	"context"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/version"
	"github.com/epitaph-dev/epitaph/quarantine"
)

// partitionCache remembers, per version schema, the periods this worker
// has made sure have a partition, so a page whose rows fall in known
// periods costs no query, and the periods it failed to make, so they are
// tried again on a later page even when that page has no row of theirs
// (their rows wait in the default partition until then).
type partitionCache struct {
	mu    sync.Mutex
	known map[string]map[time.Time]bool
	// owed: periods a failed attempt did not make.
	owed map[string]map[time.Time]bool
	// swept: schemas whose default partition this worker has read for
	// rows of periods without a partition (left there by a failed attempt
	// of this or another worker, or of one that stopped before its retry).
	swept map[string]bool
	// failed: when making a schema's partitions last failed, and how many
	// attempts in a row have; the pages of the backoff that follows do
	// not try again (each try may wait out its lock timeout behind a long
	// reader).
	failed map[string]partitionFailure
}

type partitionFailure struct {
	at    time.Time
	tries int
}

// Partitions not made are tried again after partitionRetryMin, doubling
// per failure in a row up to partitionRetryMax: a lock held for a moment
// costs a second, a reader holding the table for hours one try a minute.
const (
	partitionRetryMin = time.Second
	partitionRetryMax = time.Minute
)

func (f partitionFailure) retryIn() time.Duration {
	d := partitionRetryMin
	for i := 1; i < f.tries && d < partitionRetryMax; i++ {
		d *= 2
	}
	return min(d, partitionRetryMax)
}

func (c *partitionCache) backingOff(schema string, now time.Time) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	f, ok := c.failed[schema]
	return ok && now.Sub(f.at) < f.retryIn()
}

// fail records a failed attempt at making need, and returns when the
// next attempt may be.
func (c *partitionCache) fail(schema string, need []time.Time, now time.Time) time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.failed == nil {
		c.failed = map[string]partitionFailure{}
	}
	f := c.failed[schema]
	f.at, f.tries = now, f.tries+1
	c.failed[schema] = f
	c.owe(schema, need)
	return f.retryIn()
}

// needsSweep reports whether schema's default partition is still to be
// read by this worker.
func (c *partitionCache) needsSweep(schema string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return !c.swept[schema]
}

// swept records that schema's default partition was read, and owes the
// periods of the rows found there.
func (c *partitionCache) sweep(schema string, periods []time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.swept == nil {
		c.swept = map[string]bool{}
	}
	c.swept[schema] = true
	c.owe(schema, periods)
}

// owe records periods as still to be made for schema; c.mu is held.
func (c *partitionCache) owe(schema string, periods []time.Time) {
	if c.owed == nil {
		c.owed = map[string]map[time.Time]bool{}
	}
	if c.owed[schema] == nil {
		c.owed[schema] = map[time.Time]bool{}
	}
	for _, t := range periods {
		c.owed[schema][t] = true
	}
}

// missing returns the periods of starts, and those owed by an earlier
// failure, that are not known to have a partition.
func (c *partitionCache) missing(schema string, starts []time.Time) []time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []time.Time
	seen := map[time.Time]bool{}
	for _, t := range starts {
		if !c.known[schema][t] && !seen[t] {
			seen[t] = true
			out = append(out, t)
		}
	}
	for t := range c.owed[schema] {
		if !c.known[schema][t] && !seen[t] {
			seen[t] = true
			out = append(out, t)
		}
	}
	return out
}

// add records made as having a partition, after an attempt that made
// every period it tried: the schema's backoff is over.
func (c *partitionCache) add(schema string, made []time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.known == nil {
		c.known = map[string]map[time.Time]bool{}
	}
	if c.known[schema] == nil {
		c.known[schema] = map[time.Time]bool{}
	}
	for _, t := range made {
		c.known[schema][t] = true
		delete(c.owed[schema], t)
	}
	delete(c.failed, schema)
}

// ensurePartitions makes the partitions of the periods holding the rows'
// commit times (and of the current and next period), in a short
// transaction of its own before the apply: the apply never creates tables
// (that would lock the rows table for the whole page) and never fails for
// want of a partition: when this fails (logged), the rows go to the
// default partition and are moved to their own when it is made later.
func (s *Service) ensurePartitions(ctx context.Context, v version.Version, rows []*archiveRow) {
	now := s.now()
	cur := archive.PeriodStart(v.Period, now)
	starts := []time.Time{cur, archive.PeriodEnd(v.Period, cur)}
	seen := map[time.Time]bool{starts[0]: true, starts[1]: true}
	for _, r := range rows {
		if r.ev == nil || r.ev.CommitTime.IsZero() {
			continue
		}
		t := archive.PeriodStart(v.Period, r.ev.CommitTime)
		if !seen[t] {
			seen[t] = true
			starts = append(starts, t)
		}
	}
	if s.partitionsKnown.needsSweep(v.Schema) {
		if periods, err := strayPeriods(ctx, s.pool, v); err == nil {
			s.partitionsKnown.sweep(v.Schema, periods)
		} else if ctx.Err() == nil {
			s.log.Warn("reading the archive's default partition failed; trying again on the next page", "schema", v.Schema,
				"err", quarantine.Sanitize(err))
		}
	}
	need := s.partitionsKnown.missing(v.Schema, starts)
	if len(need) == 0 || s.partitionsKnown.backingOff(v.Schema, now) {
		return
	}
	var made []time.Time
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		// A partition is created under a brief lock of the rows table:
		// never wait on readers for long, the rows can go to the default.
		if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '2s'`); err != nil {
			return err
		}
		var err error
		made, err = archive.EnsurePartitions(ctx, tx, v.Schema, v.Period, need...)
		return err
	})
	if err != nil {
		if ctx.Err() == nil {
			retry := s.partitionsKnown.fail(v.Schema, need, now)
			s.log.Warn("archive partitions not created; rows go to the default partition meanwhile", "schema", v.Schema,
				"retry_in", retry, "err", quarantine.Sanitize(err))
		}
		return
	}
	if len(made) == 0 { // not partitioned: nothing to make, ever
		made = need
	}
	s.partitionsKnown.add(v.Schema, made)
}

// strayPeriods returns the periods (their starts) of the rows in v's
// default partition that have a commit time: rows that went there while
// their partition could not be made. A worker reads them once per schema
// (the default partition is empty or small), so that rows a failed attempt
// left behind are moved even when the worker that owed them stopped. None
// for a rows table that is not partitioned.
func strayPeriods(ctx context.Context, pool *pgxpool.Pool, v version.Version) ([]time.Time, error) {
	def := archive.Ident(v.Schema, archive.DefaultPartition)
	var exists bool
	if err := pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, def).Scan(&exists); err != nil || !exists {
		return nil, err
	}
	unit := map[string]string{archive.PeriodDay: "day", archive.PeriodWeek: "week"}[v.Period]
	if unit == "" {
		unit = "month"
	}
	rows, err := pool.Query(ctx, `SELECT DISTINCT date_trunc('`+unit+`', commit_time AT TIME ZONE 'UTC') FROM `+def+`
		WHERE commit_time IS NOT NULL`)
	if err != nil {
		return nil, err
	}
	var out []time.Time
	var t time.Time
	if _, err := pgx.ForEachRow(rows, []any{&t}, func() error {
		out = append(out, archive.PeriodStart(v.Period, time.Date(t.Year(), t.Month(), t.Day(), 0, 0, 0, 0, time.UTC)))
		return nil
	}); err != nil {
		return nil, err
	}
	return out, nil
}
