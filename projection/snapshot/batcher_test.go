package snapshot_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/projection/snapshot"
)

// gauge sums the series of gauge name whose labels include the given
// name/value pairs ("status", "pending", "version", "1"); 0 when the
// batcher has exported none yet (its first stats are read at start). A
// name the registry does not have at all fails the test.
func gauge(t *testing.T, reg *prometheus.Registry, name string, labels ...string) float64 {
	t.Helper()
	families, err := reg.Gather()
	require.NoError(t, err)
	sum := 0.0
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
	series:
		for _, m := range f.GetMetric() {
			have := map[string]string{}
			for _, l := range m.GetLabel() {
				have[l.GetName()] = l.GetValue()
			}
			for i := 0; i+1 < len(labels); i += 2 {
				if have[labels[i]] != labels[i+1] {
					continue series
				}
			}
			sum += m.GetGauge().GetValue()
		}
	}
	return sum
}

func TestBatcherAssemblesInBackgroundAndExportsMetrics(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.seedOrder(t, 1, 1)
	e.seedOrder(t, 2, 1)
	short := e.begin(t)
	short.deleteOrder(t, 1)
	require.Equal(t, 1, short.apply(t, orderRoots, short.rows[0])) // a note withheld: stays pending

	reg := prometheus.NewRegistry()
	b, err := snapshot.NewBatcher(e.pool, snapshot.BatcherConfig{
		Batch:         snapshot.Config{BatchSize: 2, MaxAttempts: 100, RetryDelay: time.Hour, MaxRetryDelay: time.Hour},
		Schemas:       func(ctx context.Context) ([]string, error) { return []string{"archive_v1"}, nil },
		Interval:      20 * time.Millisecond,
		StatsInterval: 20 * time.Millisecond,
		Registerer:    reg,
	})
	require.NoError(t, err)
	require.NoError(t, b.Start(e.ctx))
	defer func() { require.NoError(t, b.Stop(context.Background())) }()

	ok := e.begin(t)
	ok.deleteOrder(t, 2)
	require.Equal(t, 1, ok.apply(t, orderRoots))

	require.Eventually(t, func() bool {
		s, found := e.show(t, ok.correlationID())[`{"id":2}`]
		return found && s.Status == snapshot.StatusComplete
	}, 30*time.Second, 20*time.Millisecond)
	require.Eventually(t, func() bool {
		return gauge(t, reg, "epitaph_projector_snapshot_jobs", "status", "complete") == 1
	}, 30*time.Second, 20*time.Millisecond)
	require.Equal(t, 1.0, gauge(t, reg, "epitaph_projector_snapshot_jobs", "status", "pending"))
	require.Equal(t, 0.0, gauge(t, reg, "epitaph_projector_snapshot_jobs", "status", "failed"))
	require.Greater(t, gauge(t, reg, "epitaph_projector_snapshot_oldest_pending_age_seconds"), 0.0)
	st := b.Stats()
	require.Equal(t, int64(1), st.Pending)
	require.Equal(t, int64(1), st.Complete)

	require.NoError(t, b.Stop(context.Background()))
	require.NoError(t, b.Stop(context.Background())) // idempotent
	// Stopped: a new job stays pending.
	late := e.begin(t)
	e.exec(t, `INSERT INTO orders (id, customer) VALUES (3, 'c')`)
	late.del(t, "public.orders", "id = 3")
	require.Equal(t, 1, late.apply(t, orderRoots))
	stats, err := snapshot.GetStats(e.ctx, e.pool, e.schema)
	require.NoError(t, err)
	require.Equal(t, int64(2), stats.Pending)
}

// Versions built side by side: one batcher serves every version schema.
func TestBatcherServesEveryVersionSchema(t *testing.T) {
	t.Parallel()
	e1 := setup(t)
	testenv.Exec(t, e1.url, fmt.Sprintf(archiveRowsDDL, "archive_v2"))
	require.NoError(t, snapshot.Migrate(e1.ctx, e1.pool, "archive_v2"))
	e2 := *e1
	e2.schema = "archive_v2"

	e1.seedOrder(t, 1, 1)
	s := e1.begin(t)
	s.deleteOrder(t, 1)
	require.Equal(t, 1, s.apply(t, orderRoots))
	s.e = &e2 // the same transaction, applied by version 2 as well
	s.tx = nil
	tx, err := e2.pool.Begin(e2.ctx)
	require.NoError(t, err)
	s.archive(t, tx, s.rows)
	n, err := snapshot.CreateJobs(e2.ctx, tx, "archive_v2", &s.commit, orderRoots)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.NoError(t, tx.Commit(e2.ctx))

	reg := prometheus.NewRegistry()
	b, err := snapshot.NewBatcher(e1.pool, snapshot.BatcherConfig{
		Schemas:  func(context.Context) ([]string, error) { return []string{"archive_v1", "archive_v2"}, nil },
		Interval: 20 * time.Millisecond, StatsInterval: 20 * time.Millisecond, Registerer: reg,
	})
	require.NoError(t, err)
	require.NoError(t, b.Start(e1.ctx))
	defer func() { require.NoError(t, b.Stop(context.Background())) }()
	require.Eventually(t, func() bool {
		return gauge(t, reg, "epitaph_projector_snapshot_jobs", "status", "complete") == 2
	}, 30*time.Second, 20*time.Millisecond)
	for _, v := range []string{"1", "2"} {
		require.Equal(t, 1.0, gauge(t, reg, "epitaph_projector_snapshot_jobs", "status", "complete", "version", v), "version %s", v)
	}
	for _, schema := range []string{"archive_v1", "archive_v2"} {
		list, err := snapshot.Show(e1.ctx, e1.pool, schema, s.correlationID())
		require.NoError(t, err)
		require.Len(t, list, 1)
		require.Equal(t, snapshot.StatusComplete, list[0].Status, schema)
	}
	require.Zero(t, gauge(t, reg, "epitaph_projector_snapshot_oldest_pending_age_seconds"))
}

// The gauges are refreshed on their own timer, labelled by version, while
// a drain is in progress: here a batch hangs (the archive is locked) and
// new jobs keep arriving; the gauges follow them, and once the lock goes
// the drain finishes and they show it.
func TestGaugesDuringALongDrain(t *testing.T) {
	t.Parallel()
	e := setup(t)
	const orders = 3
	var txs []*sourceTx
	for i := 1; i <= orders; i++ {
		e.seedOrder(t, i, 1)
		s := e.begin(t)
		s.deleteOrder(t, i)
		require.Equal(t, 1, s.apply(t, orderRoots))
		txs = append(txs, s)
	}
	lock, err := e.pool.Begin(e.ctx)
	require.NoError(t, err)
	defer func() { _ = lock.Rollback(context.Background()) }()
	_, err = lock.Exec(e.ctx, `LOCK TABLE archive_v1.rows IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)

	reg := prometheus.NewRegistry()
	b, err := snapshot.NewBatcher(e.pool, snapshot.BatcherConfig{
		Batch: snapshot.Config{BatchSize: 1},
		Targets: func(context.Context) ([]snapshot.Target, error) {
			return []snapshot.Target{{Schema: "archive_v1", Projection: "archive", Version: 1, Live: true}}, nil
		},
		Interval: 20 * time.Millisecond, StatsInterval: 20 * time.Millisecond, Registerer: reg,
	})
	require.NoError(t, err)
	require.NoError(t, b.Start(e.ctx))
	defer func() { require.NoError(t, b.Stop(context.Background())) }()
	pending := func() float64 {
		return gauge(t, reg, "epitaph_projector_snapshot_jobs", "projection", "archive", "version", "1", "status", "pending")
	}
	require.Eventually(t, func() bool { return pending() == orders }, time.Minute, 10*time.Millisecond)
	// The batch is stuck reading the archive.
	require.Eventually(t, func() bool {
		var waiting int
		require.NoError(t, e.pool.QueryRow(e.ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE wait_event_type = 'Lock' AND query LIKE '%archive_v1%rows%'`).Scan(&waiting))
		return waiting > 0
	}, time.Minute, 10*time.Millisecond)
	// Jobs arriving meanwhile show up.
	e.exec(t, `INSERT INTO archive_v1.snapshots (correlation_id, root_table, root_key, source, commit_lsn, root_seq)
		VALUES ('main:1:0/1', 'public.orders', '{"id": 99}', 'main', '0/1', 0)`)
	require.Eventually(t, func() bool { return pending() == orders+1 }, time.Minute, 10*time.Millisecond)
	age0 := gauge(t, reg, "epitaph_projector_snapshot_oldest_pending_age_seconds", "version", "1")
	require.Greater(t, age0, 0.0)
	require.Eventually(t, func() bool {
		return gauge(t, reg, "epitaph_projector_snapshot_oldest_pending_age_seconds", "version", "1") > age0
	}, time.Minute, 10*time.Millisecond)

	require.NoError(t, lock.Rollback(e.ctx))
	require.Eventually(t, func() bool {
		return gauge(t, reg, "epitaph_projector_snapshot_jobs", "version", "1", "status", "complete") == orders
	}, time.Minute, 10*time.Millisecond)
	require.Eventually(t, func() bool {
		return gauge(t, reg, "epitaph_projector_snapshot_jobs", "version", "1", "status", "failed") == 1
	}, time.Minute, 10*time.Millisecond, "the job without archive rows fails at once")
	require.Zero(t, pending())
	for i, s := range txs {
		require.Equal(t, snapshot.StatusComplete, e.show(t, s.correlationID())[fmt.Sprintf(`{"id":%d}`, i+1)].Status)
	}
}

// The live version's jobs are assembled before another version's, wherever
// it is in the list.
func TestBatcherServesTheLiveVersionFirst(t *testing.T) {
	t.Parallel()
	e1 := setup(t)
	testenv.Exec(t, e1.url, fmt.Sprintf(archiveRowsDDL, "archive_v2"))
	require.NoError(t, snapshot.Migrate(e1.ctx, e1.pool, "archive_v2"))
	e2 := *e1
	e2.schema = "archive_v2"
	for i := 1; i <= 4; i++ {
		e1.seedOrder(t, i, 1)
		s := e1.begin(t)
		s.deleteOrder(t, i)
		require.Equal(t, 1, s.apply(t, orderRoots))
		s.e, s.tx = &e2, nil
		tx, err := e2.pool.Begin(e2.ctx)
		require.NoError(t, err)
		s.archive(t, tx, s.rows)
		_, err = snapshot.CreateJobs(e2.ctx, tx, "archive_v2", &s.commit, orderRoots)
		require.NoError(t, err)
		require.NoError(t, tx.Commit(e2.ctx))
	}
	b, err := snapshot.NewBatcher(e1.pool, snapshot.BatcherConfig{
		Batch: snapshot.Config{BatchSize: 1},
		Targets: func(context.Context) ([]snapshot.Target, error) {
			return []snapshot.Target{{Schema: "archive_v1", Version: 1}, {Schema: "archive_v2", Version: 2, Live: true}}, nil
		},
		Interval: 20 * time.Millisecond, StatsInterval: time.Hour,
	})
	require.NoError(t, err)
	require.NoError(t, b.Start(e1.ctx))
	defer func() { require.NoError(t, b.Stop(context.Background())) }()
	last := func(schema, agg string) *time.Time {
		var at *time.Time
		require.NoError(t, e1.pool.QueryRow(e1.ctx, `SELECT `+agg+`(completed_at) FROM `+schema+`.snapshots
			HAVING count(*) FILTER (WHERE status = 'complete') = 4`).Scan(&at))
		return at
	}
	require.Eventually(t, func() bool {
		var n int
		require.NoError(t, e1.pool.QueryRow(e1.ctx, `SELECT count(*) FROM archive_v1.snapshots WHERE status = 'complete'`).Scan(&n))
		return n == 4
	}, time.Minute, 20*time.Millisecond)
	liveLast, otherFirst := last("archive_v2", "max"), last("archive_v1", "min")
	require.NotNil(t, liveLast)
	require.NotNil(t, otherFirst)
	require.True(t, liveLast.Before(*otherFirst), "live done %s, other began %s", liveLast, otherFirst)
}
