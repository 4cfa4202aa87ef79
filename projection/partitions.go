package projection

import (
	"context"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

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
		c.owed = map[string]map[time.Time]bool{}
	}
	f := c.failed[schema]
	f.at, f.tries = now, f.tries+1
	c.failed[schema] = f
	if c.owed[schema] == nil {
		c.owed[schema] = map[time.Time]bool{}
	}
	for _, t := range need {
		c.owed[schema][t] = true
	}
	return f.retryIn()
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
