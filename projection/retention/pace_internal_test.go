package retention

import (
	"context"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// batchLog records the rows of each batch the cleaner logs.
type batchLog struct {
	mu      sync.Mutex
	batches []int
}

func (b *batchLog) Enabled(context.Context, slog.Level) bool { return true }
func (b *batchLog) WithAttrs([]slog.Attr) slog.Handler       { return b }
func (b *batchLog) WithGroup(string) slog.Handler            { return b }
func (b *batchLog) Handle(_ context.Context, r slog.Record) error {
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == "rows" {
			b.mu.Lock()
			b.batches = append(b.batches, int(a.Value.Int64()))
			b.mu.Unlock()
		}
		return true
	})
	return nil
}

func (b *batchLog) take() []int {
	b.mu.Lock()
	defer b.mu.Unlock()
	out := b.batches
	b.batches = nil
	return out
}

// expireRows writes n rows into archive_v1 that expired ago (plus i µs).
func expireRows(t *testing.T, pool *pgxpool.Pool, from, n int, ago time.Duration) {
	t.Helper()
	_, err := pool.Exec(context.Background(), `INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row, correlation_id, commit_lsn, seq, expires_at)
		SELECT 'old', 'public', 'sessions', jsonb_build_object('id', i), jsonb_build_object('id', i), 'old:1:0/1', '0/1'::pg_lsn, i,
		       now() - $3 * interval '1 second' + (i - $1) * interval '1 microsecond'
		FROM generate_series($1::int, $1::int + $2::int - 1) i`, from, n, ago.Seconds())
	require.NoError(t, err)
}

// runCleaner runs a cleaner until archive_v1 holds no row; it returns how
// long that took.
func runCleaner(t *testing.T, pool *pgxpool.Pool, cfg CleanerConfig, behindSince time.Time, limit time.Duration) time.Duration {
	t.Helper()
	ctx := context.Background()
	c := NewCleaner(pool, cfg, NewMetrics(prometheus.NewRegistry()))
	c.behindSince = behindSince
	start := time.Now()
	require.NoError(t, c.Start(ctx))
	defer func() {
		require.NoError(t, c.Stop(ctx))
		require.NoError(t, c.Wait())
	}()
	var left int
	require.Eventually(t, func() bool {
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM archive_v1.rows`).Scan(&left))
		return left == 0
	}, limit, 20*time.Millisecond, "expired rows left: %d", left)
	return time.Since(start)
}

// While the projector applies, the cleaner deletes at most Rate rows a
// second in batches of at most a quarter second of Rate, also through a
// backlog of rows expired hours ago; idle, or catching up (its batches an
// hour behind for an hour), it is not paced.
func TestRetentionCleanerPace(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testenv.NewDatabase(t)
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	defer pool.Close()
	require.NoError(t, migrations.Apply(ctx, pool))
	require.NoError(t, version.EnsureArchive(ctx, pool, 1, nil))
	log := &batchLog{}
	busy := func() bool { return true }
	cfg := CleanerConfig{Interval: 20 * time.Millisecond, Batch: 1000, Rate: 4000, Busy: busy, Logger: slog.New(log)}

	// Paced: 12,000 rows at 4,000 a second take at least 2.75 s (the
	// first batch is not waited for), in batches of at most 1,000; rows
	// expired a minute ago, then two hours ago (a backlog, not yet behind
	// for an hour).
	for _, ago := range []time.Duration{time.Minute, 2 * time.Hour} {
		expireRows(t, pool, 1, 12000, ago)
		took := runCleaner(t, pool, cfg, time.Time{}, 120*time.Second)
		require.GreaterOrEqual(t, took, 2750*time.Millisecond, "expired %s ago", ago)
		sum := 0
		for _, n := range log.take() {
			require.LessOrEqual(t, n, 1000)
			sum += n
		}
		require.Equal(t, 12000, sum)
	}

	// Catching up (an hour behind for two hours): rows expired two hours
	// ago are deleted at once; at the pace of 100 a second they would
	// take two minutes.
	cfg.Rate = 100
	expireRows(t, pool, 1, 12000, 2*time.Hour)
	runCleaner(t, pool, cfg, time.Now().Add(-2*time.Hour), 60*time.Second)
	require.Greater(t, slices.Max(log.take()), 100, "unpaced batches are not bound by a quarter second of the rate")

	// Idle (nothing applied within the last second): unpaced.
	cfg.Busy = func() bool { return false }
	expireRows(t, pool, 1, 12000, time.Minute)
	runCleaner(t, pool, cfg, time.Time{}, 60*time.Second)
	require.NotEmpty(t, log.take())
}

// One cleaner cleans a version at a time: a batch skips a version whose
// cleanup lock another holds (and says so), and cleans it once released. A
// full batch's OldestDue is the newest expires_at it deleted.
func TestRetentionOneCleanerPerVersion(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testenv.NewDatabase(t)
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	defer pool.Close()
	require.NoError(t, migrations.Apply(ctx, pool))
	require.NoError(t, version.EnsureArchive(ctx, pool, 1, nil))
	expireRows(t, pool, 1, 500, time.Minute)

	other, err := pool.Begin(ctx)
	require.NoError(t, err)
	var got bool
	require.NoError(t, other.QueryRow(ctx, cleanupLockSQL, "archive_v1").Scan(&got))
	require.True(t, got)
	res, err := CleanupBatch(ctx, pool, CleanupOptions{Batch: 1000})
	require.NoError(t, err)
	require.Equal(t, 0, res.Deleted)
	require.Equal(t, []string{"archive_v1"}, res.Skipped)
	require.False(t, res.Full)
	var left int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM archive_v1.rows`).Scan(&left))
	require.Equal(t, 500, left)

	require.NoError(t, other.Rollback(ctx))
	// A full batch reports the newest expires_at it deleted as OldestDue.
	var newest time.Time
	require.NoError(t, pool.QueryRow(ctx, `SELECT max(expires_at) FROM (SELECT expires_at FROM archive_v1.rows ORDER BY expires_at LIMIT 200) x`).Scan(&newest))
	res, err = CleanupBatch(ctx, pool, CleanupOptions{Batch: 200})
	require.NoError(t, err)
	require.Equal(t, 200, res.Deleted)
	require.True(t, res.Full)
	require.NotNil(t, res.OldestDue)
	require.True(t, newest.Equal(*res.OldestDue), "want %s, got %s", newest, *res.OldestDue)
	res, err = CleanupBatch(ctx, pool, CleanupOptions{Batch: 1000})
	require.NoError(t, err)
	require.Equal(t, 300, res.Deleted)
	require.False(t, res.Full)
	require.Nil(t, res.OldestDue)
	require.Empty(t, res.Skipped)
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM archive_v1.rows`).Scan(&left))
	require.Equal(t, 0, left)
}
