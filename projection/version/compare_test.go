package version_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/snapshot"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// Two versions built with the same TTL policy hold the same rows for
// readers, whether or not retention's background batch has deleted a row
// that has expired from one of them yet: Compare compares what readers
// see (the reader views hide expired rows, and the documents rooted at
// them), so such a row, and its snapshot document, make no difference.
// Otherwise a freshly rebuilt version differs from the live one (and
// promote refuses it) until the next cleanup batch runs.
func TestCompareIgnoresRowsExpiredButNotYetCleanedUp(t *testing.T) {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, testenv.NewDatabase(t))
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	require.NoError(t, migrations.Apply(ctx, pool))
	n := testenv.NewNATS(t)
	_, js := n.Connect(t)
	_, err = js.CreateStream(ctx, jetstream.StreamConfig{Name: event.StreamName(src), Subjects: []string{event.StreamSubjects(src)},
		Storage: jetstream.FileStorage, Metadata: map[string]string{event.MetaPartitions: "1", event.MetaSource: src}})
	require.NoError(t, err)
	require.NoError(t, version.EnsureArchive(ctx, pool, 1, snapshot.DDL))
	_, err = version.CreateVersion(ctx, pool, js, version.RebuildOptions{Note: "same policy"})
	require.NoError(t, err)

	// Both versions: a session that never expires and one that expired an
	// hour ago, with its snapshot document; v2's cleanup has already
	// deleted the expired one, v1's has not yet.
	for _, schema := range []string{"archive_v1", "archive_v2"} {
		_, err = pool.Exec(ctx, `INSERT INTO `+schema+`.rows (source, schema_name, table_name, key, row, correlation_id, commit_lsn, seq, expires_at)
			VALUES ('main', 'public', 'sessions', '{"id":1}', '{"id":1}', 'main:1:0/10', '0/10', 0, NULL),
			       ('main', 'public', 'sessions', '{"id":2}', '{"id":2}', 'main:2:0/20', '0/20', 0, now() - interval '1 hour')`)
		require.NoError(t, err)
		_, err = pool.Exec(ctx, `INSERT INTO `+schema+`.snapshots (correlation_id, root_table, root_key, status, payload, fingerprint, source, commit_lsn, root_seq)
			VALUES ('main:2:0/20', 'public.sessions', '{"id":2}', 'complete', '{"root":{"id":2}}', 'f', 'main', '0/20', 0)`)
		require.NoError(t, err)
	}
	_, err = pool.Exec(ctx, `DELETE FROM archive_v2.snapshots; DELETE FROM archive_v2.rows WHERE key = '{"id":2}'`)
	require.NoError(t, err)

	cmp, err := version.Compare(ctx, pool, version.CompareOptions{A: 1, B: 2, All: true})
	require.NoError(t, err)
	require.True(t, cmp.Equal, "an expired row one version still holds is not a difference: %+v", cmp)
	require.Empty(t, cmp.DifferingKeys)

	// A row readers would see in one version only is still one.
	_, err = pool.Exec(ctx, `DELETE FROM archive_v2.rows WHERE key = '{"id":1}'`)
	require.NoError(t, err)
	cmp, err = version.Compare(ctx, pool, version.CompareOptions{A: 1, B: 2, All: true, IgnoreExpiresAt: true, IgnoreSnapshots: true})
	require.NoError(t, err)
	require.False(t, cmp.Equal)
	require.Len(t, cmp.DifferingKeys, 1)
	require.Equal(t, "only_a", cmp.DifferingKeys[0].What)
}
