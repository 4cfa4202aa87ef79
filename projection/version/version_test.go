package version_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/snapshot"
	"github.com/epitaph-dev/epitaph/projection/version"
)

func TestMain(m *testing.M) { testenv.MainNoLeaks(m) }

const src = "main"

// The administration without workers: what CreateVersion refuses and
// records (boundary, partitions, progress at the start or at a time),
// Promote refusing a version that is not ready, Retire refusing the live
// one, Rollback without a previous one or to one not ready (a gap, catching
// up), Compare of two empty versions, and a forced promotion, rollback and
// retirement with its cleanup.
func TestAdministrationWithoutWorkers(t *testing.T) {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, testenv.NewDatabase(t))
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	require.NoError(t, migrations.Apply(ctx, pool))
	n := testenv.NewNATS(t)
	_, js := n.Connect(t)
	_, err = js.CreateStream(ctx, jetstream.StreamConfig{Name: event.StreamName(src), Subjects: []string{event.StreamSubjects(src)},
		Storage: jetstream.FileStorage, Metadata: map[string]string{event.MetaPartitions: "2", event.MetaSource: src}})
	require.NoError(t, err)

	_, err = version.CreateVersion(ctx, pool, js, version.RebuildOptions{Projection: "orders"})
	require.ErrorContains(t, err, `rebuild "orders": unknown projection`)
	_, err = version.CreateVersion(ctx, pool, js, version.RebuildOptions{})
	require.ErrorContains(t, err, "no live version yet")
	vs, err := version.ListVersions(ctx, pool, "")
	require.NoError(t, err)
	require.Empty(t, vs, "nothing is created on error")

	require.NoError(t, version.EnsureArchive(ctx, pool, 2, snapshot.DDL))
	for i := range 3 {
		_, err := js.Publish(ctx, event.CommitSubject(src, i%2), []byte("not an event "+strconv.Itoa(i)))
		require.NoError(t, err)
	}
	v2, err := version.CreateVersion(ctx, pool, js, version.RebuildOptions{Note: "unit"})
	require.NoError(t, err)
	require.Equal(t, version.Version{Projection: "archive", Version: 2, State: version.StateBuilding, Schema: "archive_v2",
		Partitions: 2, BoundarySeq: ptr(int64(3)), CreatedAt: v2.CreatedAt, BuildingAt: v2.BuildingAt, Period: archive.PeriodMonth}, v2)
	require.Equal(t, []string{"0:0", "1:0"}, cursors(t, pool, 2))
	var note, from string
	require.NoError(t, pool.QueryRow(ctx, `SELECT config->>'note', config->>'from' FROM epitaph.projection_versions WHERE version = 2`).Scan(&note, &from))
	require.Equal(t, []string{"unit", "start"}, []string{note, from})

	_, err = version.Promote(ctx, pool, "archive", 2, false)
	require.ErrorIs(t, err, version.ErrNotReady)
	_, err = version.Promote(ctx, pool, "archive", 9, true)
	require.ErrorIs(t, err, version.ErrNoVersion)
	err = version.Retire(ctx, pool, js, "archive", 1, version.RetireOptions{})
	require.ErrorContains(t, err, "archive v1 is live: promote another version (or roll back) first")
	_, _, err = version.Rollback(ctx, pool, "archive", false)
	require.ErrorContains(t, err, "rollback archive: no previous live version is still active")

	cmp, err := version.Compare(ctx, pool, version.CompareOptions{A: 1, B: 2, All: true})
	require.NoError(t, err)
	require.True(t, cmp.Equal)
	require.Empty(t, cmp.Tables)
	require.Empty(t, cmp.UpTo, "All compares every row")
	cmp, err = version.Compare(ctx, pool, version.CompareOptions{A: 1, B: 2})
	require.NoError(t, err)
	require.Equal(t, "0/0", cmp.UpTo, "no watermark yet: nothing is certainly applied by both")

	// A partial rebuild from a time after every message starts each
	// partition at the boundary.
	v3, err := version.CreateVersion(ctx, pool, js, version.RebuildOptions{FromTime: time.Now().Add(time.Hour)})
	require.NoError(t, err)
	require.Equal(t, 3, v3.Version)
	require.NotNil(t, v3.FromTime)
	require.Equal(t, []string{"0:3", "1:3"}, cursors(t, pool, 3))

	prev, err := version.Promote(ctx, pool, "archive", 2, true)
	require.NoError(t, err)
	require.Equal(t, 1, prev)
	require.Equal(t, map[int]string{1: "ready", 2: "live", 3: "building"}, states(t, pool))
	// Rollback asks of v1 what promote asks: ready, nothing missing.
	var gap int64
	require.NoError(t, pool.QueryRow(ctx, `INSERT INTO archive_v1.gaps (kind, partition, from_lsn, to_lsn)
		VALUES ('lost_upstream', 0, '0/100', '0/200') RETURNING id`).Scan(&gap))
	_, _, err = version.Rollback(ctx, pool, "archive", false)
	require.ErrorIs(t, err, version.ErrNotReady)
	require.ErrorContains(t, err, "rollback archive to v1: archive v1 has 1 unacknowledged gaps")
	_, err = pool.Exec(ctx, `UPDATE archive_v1.gaps SET acknowledged_at = now(), ack_reason = 'test' WHERE id = $1`, gap)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `UPDATE epitaph.projection_versions SET state = 'catching_up' WHERE version = 1`)
	require.NoError(t, err)
	_, _, err = version.Rollback(ctx, pool, "archive", false)
	require.ErrorIs(t, err, version.ErrNotReady)
	require.ErrorContains(t, err, "rollback archive to v1: it is catching_up")
	require.Equal(t, map[int]string{1: "catching_up", 2: "live", 3: "building"}, states(t, pool), "nothing switched")
	_, err = pool.Exec(ctx, `UPDATE epitaph.projection_versions SET state = 'ready' WHERE version = 1`)
	require.NoError(t, err)
	from2, to, err := version.Rollback(ctx, pool, "archive", false)
	require.NoError(t, err)
	require.Equal(t, []int{2, 1}, []int{from2, to})
	require.Equal(t, map[int]string{1: "live", 2: "ready", 3: "building"}, states(t, pool))

	require.NoError(t, version.Retire(ctx, pool, js, "archive", 2, version.RetireOptions{Drop: true, WaitReleased: time.Second}))
	require.Equal(t, map[int]string{1: "live", 2: "retired", 3: "building"}, states(t, pool))
	require.Empty(t, cursors(t, pool, 2), "its progress rows are deleted")
	var schema *string
	require.NoError(t, pool.QueryRow(ctx, `SELECT to_regnamespace('archive_v2')::text`).Scan(&schema))
	require.Nil(t, schema, "Drop drops its schema")
	require.NoError(t, version.Retire(ctx, pool, js, "archive", 2, version.RetireOptions{Drop: true}), "again: finishes the cleanup")
}

func ptr[T any](v T) *T { return &v }

// cursors lists "partition:cursor" of a version's progress rows.
func cursors(t *testing.T, pool *pgxpool.Pool, v int) []string {
	t.Helper()
	rows, err := pool.Query(context.Background(), `SELECT partition || ':' || cursor FROM epitaph.progress
		WHERE projection = 'archive' AND version = $1 ORDER BY partition`, v)
	require.NoError(t, err)
	var out []string
	for rows.Next() {
		var s string
		require.NoError(t, rows.Scan(&s))
		out = append(out, s)
	}
	require.NoError(t, rows.Err())
	return out
}

func states(t *testing.T, pool *pgxpool.Pool) map[int]string {
	t.Helper()
	vs, err := version.ListVersions(context.Background(), pool, "archive")
	require.NoError(t, err)
	out := map[int]string{}
	for _, v := range vs {
		out[v.Version] = v.State
	}
	return out
}
