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

// gauge reads one gauge value from the registry (label status when given).
func gauge(t *testing.T, reg *prometheus.Registry, name, status string) float64 {
	t.Helper()
	families, err := reg.Gather()
	require.NoError(t, err)
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			if status == "" {
				return m.GetGauge().GetValue()
			}
			for _, l := range m.GetLabel() {
				if l.GetName() == "status" && l.GetValue() == status {
					return m.GetGauge().GetValue()
				}
			}
		}
	}
	t.Fatalf("metric %s{status=%q} not found", name, status)
	return 0
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
		return gauge(t, reg, "epitaph_projector_snapshot_jobs", "complete") == 1
	}, 30*time.Second, 20*time.Millisecond)
	require.Equal(t, 1.0, gauge(t, reg, "epitaph_projector_snapshot_jobs", "pending"))
	require.Equal(t, 0.0, gauge(t, reg, "epitaph_projector_snapshot_jobs", "failed"))
	require.Greater(t, gauge(t, reg, "epitaph_projector_snapshot_oldest_pending_age_seconds", ""), 0.0)
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
		return gauge(t, reg, "epitaph_projector_snapshot_jobs", "complete") == 2
	}, 30*time.Second, 20*time.Millisecond)
	for _, schema := range []string{"archive_v1", "archive_v2"} {
		list, err := snapshot.Show(e1.ctx, e1.pool, schema, s.correlationID())
		require.NoError(t, err)
		require.Len(t, list, 1)
		require.Equal(t, snapshot.StatusComplete, list[0].Status, schema)
	}
	require.Zero(t, gauge(t, reg, "epitaph_projector_snapshot_oldest_pending_age_seconds", ""))
}
