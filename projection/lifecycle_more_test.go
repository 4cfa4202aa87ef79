package projection_test

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/status"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// --from-time: a partial rebuild holds only what the stream stored at or
// after the time, and still moves to ready.
func TestPartialRebuildFromTime(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 3)
	ctx := context.Background()
	e.start(e.config("w1"))
	for i := 0; i < 10; i++ {
		e.publish(e.nextTx(orderRows(i+1, 1)...))
	}
	c := e.conn()
	pool := e.pool()
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 20 })
	time.Sleep(20 * time.Millisecond) // stream timestamps: strictly after the first ten
	from := time.Now()
	for i := 10; i < 16; i++ {
		e.publish(e.nextTx(orderRows(i+1, 1)...))
	}
	e.heartbeat()
	v, err := version.CreateVersion(ctx, pool, e.js, version.RebuildOptions{Source: src, FromTime: from})
	require.NoError(t, err)
	require.NotNil(t, v.FromTime)
	eventually(t, 30*time.Second, func() bool { return state(t, pool, v.Version) == version.StateReady })
	require.Equal(t, 12, count(t, c, `SELECT count(*) FROM archive_v2.rows`))
	require.Equal(t, 0, count(t, c, `SELECT count(*) FROM archive_v2.rows WHERE key->>'id' IN ('1','2','3','10')`))
	cmp, err := version.Compare(ctx, pool, version.CompareOptions{A: 1, B: 2})
	require.NoError(t, err)
	require.False(t, cmp.Equal, "a partial rebuild lacks the older rows")
	for _, d := range cmp.DifferingKeys {
		require.Equal(t, "only_a", d.What)
	}
}

// A version whose schema cannot be created by the projection's DDL is
// marked failed (with the reason), is not run, and does not disturb the
// live version.
func TestVersionFailsWhenItsSchemaCannotBeCreated(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	ctx := context.Background()
	s := e.start(e.config("w1"))
	c := e.conn()
	pool := e.pool()
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM epitaph.progress`) == 2 })
	_, err := c.Exec(ctx, `CREATE SCHEMA archive_v2; CREATE VIEW archive_v2.rows AS SELECT 1 AS x;
		INSERT INTO epitaph.projection_versions (projection, version, state, schema_name, partitions, boundary_seq)
		VALUES ('archive', 2, 'building', 'archive_v2', 2, 0)`)
	require.NoError(t, err)
	eventually(t, 20*time.Second, func() bool { return state(t, pool, 2) == version.StateFailed })
	v, err := version.GetVersion(ctx, pool, archive.Projection, 2)
	require.NoError(t, err)
	require.NotEmpty(t, v.FailedReason)
	require.NotNil(t, v.FailedAt)
	e.publish(e.nextTx(orderRows(1, 1)...))
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 2 })
	for _, k := range s.Owned() {
		require.Equal(t, 1, k.Version, "a failed version is not run")
	}
	_, err = version.Promote(ctx, pool, archive.Projection, 2, true)
	require.Error(t, err)
	_, err = c.Exec(ctx, `INSERT INTO epitaph.quarantine (projection, version, partition, stream_seq, subject, data, category, error)
		VALUES ('archive', 2, 0, 1, 'x', '\x00', 'malformed', 'test')`)
	require.NoError(t, err)
	require.NoError(t, version.Retire(ctx, pool, e.js, archive.Projection, 2, version.RetireOptions{Source: src, Drop: true}))
	require.Equal(t, 1, count(t, c, `SELECT count(*) FROM epitaph.quarantine WHERE version = 2 AND status = 'discarded' AND resolution_reason = 'version retired'`))
	require.Equal(t, version.StateRetired, state(t, pool, 2))
	require.Equal(t, 0, count(t, c, `SELECT count(*) FROM pg_namespace WHERE nspname = 'archive_v2'`))
}

// A rebuild does not starve the live version: with a rebuild share of one
// page at a time, a delete published while a long rebuild runs is archived
// by the live version promptly, long before the rebuild ends.
func TestRebuildDoesNotStarveLive(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 4)
	ctx := context.Background()
	for i := 0; i < 1500; i++ {
		e.publishAll(e.messages(e.nextTx(orderRows(i+1, 2)...)))
	}
	cfg := e.config("w1")
	cfg.BatchSize = 10
	cfg.RebuildShare = 0.25 // one page of a non-live version at a time
	e.start(cfg)
	c := e.conn()
	pool := e.pool()
	eventually(t, 120*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 4500 })
	_, err := version.CreateVersion(ctx, pool, e.js, version.RebuildOptions{Source: src})
	require.NoError(t, err)
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive_v2.rows`) > 0 })
	tx := e.nextTx(orderRows(99999, 0)...)
	e.publish(tx)
	began := time.Now()
	eventually(t, 10*time.Second, func() bool {
		return count(t, c, `SELECT count(*) FROM archive_v1.rows WHERE commit_lsn = $1::pg_lsn`, tx.lsn.String()) == 1
	})
	took := time.Since(began)
	require.Less(t, count(t, c, `SELECT count(*) FROM archive_v2.rows`), 4500, "the rebuild is still running")
	require.Less(t, took, 5*time.Second)
	t.Logf("live delete archived in %s during the rebuild", took)
}

// A rebuild applies the current snapshot roots to all history: v2 has a
// snapshot job for every root row, v1 (built without roots) none; compare
// reports it, and accepts it only when told.
func TestRebuildWithNewSnapshotRoots(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	ctx := context.Background()
	s1 := e.start(e.config("w1"))
	for i := 0; i < 6; i++ {
		e.publish(e.nextTx(orderRows(i+1, 2)...))
	}
	e.heartbeat()
	c := e.conn()
	pool := e.pool()
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 18 })
	require.NoError(t, s1.Stop(context.Background()))
	cfg := e.config("w2")
	cfg.SnapshotRoots = []string{"public.orders"}
	e.start(cfg)
	_, err := version.CreateVersion(ctx, pool, e.js, version.RebuildOptions{Source: src})
	require.NoError(t, err)
	eventually(t, 30*time.Second, func() bool {
		return state(t, pool, 2) == version.StateReady &&
			count(t, c, `SELECT count(*) FROM archive_v2.snapshots WHERE status = 'complete'`) == 6
	})
	require.Equal(t, 0, count(t, c, `SELECT count(*) FROM archive_v1.snapshots`))
	cmp, err := version.Compare(ctx, pool, version.CompareOptions{A: 1, B: 2})
	require.NoError(t, err)
	require.True(t, cmp.ContentEqual)
	require.False(t, cmp.SnapshotsEqual)
	require.False(t, cmp.Equal)
	require.Equal(t, []version.SnapshotComparison{{RootTable: "public.orders", Status: "complete", A: 0, B: 6}}, cmp.Snapshots)
	cmp, err = version.Compare(ctx, pool, version.CompareOptions{A: 1, B: 2, IgnoreSnapshots: true})
	require.NoError(t, err)
	require.True(t, cmp.Equal)

	// A row readers do not see (its transaction not verified: pending, or
	// forged) is not a difference: compare looks at what readers see.
	testenv.Exec(t, e.url, `INSERT INTO archive_v2.rows (source, schema_name, table_name, key, row, correlation_id,
		commit_lsn, seq, verified) VALUES ('main', 'public', 'orders', '{"id": 999}', '{"id": 999}', 'main:1:FFFF/0', 'FFFF/0', 0, false)`)
	cmp, err = version.Compare(ctx, pool, version.CompareOptions{A: 1, B: 2, IgnoreSnapshots: true, All: true})
	require.NoError(t, err)
	require.True(t, cmp.Equal, "an unverified row counted as a difference: %+v", cmp.Tables)
	testenv.Exec(t, e.url, `UPDATE archive_v2.rows SET verified = true WHERE commit_lsn = 'FFFF/0'`)
	cmp, err = version.Compare(ctx, pool, version.CompareOptions{A: 1, B: 2, IgnoreSnapshots: true, All: true})
	require.NoError(t, err)
	require.False(t, cmp.Equal, "the same row, verified, must be a difference")
}

// A full rebuild from a stream whose first messages were removed (purged,
// aged out) lacks their rows: the new version is created with a
// removed_from_stream gap for them, and cannot be promoted until an
// operator acknowledges that the history is gone.
func TestRebuildFromAStreamMissingItsHeadIsAGap(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	ctx := context.Background()
	s := e.start(e.config("w1"))
	for i := 0; i < 6; i++ {
		e.publish(e.nextTx(orderRows(i+1, 1)...))
	}
	c := e.conn()
	pool := e.pool()
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 12 })
	stream, err := e.js.Stream(ctx, event.StreamName(src))
	require.NoError(t, err)
	require.NoError(t, stream.Purge(ctx, jetstream.WithPurgeSequence(4))) // the first three messages
	e.heartbeat()

	v, err := version.CreateVersion(ctx, pool, e.js, version.RebuildOptions{Source: src})
	require.NoError(t, err)
	require.Equal(t, 1, count(t, c, `SELECT count(*) FROM archive_v2.gaps WHERE kind = 'removed_from_stream'
		AND partition IS NULL AND from_seq = 1 AND to_seq = 3 AND from_lsn IS NULL AND to_lsn IS NOT NULL AND acknowledged_at IS NULL`))
	eventually(t, 30*time.Second, func() bool { return state(t, pool, v.Version) == version.StateReady })
	_, err = version.Promote(ctx, pool, archive.Projection, v.Version, false)
	require.ErrorIs(t, err, version.ErrNotReady)
	require.ErrorContains(t, err, "1 unacknowledged gaps")

	vg, err := status.ListGaps(ctx, s.Pool(), archive.Projection)
	require.NoError(t, err)
	var id int64
	for _, g := range vg {
		if g.Version == v.Version {
			require.Len(t, g.Gaps, 1)
			id = g.Gaps[0].ID
		}
	}
	_, err = status.AckGap(ctx, pool, archive.Projection, v.Version, id, "history before the purge is gone on purpose")
	require.NoError(t, err)
	_, err = version.Promote(ctx, pool, archive.Projection, v.Version, false)
	require.NoError(t, err)

	// A stream that holds its beginning gives a rebuild no gap.
	e2 := newEnv(t, 2)
	e2.start(e2.config("w1"))
	e2.publish(e2.nextTx(orderRows(1, 1)...))
	c2 := e2.conn()
	eventually(t, 20*time.Second, func() bool { return count(t, c2, `SELECT count(*) FROM archive.rows`) == 2 })
	_, err = version.CreateVersion(ctx, e2.pool(), e2.js, version.RebuildOptions{Source: src})
	require.NoError(t, err)
	require.Zero(t, count(t, c2, `SELECT count(*) FROM archive_v2.gaps`))
}
