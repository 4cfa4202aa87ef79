package projection_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// While the target is down nothing can be read of the leases or the
// heartbeats, which change with time (leases expire, heartbeats age): the
// gauges read from them must not keep their last values ("every partition
// leased", "the worker beat 0.3 s ago") for as long as the outage lasts.
func TestLeaseAndHeartbeatGaugesNotFrozenWhileStatusFails(t *testing.T) {
	t.Parallel()
	pg := testenv.NewPostgres(t)
	e := newEnvWith(t, pg.NewDatabase(t), 2)
	s := e.start(e.config("w1"))
	e.publish(e.nextTx(orderRows(1, 1)...))
	c := e.conn()
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 2 })
	eventually(t, 10*time.Second, func() bool {
		return metricSeries(t, s, "epitaph_projector_worker_heartbeat_age_seconds") == 1 &&
			metricSeries(t, s, "epitaph_projector_partitions_unowned") == 1 &&
			metricSum(t, s, "epitaph_projector_partitions_owned") == 2
	}, "leases and heartbeat measured")

	require.NoError(t, pg.Stop())
	defer func() { require.NoError(t, pg.Start()) }()
	time.Sleep(5 * time.Second) // > LeaseTTL (3 s): the leases have expired; status refreshes failed
	require.Positive(t, metricSum(t, s, "epitaph_projector_status_errors_total"), "status refreshes failed")
	for _, name := range []string{"epitaph_projector_worker_heartbeat_age_seconds", "epitaph_projector_partitions_unowned",
		"epitaph_projector_partitions_owned"} {
		require.Zero(t, metricSeries(t, s, name), "%s frozen at %v while the target cannot be read", name, metricSum(t, s, name))
	}
}
