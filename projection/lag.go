package projection

import (
	"context"
	"fmt"
	"time"

	"github.com/epitaph-dev/epitaph/projection/status"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// recordLag writes the lag of the partitions this worker leases, as st
// measured it from the stream, for archive.status (the database cannot see
// the stream). A sample is believed for three status intervals and only
// under the lease epoch it was measured in: a worker that stops sampling,
// or a new lease not yet sampled (a restart over a backlog), makes the
// partition's lag unknown, never "caught up". Nothing is written when the
// stream could not be read.
func (s *Service) recordLag(ctx context.Context, st *status.Status) error {
	if st.StreamError != "" {
		return nil
	}
	var projs []string
	var vers, parts []int32
	var lags, epochs []int64
	var oldest []*time.Time
	for _, v := range st.Versions {
		if v.State == version.StateRetired {
			continue
		}
		for _, p := range v.Partitions {
			if !p.Leased || p.Owner != s.cfg.WorkerID {
				continue
			}
			projs, vers, parts = append(projs, v.Projection), append(vers, int32(v.Version)), append(parts, int32(p.Partition))
			lags, oldest = append(lags, int64(p.LagEvents)), append(oldest, p.OldestPendingAt)
			epochs = append(epochs, p.Epoch)
		}
	}
	if len(projs) == 0 {
		return nil
	}
	fresh := 3 * s.cfg.StatusInterval
	if _, err := s.pool.Exec(ctx, recordLagSQL, projs, vers, parts, lags, oldest, fresh.Microseconds(),
		int64(s.cfg.ReadyMaxLag), s.cfg.ReadyMaxPendingAge.Seconds(), epochs); err != nil {
		return fmt.Errorf("record lag of %d partitions: %w", len(projs), err)
	}
	return nil
}

const recordLagSQL = `
INSERT INTO epitaph.partition_lag AS l (projection, version, partition, lag_events, oldest_pending_at,
    sampled_at, fresh_until, max_lag_events, max_pending_seconds, epoch)
SELECT u.projection, u.version, u.partition, u.lag, u.oldest, now(), now() + $6::bigint * interval '1 microsecond', $7, $8, u.epoch
FROM unnest($1::text[], $2::int[], $3::int[], $4::bigint[], $5::timestamptz[], $9::bigint[])
    AS u(projection, version, partition, lag, oldest, epoch)
ON CONFLICT (projection, version, partition) DO UPDATE
SET lag_events = EXCLUDED.lag_events, oldest_pending_at = EXCLUDED.oldest_pending_at, sampled_at = EXCLUDED.sampled_at,
    fresh_until = EXCLUDED.fresh_until, max_lag_events = EXCLUDED.max_lag_events,
    max_pending_seconds = EXCLUDED.max_pending_seconds, epoch = EXCLUDED.epoch`
