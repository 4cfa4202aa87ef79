package retention

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/erasure"
)

// seamsArchive makes a target with archive version 1 (partitioned) and
// returns its pool and URL.
func seamsArchive(t *testing.T) (*pgxpool.Pool, string) {
	t.Helper()
	ctx := context.Background()
	url := testenv.NewDatabase(t)
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	require.NoError(t, migrations.Apply(ctx, pool))
	_, err = pool.Exec(ctx, archive.DDL("archive_v1")+`
		INSERT INTO epitaph.projection_versions (projection, version, state, schema_name, partitions)
		VALUES ('archive', 1, 'live', 'archive_v1', 1)`)
	require.NoError(t, err)
	return pool, url
}

// insertExpired writes n expired rows of public.sessions (ids from..from+n-1)
// committed at at, in one transaction at lsn.
func insertExpired(t *testing.T, pool *pgxpool.Pool, lsn string, at *time.Time, from, n int) {
	t.Helper()
	_, err := pool.Exec(context.Background(), `INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row, correlation_id,
		commit_lsn, commit_time, seq, expires_at)
		SELECT 'main', 'public', 'sessions', jsonb_build_object('id', s), jsonb_build_object('id', s), 'c' || $1,
		       $1::pg_lsn, $2, s, now() - interval '1 day' + s * interval '1 microsecond'
		FROM generate_series($3::int, $3::int + $4::int - 1) s`, lsn, at, from, n)
	require.NoError(t, err)
}

// A target whose DateStyle is not ISO (ALTER DATABASE .. SET DateStyle,
// a DBA's locale choice) prints partition bounds another way: the
// partition listing reads them all the same, and cleanup goes on (it
// failed to parse them, and every batch failed: retention stopped).
func TestCleanupWithNonISODateStyle(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, url := seamsArchive(t)
	aug := time.Date(2026, 8, 10, 0, 0, 0, 0, time.UTC)
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := archive.EnsurePartitions(ctx, tx, "archive_v1", archive.PeriodMonth, aug)
		return err
	}))
	insertExpired(t, pool, "1/0", &aug, 0, 10)
	var db string
	require.NoError(t, pool.QueryRow(ctx, `SELECT current_database()`).Scan(&db))
	_, err := pool.Exec(ctx, `ALTER DATABASE `+pgx.Identifier{db}.Sanitize()+` SET DateStyle = 'SQL, DMY'`)
	require.NoError(t, err)
	pool2, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	defer pool2.Close()

	res, err := CleanupBatch(ctx, pool2, CleanupOptions{Batch: 1000})
	require.NoError(t, err, "a cleanup batch under DateStyle SQL")
	require.Equal(t, []string{"archive_v1.rows_p20260801"}, res.Dropped)
	require.Equal(t, 10, res.Deleted)
}

// A legal hold added (and reported added) while a cleanup batch is in
// flight keeps its row: the batch locks legal_holds against writes, as the
// partition drop does (the row-by-row delete read the holds in its
// statement's snapshot, before the hold, and deleted the row after the
// hold committed).
func TestHoldAddedDuringCleanupKeepsRow(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := seamsArchive(t)
	insertExpired(t, pool, "1/0", nil, 40, 5) // ids 40..44, default partition
	// Another session holds row 42 locked for a moment (a reader FOR
	// SHARE, an erase checking it): the batch's delete waits on it after
	// its victims were chosen.
	blocker, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer blocker.Rollback(ctx) //nolint:errcheck
	_, err = blocker.Exec(ctx, `SELECT 1 FROM archive_v1.rows WHERE key = '{"id": 42}' FOR UPDATE`)
	require.NoError(t, err)

	type result struct {
		res CleanupResult
		err error
	}
	done := make(chan result, 1)
	go func() {
		res, err := CleanupBatch(ctx, pool, CleanupOptions{Batch: 1000})
		done <- result{res, err}
	}()
	require.Eventually(t, func() bool {
		var n int
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE query LIKE '%victims AS%' AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()`).Scan(&n))
		return n > 0
	}, 10*time.Second, 10*time.Millisecond, "the batch waits on row 42")

	holdDone := make(chan error, 1)
	go func() {
		_, err := erasure.AddLegalHold(ctx, pool, erasure.LegalHoldOptions{Table: "public.sessions",
			Key: json.RawMessage(`{"id": 42}`), Reason: "case 1", Actor: "tester"})
		holdDone <- err
	}()
	// The hold is added (the command reports it) while the batch waits.
	holdBeforeBatch := false
	select {
	case err := <-holdDone:
		require.NoError(t, err)
		holdBeforeBatch = true
	case <-time.After(time.Second):
	}
	require.NoError(t, blocker.Commit(ctx))
	r := <-done
	require.NoError(t, r.err)
	if !holdBeforeBatch {
		require.NoError(t, <-holdDone)
	}
	var left int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM archive_v1.rows WHERE key = '{"id": 42}'`).Scan(&left))
	require.False(t, holdBeforeBatch && left == 0,
		"hold add returned (hold committed) before the batch committed, yet the batch deleted the held row")
}

// Pacing is for the writes of the row-by-row delete; a dropped partition
// costs a DROP, whatever its rows (they were paced at --cleanup-rate: one
// dropped partition of N rows stalled retention for N/rate while the
// apply was busy).
func TestPacingIgnoresDroppedPartitionRows(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := seamsArchive(t)
	aug := time.Date(2026, 8, 10, 0, 0, 0, 0, time.UTC)
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := archive.EnsurePartitions(ctx, tx, "archive_v1", archive.PeriodMonth, aug)
		return err
	}))
	insertExpired(t, pool, "1/0", &aug, 0, 2000)    // August's partition: dropped whole
	insertExpired(t, pool, "2/0", nil, 100000, 300) // the default partition: row by row
	c := NewCleaner(pool, CleanerConfig{Rate: 100, Busy: func() bool { return true }, StatementTimeout: 10 * time.Second},
		NewMetrics(prometheus.NewRegistry()))
	full, pace := c.step(ctx)
	require.True(t, full, "a full batch of the default partition's rows")
	// 100 rows deleted one by one at 100 rows/s: about a second.
	require.LessOrEqual(t, pace, 2*time.Second, "the wait after a batch that dropped a partition of 2000 rows")
}

// A cleaner whose batches fail (here: the rows' partition locked against
// writes past the statement timeout) still reports the age of the oldest
// row due in epitaph_projector_expired_oldest_seconds, so
// EpitaphRetentionBehind fires (the gauge stayed at 0, "nothing due").
func TestOldestDueWhileBatchesFail(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := seamsArchive(t)
	c := NewCleaner(pool, CleanerConfig{StatementTimeout: 300 * time.Millisecond}, NewMetrics(prometheus.NewRegistry()))
	full, _ := c.step(ctx) // nothing due yet
	require.False(t, full)
	require.Zero(t, gaugeValue(t, c.m.oldestDue))

	_, err := pool.Exec(ctx, `INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row, correlation_id, commit_lsn, seq, expires_at)
		SELECT 'main', 'public', 'sessions', jsonb_build_object('id', s), '{}', 'c', '1/0', s, now() - interval '2 hours'
		FROM generate_series(0, 9) s`)
	require.NoError(t, err)
	locker, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer locker.Rollback(ctx)                                                        //nolint:errcheck
	_, err = locker.Exec(ctx, `LOCK TABLE archive_v1.rows_default IN EXCLUSIVE MODE`) // readers pass, deletes wait
	require.NoError(t, err)
	for range 3 {
		c.step(ctx)
	}
	require.Equal(t, 3.0, gaugeValue(t, c.m.errors), "three failed batches")
	require.GreaterOrEqual(t, gaugeValue(t, c.m.oldestDue), 7000.0,
		"rows 2h past expiry are still there, nothing keeps them, and every batch fails")
}

func gaugeValue(t *testing.T, m prometheus.Metric) float64 {
	t.Helper()
	var d dto.Metric
	require.NoError(t, m.Write(&d))
	if d.Gauge != nil {
		return d.Gauge.GetValue()
	}
	return d.Counter.GetValue()
}

// A past partition holding rows that never expire (a table without TTL:
// "kept forever") is never locked to be dropped: the check runs first
// without locks. (Every batch took an ACCESS EXCLUSIVE lock on it, which
// waited behind a long reader for the lock timeout with every other
// reader and writer queued behind it.)
func TestKeptPartitionNotLockedEveryBatch(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := seamsArchive(t)
	aug := time.Date(2026, 8, 10, 0, 0, 0, 0, time.UTC)
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := archive.EnsurePartitions(ctx, tx, "archive_v1", archive.PeriodMonth, aug)
		return err
	}))
	insertExpired(t, pool, "1/0", &aug, 0, 5)
	_, err := pool.Exec(ctx, `INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row, correlation_id, commit_lsn, commit_time, seq)
		VALUES ('main', 'public', 'orders', '{"id": 1}', '{"id": 1}', 'c2', '2/0', $1, 0)`, aug) // never expires
	require.NoError(t, err)
	long, err := pool.Begin(ctx) // a long reader of August
	require.NoError(t, err)
	defer long.Rollback(ctx) //nolint:errcheck
	_, err = long.Exec(ctx, `SELECT count(*) FROM archive_v1.rows WHERE commit_time >= '2026-08-01' AND commit_time < '2026-09-01'`)
	require.NoError(t, err)

	done := make(chan error, 1)
	go func() {
		_, err := CleanupBatch(ctx, pool, CleanupOptions{Batch: 1000})
		done <- err
	}()
	var stalled error
	for finished := false; !finished; {
		select {
		case err := <-done:
			require.NoError(t, err)
			finished = true
		default:
			err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				if _, err := tx.Exec(ctx, `SET LOCAL statement_timeout = 200`); err != nil {
					return err
				}
				_, err := tx.Exec(ctx, `SELECT count(*) FROM archive_v1.rows WHERE commit_time >= '2026-08-01' AND commit_time < '2026-09-01'`)
				return err
			})
			if err != nil && stalled == nil {
				stalled = err
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	require.NoError(t, stalled, "a reader of a partition that can never be dropped, during a cleanup batch")
}
