package projection_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
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
