package projection_test

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/erasure"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// sharedOrdersTx is one source transaction deleting three orders (each a
// snapshot root) with two lines each: orders 1, 2, 3, lines n000 and n001.
func sharedOrdersTx(e *env) *txn {
	var rows []row
	for _, o := range []int{1, 2, 3} {
		rows = append(rows, orderRows(o, 2)...)
	}
	return e.nextTx(rows...)
}

// docIDs are the documents of a version's transaction: per root key, its
// status and every "id" its payload holds (keys and rows), once, sorted.
func docIDs(t *testing.T, c *pgx.Conn, schema string, tx *txn) []string {
	t.Helper()
	return keysOf(t, c, fmt.Sprintf(`
		SELECT (root_key->>'id') || ' ' || status || ' ' || coalesce((
		       SELECT string_agg(i::text, ',' ORDER BY i) FROM (
		           SELECT DISTINCT x::text::bigint AS i FROM jsonb_path_query(payload, 'strict $.**.id') AS x) d), '-')
		  FROM %s.snapshots WHERE commit_lsn = $1::pg_lsn ORDER BY root_key->>'id'`, pgx.Identifier{schema}.Sanitize()), tx.lsn.String())
}

// Erasing one order of a transaction that deleted others (their own
// documents' roots) leaves the others' documents complete with their own
// rows, the erased one's gone, whether the erasure comes after the apply
// or before it (its fence keeps the rows out), in a page or across pages,
// and a rebuild's version completes the same documents and becomes ready.
func TestEraseInsideSharedTx(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name          string
		before        bool // erase before the transaction is applied
		withChildren  bool
		batch         int
		erasedRowLeft int // rows of the erased order left in the archive
	}{
		{name: "after", erasedRowLeft: 2},
		{name: "after_with_children", withChildren: true},
		{name: "before", before: true, erasedRowLeft: 2},
		{name: "before_with_children", before: true, withChildren: true},
		{name: "before_across_pages", before: true, batch: 2, erasedRowLeft: 2},
		{name: "before_with_children_across_pages", before: true, withChildren: true, batch: 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, 1)
			cfg := retentionConfig(e, "w1")
			cfg.SnapshotRoots = []string{"public.orders"}
			if tc.batch > 0 {
				cfg.BatchSize = tc.batch
			}
			s := e.start(cfg)
			c := e.conn()
			ctx := context.Background()
			pool := newPool(t, e.url)
			erase := func() {
				t.Helper()
				rc, err := erasure.Erase(ctx, pool, erasure.EraseOptions{Table: "public.orders",
					Key: json.RawMessage(`{"id":2}`), WithChildren: tc.withChildren, Actor: "dpo"})
				require.NoError(t, err)
				require.NotNil(t, rc.CompletedAt)
			}
			if tc.before {
				// The first version exists before the fence does.
				eventually(t, 30*time.Second, func() bool {
					return count(t, c, `SELECT count(*) FROM pg_tables WHERE schemaname = 'archive_v1' AND tablename = 'snapshots'`) == 1
				})
				erase()
			}
			tx := sharedOrdersTx(e)
			e.publish(tx)
			want := []string{"1 complete 1,1000,1001", "3 complete 3,3000,3001"}
			if !tc.before {
				eventually(t, 30*time.Second, func() bool {
					return count(t, c, `SELECT count(*) FROM archive_v1.snapshots WHERE status = 'complete'`) == 3
				})
				require.Equal(t, []string{"1 complete 1,1000,1001", "2 complete 2,2000,2001", "3 complete 3,3000,3001"},
					docIDs(t, c, "archive_v1", tx))
				erase()
			}
			eventually(t, 30*time.Second, func() bool {
				return count(t, c, `SELECT count(*) FROM archive_v1.snapshots WHERE status = 'complete'`) == 2
			}, "the other orders' documents complete again")
			require.Equal(t, want, docIDs(t, c, "archive_v1", tx))
			require.Equal(t, 0, count(t, c, `SELECT count(*) FROM archive_v1.snapshots WHERE status <> 'complete'`))
			require.Equal(t, 6+tc.erasedRowLeft, count(t, c, `SELECT count(*) FROM archive_v1.rows`))
			require.Equal(t, 0, count(t, c, `SELECT count(*) FROM archive_v1.rows WHERE table_name = 'orders' AND key->>'id' = '2'`))

			// A rebuild fences the order out and completes the same documents.
			v2, err := version.CreateVersion(ctx, s.Pool(), e.js, version.RebuildOptions{Projection: archive.Projection})
			require.NoError(t, err)
			eventually(t, 60*time.Second, func() bool {
				return state(t, s.Pool(), v2.Version) == version.StateReady &&
					count(t, c, fmt.Sprintf(`SELECT count(*) FROM %s.snapshots WHERE status = 'complete'`, pgx.Identifier{v2.Schema}.Sanitize())) == 2
			}, "the rebuild ready with both documents")
			require.Equal(t, want, docIDs(t, c, v2.Schema, tx))
			require.Equal(t, 0, count(t, c, fmt.Sprintf(`SELECT count(*) FROM %s.snapshots WHERE status <> 'complete'`, pgx.Identifier{v2.Schema}.Sanitize())))
			require.Equal(t, 6+tc.erasedRowLeft, count(t, c, fmt.Sprintf(`SELECT count(*) FROM %s.rows`, pgx.Identifier{v2.Schema}.Sanitize())))
		})
	}
}
