package projection_test

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/projection"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/erasure"
	"github.com/epitaph-dev/epitaph/projection/status"
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

// docsOf are the documents of every transaction in schema's version, as
// docIDs lists them, in transaction order.
func docsOf(t *testing.T, c *pgx.Conn, schema string, txs ...*txn) []string {
	t.Helper()
	var out []string
	for _, tx := range txs {
		out = append(out, docIDs(t, c, schema, tx)...)
	}
	return out
}

// Erasing with --purge-stream an order (its own document's root) of a
// transaction that deleted other orders, before a version reached that
// transaction: a rebuilt version, and a second target started after the
// purge, verify the transaction from the erasure ledger, take the purged
// rows out of its documents' expected counts, complete every other
// document with exactly its own rows and become ready. The erased rows are
// nowhere: no version's rows, no document, no quarantine entry. Orders 2
// (with its lines) and 5 (without) are purged, order 3 is fenced only: the
// second target, which never erased it, keeps it.
func TestPurgeInsideSharedTxRebuildCompletesDocuments(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	e.signer = testenv.NewSignerV2()
	ctx := context.Background()
	snapshotConfig := func(worker string) projection.Config {
		cfg := retentionConfig(e, worker)
		cfg.SnapshotRoots = []string{"public.orders"}
		return cfg
	}
	s := e.start(snapshotConfig("w1"))
	var rowsA, rowsB []row
	for _, o := range []int{1, 2, 3, 4} {
		rowsA = append(rowsA, orderRows(o, 2)...)
	}
	for _, o := range []int{5, 6} {
		rowsB = append(rowsB, orderRows(o, 2)...)
	}
	txA, txB := e.nextTx(rowsA...), e.nextTx(rowsB...)
	e.publish(txA)
	e.publish(txB)
	c := e.conn()
	eventually(t, 30*time.Second, func() bool {
		return count(t, c, `SELECT count(*) FROM archive_v1.snapshots WHERE status = 'complete'`) == 6
	})

	pool := newPool(t, e.url)
	for _, er := range []struct {
		order         int
		children      bool
		purge         bool
		streamRemoved int
	}{
		{order: 2, children: true, purge: true, streamRemoved: 3},
		{order: 5, purge: true, streamRemoved: 1},
		{order: 3, children: true},
	} {
		rc, err := erasure.Erase(ctx, pool, erasure.EraseOptions{Table: "public.orders", Key: json.RawMessage(fmt.Sprintf(`{"id":%d}`, er.order)),
			WithChildren: er.children, Actor: "dpo", PurgeStream: er.purge})
		require.NoError(t, err)
		if er.purge {
			rc, err = erasure.PurgeStream(ctx, pool, e.js, src, rc.ID)
			require.NoError(t, err)
			require.Equal(t, er.streamRemoved, rc.Removed["stream:"+event.StreamName(src)], "order %d", er.order)
		}
	}

	// The oracle: per version, its rows and its documents.
	all := []string{"order_lines:1000", "order_lines:1001", "order_lines:2000", "order_lines:2001", "order_lines:3000", "order_lines:3001",
		"order_lines:4000", "order_lines:4001", "order_lines:5000", "order_lines:5001", "order_lines:6000", "order_lines:6001",
		"orders:1", "orders:2", "orders:3", "orders:4", "orders:5", "orders:6"}
	minus := func(gone ...string) []string {
		var out []string
		for _, k := range all {
			if !slices.Contains(gone, k) {
				out = append(out, k)
			}
		}
		return out
	}
	purged := []string{"order_lines:2000", "order_lines:2001", "orders:2", "orders:5"}
	wantRows := minus(append(slices.Clone(purged), "order_lines:3000", "order_lines:3001", "orders:3")...)
	wantDocs := []string{"1 complete 1,1000,1001", "4 complete 4,4000,4001", "6 complete 6,6000,6001"}
	keys := func(c *pgx.Conn, schema string) []string {
		return keysOf(t, c, fmt.Sprintf(`SELECT table_name || ':' || (key->>'id') FROM %s.rows ORDER BY 1`, pgx.Identifier{schema}.Sanitize()))
	}
	// checkTarget checks a version of a target against the oracle, row by
	// row and document by document, and that nothing erased is anywhere.
	checkTarget := func(c *pgx.Conn, schema string, rows, docs []string) {
		t.Helper()
		require.Equal(t, rows, keys(c, schema))
		require.Equal(t, docs, docsOf(t, c, schema, txA, txB))
		require.Equal(t, 0, count(t, c, fmt.Sprintf(`SELECT count(*) FROM %s.snapshots WHERE status <> 'complete'`, pgx.Identifier{schema}.Sanitize())))
		require.Equal(t, 0, count(t, c, `SELECT count(*) FROM epitaph.quarantine`))
		require.Equal(t, 0, count(t, c, fmt.Sprintf(`SELECT count(*) FROM %s.gaps`, pgx.Identifier{schema}.Sanitize())))
	}
	eventually(t, 30*time.Second, func() bool {
		return count(t, c, `SELECT count(*) FROM archive_v1.snapshots WHERE status = 'complete'`) == len(wantDocs)
	}, "the live version's other documents complete again")
	checkTarget(c, "archive_v1", wantRows, wantDocs)

	// A rebuild: it never sees the purged messages.
	v2, err := version.CreateVersion(ctx, s.Pool(), e.js, version.RebuildOptions{Projection: archive.Projection})
	require.NoError(t, err)
	e.heartbeat()
	eventually(t, 60*time.Second, func() bool {
		return state(t, s.Pool(), v2.Version) == version.StateReady &&
			count(t, c, fmt.Sprintf(`SELECT count(*) FROM %s.snapshots WHERE status = 'complete'`, pgx.Identifier{v2.Schema}.Sanitize())) == len(wantDocs)
	}, "the rebuilt version is ready with every other document complete")
	checkTarget(c, v2.Schema, wantRows, wantDocs)

	// A second target (its own database and consumer group), started
	// after the purge: it knows the purge from the ledger only.
	url2 := testenv.NewDatabase(t)
	cfg2 := snapshotConfig("t2")
	cfg2.TargetURL = testenv.NoSearchPath(url2)
	cfg2.Group = "second"
	e.start(cfg2)
	e.heartbeat()
	c2, err := pgx.Connect(ctx, url2)
	require.NoError(t, err)
	t.Cleanup(func() { c2.Close(context.Background()) })
	rows2 := minus(purged...)
	docs2 := []string{"1 complete 1,1000,1001", "3 complete 3,3000,3001", "4 complete 4,4000,4001", "6 complete 6,6000,6001"}
	var last status.Readiness
	eventually(t, 60*time.Second, func() bool {
		rs, err := status.ReadReadiness(ctx, c2, archive.Projection)
		require.NoError(t, err)
		if len(rs) != 1 {
			return false
		}
		last = rs[0]
		return last.Ready && count(t, c2, `SELECT count(*) FROM archive_v1.snapshots WHERE status = 'complete'`) == len(docs2)
	}, "the second target is ready with every document but the purged ones complete: %+v", &last)
	checkTarget(c2, "archive_v1", rows2, docs2)
}
