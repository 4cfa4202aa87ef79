package projection_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/projection/status"
)

// With no worker running, the status says so: lag in events and age of the
// oldest pending event per partition, unowned partitions, health
// "unavailable". While a worker runs, the metrics carry the same figures.
func TestStatusLagAndMetrics(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	s := e.start(e.config("w1"))
	for i := 0; i < 6; i++ {
		e.publish(e.nextTx(orderRows(i+1, 1)...))
	}
	c := e.conn()
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 12 })
	eventually(t, 10*time.Second, func() bool {
		return metricSum(t, s, "epitaph_projector_partitions_owned") == 2 &&
			metricSum(t, s, "epitaph_projector_applied_events_total") == 18 &&
			metricSum(t, s, "epitaph_projector_lag_events") == 0
	})
	require.Equal(t, 1.0, metricSum(t, s, "epitaph_projector_version_state"))
	require.NoError(t, s.Stop(context.Background()))

	published := time.Now()
	for i := 0; i < 4; i++ {
		e.publish(e.nextTx(orderRows(100+i, 1)...))
	}
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, e.url)
	require.NoError(t, err)
	defer pool.Close()
	// Ages are measured against the clock given: ten seconds later.
	st, err := status.CollectStatus(ctx, pool, e.js, src, published.Add(10*time.Second))
	require.NoError(t, err)
	require.Len(t, st.Versions, 1)
	v := st.Versions[0]
	require.Equal(t, "live", v.State)
	require.Equal(t, "unavailable", v.Health, "no worker holds the partitions")
	require.Equal(t, uint64(12), v.LagEvents)
	require.InDelta(t, 10, v.OldestPendingAgeSeconds, 1)
	for _, p := range v.Partitions {
		require.False(t, p.Leased)
		if p.LagEvents > 0 {
			require.NotNil(t, p.OldestPendingAt)
			require.Equal(t, p.OldestPendingAgeSeconds, p.LagSeconds)
		}
	}
	require.Equal(t, uint64(30), st.StreamLast)
	require.Equal(t, 2, st.Partitions)

	b, err := json.Marshal(st)
	require.NoError(t, err)
	require.Contains(t, string(b), `"lag_events":12`)

	// A new worker catches up: lag back to zero, health back to live.
	s2 := e.start(e.config("w2"))
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 20 })
	eventually(t, 10*time.Second, func() bool {
		st, err := s2.Status(ctx)
		return err == nil && st.Versions[0].Health == "live" && st.Versions[0].LagEvents == 0
	})
}
