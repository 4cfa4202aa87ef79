package projection_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// The cutover never serves a worse read model: a rebuilt version whose
// snapshot document is still pending (a retry scheduled later) while the
// live version has it complete is refused by promote; a snapshot backlog
// older than the readiness thresholds takes the version out of ready; once
// the document is complete the version is ready again and promote serves
// it. Compare finds equal documents equal (each version archived at its own
// time) and names a document that differs.
func TestCutoverWaitsForSnapshotsAndCompareSeesDocuments(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	ctx := context.Background()
	cfg := e.config("w1")
	cfg.SnapshotRoots = []string{"public.orders"}
	e.start(cfg)
	for i := 0; i < 4; i++ {
		e.publish(e.nextTx(orderRows(i+1, 2)...))
	}
	e.heartbeat()
	c := e.conn()
	pool := e.pool()
	eventually(t, 20*time.Second, func() bool {
		return count(t, c, `SELECT count(*) FROM archive.snapshots WHERE status = 'complete'`) == 4
	})
	v2, err := version.CreateVersion(ctx, pool, e.js, version.RebuildOptions{Source: src})
	require.NoError(t, err)
	eventually(t, 30*time.Second, func() bool {
		return state(t, pool, v2.Version) == version.StateReady &&
			count(t, c, `SELECT count(*) FROM archive_v2.snapshots WHERE status = 'complete'`) == 4
	})
	e.heartbeat()
	eventually(t, 20*time.Second, func() bool {
		cmp, err := version.Compare(ctx, pool, version.CompareOptions{A: 1, B: 2})
		require.NoError(t, err)
		return cmp.UpTo != "0/0" && len(cmp.Snapshots) == 1 && cmp.Snapshots[0].B == 4
	})
	cmp, err := version.Compare(ctx, pool, version.CompareOptions{A: 1, B: 2})
	require.NoError(t, err)
	require.True(t, cmp.Equal, "the same documents, archived at different times")
	require.Zero(t, cmp.DocumentsDiffer)
	var a1, a2 string
	require.NoError(t, c.QueryRow(ctx, `SELECT (SELECT payload->'meta'->>'archived_at' FROM archive_v1.snapshots WHERE root_key = '{"id":1}'),
		(SELECT payload->'meta'->>'archived_at' FROM archive_v2.snapshots WHERE root_key = '{"id":1}')`).Scan(&a1, &a2))
	require.NotEqual(t, a1, a2)

	// Order 1's document of v2 waits for a retry an hour away.
	_, err = c.Exec(ctx, `UPDATE archive_v2.snapshots SET status = 'pending', payload = NULL, completed_at = NULL,
		retry_count = 1, next_attempt_at = now() + interval '1 hour', pending_since = now(),
		failure_reason = 'incomplete transaction on attempt 1' WHERE root_key = '{"id":1}'`)
	require.NoError(t, err)
	require.Equal(t, version.StateReady, state(t, pool, v2.Version))
	_, err = version.Promote(ctx, pool, archive.Projection, v2.Version, false)
	require.ErrorIs(t, err, version.ErrNotReady)
	require.ErrorContains(t, err, "1 snapshot documents pending or failed that the live v1 has complete")
	require.Contains(t, viewTarget(t, c), "archive_v1.rows")
	require.Equal(t, 4, count(t, c, `SELECT count(*) FROM archive.snapshots WHERE status = 'complete'`))

	// Waiting longer than twice the readiness age: no longer ready.
	_, err = c.Exec(ctx, `UPDATE archive_v2.snapshots SET pending_since = now() - interval '10 minutes' WHERE root_key = '{"id":1}'`)
	require.NoError(t, err)
	eventually(t, 20*time.Second, func() bool { return state(t, pool, v2.Version) == version.StateCatchingUp })

	// The retry comes due: the batcher completes it, the version is ready.
	_, err = c.Exec(ctx, `UPDATE archive_v2.snapshots SET next_attempt_at = NULL WHERE root_key = '{"id":1}'`)
	require.NoError(t, err)
	eventually(t, 20*time.Second, func() bool { return state(t, pool, v2.Version) == version.StateReady })
	require.Equal(t, 4, count(t, c, `SELECT count(*) FROM archive_v2.snapshots WHERE status = 'complete'`))

	// A document that differs is named by compare.
	_, err = c.Exec(ctx, `UPDATE archive_v2.snapshots SET payload = jsonb_set(payload, '{root,row,total}', '"99.99"')
		WHERE root_key = '{"id":3}'`)
	require.NoError(t, err)
	cmp, err = version.Compare(ctx, pool, version.CompareOptions{A: 1, B: 2})
	require.NoError(t, err)
	require.True(t, cmp.ContentEqual, "the archive rows are equal")
	require.False(t, cmp.SnapshotsEqual)
	require.False(t, cmp.Equal)
	require.Equal(t, int64(1), cmp.DocumentsDiffer)
	require.Len(t, cmp.DifferingDocuments, 1)
	d := cmp.DifferingDocuments[0]
	require.Equal(t, "public.orders", d.RootTable)
	require.JSONEq(t, `{"id":3}`, string(d.RootKey))
	require.Equal(t, "payload", d.What)
	b, err := json.Marshal(cmp)
	require.NoError(t, err)
	require.Contains(t, string(b), `"documents_differ":1`)
	cmp, err = version.Compare(ctx, pool, version.CompareOptions{A: 1, B: 2, IgnoreSnapshots: true})
	require.NoError(t, err)
	require.True(t, cmp.Equal, "accepted when told")
	_, err = c.Exec(ctx, `UPDATE archive_v2.snapshots SET payload = (SELECT payload FROM archive_v1.snapshots WHERE root_key = '{"id":3}'),
		fingerprint = 'other' WHERE root_key = '{"id":3}'`)
	require.NoError(t, err)
	cmp, err = version.Compare(ctx, pool, version.CompareOptions{A: 1, B: 2})
	require.NoError(t, err)
	require.Len(t, cmp.DifferingDocuments, 1)
	require.Equal(t, "fingerprint", cmp.DifferingDocuments[0].What)

	prev, err := version.Promote(ctx, pool, archive.Projection, v2.Version, false)
	require.NoError(t, err)
	require.Equal(t, 1, prev)
	require.Contains(t, viewTarget(t, c), "archive_v2.rows")
	require.Equal(t, 4, count(t, c, `SELECT count(*) FROM archive.snapshots WHERE status = 'complete'`))
}
