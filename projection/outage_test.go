package projection_test

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/projection"
)

// The target Postgres goes down under a running projector: it retries with
// backoff and resumes by itself, losing and duplicating nothing.
func TestTargetPostgresOutage(t *testing.T) {
	t.Parallel()
	pg := testenv.NewPostgres(t)
	e := newEnvWith(t, pg.NewDatabase(t), 2)
	s := e.start(e.config("w1"))
	for i := 0; i < 10; i++ {
		e.publish(e.nextTx(orderRows(i+1, 2)...))
	}
	c := e.conn()
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 30 })

	require.NoError(t, pg.Stop())
	for i := 10; i < 30; i++ {
		e.publish(e.nextTx(orderRows(i+1, 2)...))
	}
	eventually(t, 20*time.Second, func() bool { return metricSum(t, s, "epitaph_projector_transient_errors_total") > 0 })
	require.NoError(t, pg.Start())

	c = e.conn()
	eventually(t, 30*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 90 },
		"rows: %d", count(t, c, `SELECT count(*) FROM archive.rows`))
	require.Equal(t, 30, count(t, c, `SELECT count(*) FROM archive.rows WHERE is_root`))
	eventually(t, 10*time.Second, func() bool { return len(owned(s)) == 2 })
}

// JetStream goes down under a running projector and comes back with the
// same store: the projector reconnects and resumes by itself.
func TestNATSOutage(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	s := e.start(e.config("w1"))
	for i := 0; i < 10; i++ {
		e.publish(e.nextTx(orderRows(i+1, 2)...))
	}
	c := e.conn()
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 30 })

	e.nats.Stop()
	eventually(t, 20*time.Second, func() bool { return metricSum(t, s, "epitaph_projector_transient_errors_total") > 0 })
	e.nats.Start()
	for i := 10; i < 30; i++ {
		e.publish(e.nextTx(orderRows(i+1, 2)...))
	}
	eventually(t, 30*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 90 },
		"rows: %d", count(t, c, `SELECT count(*) FROM archive.rows`))
	require.Equal(t, 30, count(t, c, `SELECT count(*) FROM archive.rows WHERE is_root`))
}

// An idle partition that keeps failing (the broker is down) counts as
// failing; once the broker is back it is not failing any more, and the
// archive is ready again, with no new event to apply (only an applied page
// used to clear the count, so a quiet archive stayed "failing").
func TestReadyAgainAfterIdleFailures(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	c := e.conn()
	e.start(e.config("w1"))
	e.publish(e.nextTx(orderRows(1, 1)...))
	e.heartbeat()
	eventually(t, 20*time.Second, func() bool { return readyNow(c) }, "ready when caught up")

	e.nats.Stop()
	eventually(t, 30*time.Second, func() bool {
		return count(t, c, `SELECT count(*) FROM epitaph.progress WHERE attempts >= 3`) == 1
	}, "failing while the broker is down")
	st := readStatus(t, c)
	require.False(t, st.ready)
	require.Contains(t, st.reasons, "1 partitions failing")

	e.nats.Start()
	eventually(t, 30*time.Second, func() bool { return readyNow(c) }, "ready again, with nothing new to apply")
	require.Equal(t, 0, count(t, c, `SELECT count(*) FROM epitaph.progress WHERE attempts > 0`))
	require.Equal(t, 1, count(t, c, `SELECT count(*) FROM epitaph.progress WHERE last_failure_category LIKE 'transient:%'`),
		"the last failure stays, as history")
}

// A partition waiting out a long backoff after JetStream went down
// retries as soon as the connection is back, not at the end of its wait:
// a broker restart (the capture's embedded one restarts with the
// capture) costs no more lag than the restart itself.
func TestNATSOutageEndsThePartitionsBackoffWhenTheBrokerIsBack(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	cfg := e.config("w1")
	cfg.MaxBackoff = time.Minute
	s, err := projection.New(cfg, projection.WithLogger(testLogger(t)), projection.WithRegistry(prometheus.NewRegistry()),
		projection.WithFirstBackoff(30*time.Second)) // at least 15s with its jitter
	require.NoError(t, err)
	require.NoError(t, s.Start(context.Background()))
	t.Cleanup(func() { require.NoError(t, s.Stop(context.Background())) })
	for i := 0; i < 10; i++ {
		e.publish(e.nextTx(orderRows(i+1, 2)...))
	}
	c := e.conn()
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 30 })

	e.nats.Stop()
	eventually(t, 20*time.Second, func() bool { return metricSum(t, s, "epitaph_projector_transient_errors_total") >= 2 },
		"both partitions failed and wait out their backoff")
	e.nats.Start()
	back := time.Now()
	for i := 10; i < 30; i++ {
		e.publish(e.nextTx(orderRows(i+1, 2)...))
	}
	eventually(t, 10*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 90 },
		"rows: %d", count(t, c, `SELECT count(*) FROM archive.rows`))
	t.Logf("every row archived %s after the broker was back", time.Since(back).Round(time.Millisecond))
}
