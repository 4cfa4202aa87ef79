package projection_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/projection"
)

// A worker that cannot work (its broker is unreachable, so it claims
// nothing) must not count as a live worker in the fair share: otherwise a
// healthy worker gives half its partitions back and nobody takes them.
func TestWorkerWithoutNATSLeavesNoPartitionUnowned(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	a := e.start(e.config("a"))
	eventually(t, 10*time.Second, func() bool { return len(owned(a)) == 2 })
	cfg := e.config("broken")
	cfg.NATSURL = "nats://127.0.0.1:1" // nothing listens: the worker retries forever
	e.start(cfg)
	c := e.conn()
	time.Sleep(3 * time.Second) // a few balance rounds of both
	deadline := time.Now().Add(8 * time.Second)
	for time.Now().Before(deadline) {
		n := count(t, c, `SELECT count(*) FROM epitaph.progress WHERE owner IS NOT NULL AND lease_expires_at > now()`)
		require.Equal(t, 2, n, "every partition has an owner (a owns %v)", owned(a))
		time.Sleep(200 * time.Millisecond)
	}
}

// metricSeries counts the series of a metric family.
func metricSeries(t *testing.T, s *projection.Service, name string) int {
	t.Helper()
	mfs, err := s.Registry().Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() == name {
			return len(mf.GetMetric())
		}
	}
	return 0
}

// While the status cannot be collected (the target is down), the lag
// gauges must not keep saying "caught up": an unknown lag has no series,
// never a 0 nobody measured. Events pile up in the stream meanwhile.
func TestLagMetricsNotFrozenAtZeroWhileStatusFails(t *testing.T) {
	t.Parallel()
	pg := testenv.NewPostgres(t)
	e := newEnvWith(t, pg.NewDatabase(t), 2)
	s := e.start(e.config("w1"))
	e.publish(e.nextTx(orderRows(1, 1)...))
	c := e.conn()
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 2 })
	eventually(t, 10*time.Second, func() bool {
		return metricSeries(t, s, "epitaph_projector_lag_events") == 2 && metricSum(t, s, "epitaph_projector_lag_events") == 0
	}, "lag measured at 0")

	require.NoError(t, pg.Stop())
	defer func() { require.NoError(t, pg.Start()) }()
	for i := 0; i < 20; i++ {
		e.publish(e.nextTx(orderRows(10+i, 1)...))
	}
	time.Sleep(5 * time.Second) // many status intervals (300 ms), each failing
	require.Positive(t, metricSum(t, s, "epitaph_projector_status_errors_total"), "status refreshes failed")
	n, lag := metricSeries(t, s, "epitaph_projector_lag_events"), metricSum(t, s, "epitaph_projector_lag_events")
	require.False(t, n > 0 && lag == 0,
		"40 events are pending, yet /metrics still shows %d partitions at lag 0 (a value from before the target went down)", n)
	require.Zero(t, metricSeries(t, s, "epitaph_projector_oldest_pending_age_seconds"), "oldest pending age frozen at %v",
		metricSum(t, s, "epitaph_projector_oldest_pending_age_seconds"))
}
