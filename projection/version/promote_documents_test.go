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

// Promote (without force) promises the candidate "has complete every
// snapshot document the live version has complete": a document the live
// version has complete and the candidate has not even created (its commit
// is within the ready lag, not applied yet) is lost to readers by the
// switch just as a pending one would be.
func TestPromoteRefusesACandidateLackingALiveDocument(t *testing.T) {
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
	_, err = version.CreateVersion(ctx, pool, js, version.RebuildOptions{})
	require.NoError(t, err)

	// v1 has the document of order 7 complete; v2 has not got to it yet.
	_, err = pool.Exec(ctx, `INSERT INTO archive_v1.snapshots (correlation_id, root_table, root_key, status, payload, fingerprint,
		completed_at, source, commit_lsn, root_seq) VALUES ('main:1:0/100', 'public.orders', '{"id":7}', 'complete', '{}', 'f', now(), 'main', '0/100', 0)`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `UPDATE epitaph.projection_versions SET state = 'ready', ready_at = now() WHERE version = 2`)
	require.NoError(t, err)

	var before int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM archive.snapshots`).Scan(&before))
	require.Equal(t, 1, before)
	_, err = version.Promote(ctx, pool, "archive", 2, false)
	var after int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM archive.snapshots`).Scan(&after))
	require.ErrorIs(t, err, version.ErrNotReady, "promotion took a document from readers (archive.snapshots: %d -> %d)", before, after)
}
