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
// periods costs no query.
type partitionCache struct {
	mu    sync.Mutex
	known map[string]map[time.Time]bool
	// failed: when making a schema's partitions last failed; the pages
	// of the next partitionRetry do not try again (each try may wait out
	// its lock timeout behind a long reader).
	failed map[string]time.Time
}

// partitionRetry is how long after a failed attempt partitions are not
// tried again (rows meanwhile go to the default partition).
const partitionRetry = time.Minute

func (c *partitionCache) backingOff(schema string, now time.Time) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	t, ok := c.failed[schema]
	return ok && now.Sub(t) < partitionRetry
}

func (c *partitionCache) fail(schema string, now time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.failed == nil {
		c.failed = map[string]time.Time{}
	}
	c.failed[schema] = now
}

func (c *partitionCache) missing(schema string, starts []time.Time) []time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []time.Time
	for _, t := range starts {
		if !c.known[schema][t] {
			out = append(out, t)
		}
	}
	return out
}

func (c *partitionCache) add(schema string, starts []time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.known == nil {
		c.known = map[string]map[time.Time]bool{}
	}
	if c.known[schema] == nil {
		c.known[schema] = map[time.Time]bool{}
	}
	for _, t := range starts {
		c.known[schema][t] = true
	}
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
			s.partitionsKnown.fail(v.Schema, now)
			s.log.Warn("archive partitions not created; rows go to the default partition meanwhile", "schema", v.Schema,
				"retry_in", partitionRetry, "err", quarantine.Sanitize(err))
		}
		return
	}
	if len(made) == 0 { // not partitioned: nothing to make, ever
		made = need
	}
	s.partitionsKnown.add(v.Schema, made)
}
