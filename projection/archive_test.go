package projection_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
)

// Roots are computed in memory when a whole transaction is in one page,
// and in SQL at its commit when it spans pages (batch size 2): the same.
func TestArchiveRowsRootsAndExpiry(t *testing.T) {
	t.Parallel()
	for _, batch := range []int{500, 2} {
		t.Run(fmt.Sprintf("batch=%d", batch), func(t *testing.T) {
			t.Parallel()
			testArchiveRowsRootsAndExpiry(t, batch)
		})
	}
}

func testArchiveRowsRootsAndExpiry(t *testing.T, batch int) {
	e := newEnv(t, 4)
	cfg := e.config("w1")
	cfg.BatchSize = batch
	cfg.ArchiveTTL = map[string]time.Duration{"public.order_lines": 24 * 3650 * time.Hour, "*": 48 * 3650 * time.Hour, "public.keep": 0}
	delete(cfg.ArchiveTTL, "public.keep")
	s := e.start(cfg)

	// An order with 3 lines deleted by cascade; the customer it references
	// is not deleted in the same transaction, so the order is the root.
	t1 := e.nextTx(orderRows(1, 3)...)
	e.publish(t1)
	// A customer deleted together with its order and a line: the customer
	// is the only root. Plus a self-referencing pair of categories.
	t2 := e.nextTx(append([]row{{schema: "public", table: "customers", key: `{"id":7}`, image: `{"id":7,"name":"Ada"}`}},
		append(orderRows(2, 1),
			row{schema: "public", table: "categories", key: `{"id":1}`, image: `{"id":1,"parent_id":null}`,
				refs: []event.Ref{{Columns: []string{"parent_id"}, Schema: "public", Table: "categories", RefColumns: []string{"id"}}}},
			row{schema: "public", table: "categories", key: `{"id":2}`, image: `{"id":2,"parent_id":1}`,
				refs: []event.Ref{{Columns: []string{"parent_id"}, Schema: "public", Table: "categories", RefColumns: []string{"id"}}}},
		)...)...)
	e.publish(t2)
	// Children before their parent (explicit deletes in that order).
	rs3 := orderRows(3, 2)
	t3 := e.nextTx(rs3[1], rs3[2], rs3[0])
	e.publish(t3)
	hb := e.heartbeat()

	c := e.conn()
	eventually(t, 20*time.Second, func() bool {
		return count(t, c, `SELECT count(*) FROM archive.rows WHERE is_root IS NOT NULL`) == 4+5+3
	})
	require.Equal(t, 1, count(t, c, `SELECT count(*) FROM archive.rows WHERE commit_lsn = $1::pg_lsn AND is_root`, t3.lsn.String()))
	require.Equal(t, 1, count(t, c, `SELECT count(*) FROM archive.rows WHERE commit_lsn = $1::pg_lsn AND is_root AND table_name = 'orders'`, t3.lsn.String()))
	ctx := context.Background()
	type got struct {
		table  string
		root   bool
		corr   string
		expiry *time.Time
		commit time.Time
	}
	rows, err := c.Query(ctx, `SELECT table_name, is_root, correlation_id, expires_at, commit_time FROM archive.rows
		WHERE commit_lsn = $1::pg_lsn ORDER BY seq`, t1.lsn.String())
	require.NoError(t, err)
	var g []got
	for rows.Next() {
		var x got
		require.NoError(t, rows.Scan(&x.table, &x.root, &x.corr, &x.expiry, &x.commit))
		g = append(g, x)
	}
	require.NoError(t, rows.Err())
	require.Len(t, g, 4)
	require.Equal(t, "orders", g[0].table)
	require.True(t, g[0].root)
	for _, x := range g[1:] {
		require.False(t, x.root, "lines are children of the order deleted with them")
		require.Equal(t, x.commit.Add(24*3650*time.Hour).UTC(), x.expiry.UTC())
	}
	require.Equal(t, g[0].commit.Add(48*3650*time.Hour).UTC(), g[0].expiry.UTC(), "* applies to other tables")
	require.Equal(t, event.CorrelationID(src, t1.xid, t1.lsn), g[0].corr)
	require.True(t, g[0].commit.Equal(t1.time))

	var roots []string
	rs, err := c.Query(ctx, `SELECT table_name || ':' || (key->>'id') FROM archive.rows
		WHERE commit_lsn = $1::pg_lsn AND is_root ORDER BY seq`, t2.lsn.String())
	require.NoError(t, err)
	for rs.Next() {
		var s string
		require.NoError(t, rs.Scan(&s))
		roots = append(roots, s)
	}
	require.Equal(t, []string{"customers:7", "categories:1"}, roots)

	// Values are stored as published.
	var image string
	require.NoError(t, c.QueryRow(ctx, `SELECT row::text FROM archive_v1.rows WHERE table_name = 'orders' AND key = '{"id":1}'`).Scan(&image))
	require.JSONEq(t, `{"id":1,"customer_id":7,"total":"12.50"}`, image)

	// Watermark and status: every partition reflects the source up to the
	// heartbeat; the view says it is ready; no lag.
	eventually(t, 10*time.Second, func() bool {
		return count(t, c, `SELECT count(*) FROM epitaph.progress WHERE source_lsn = $1::pg_lsn`, hb.String()) == 4
	})
	// Ready once a worker has sampled the lag (every StatusInterval).
	var ready bool
	var srcLSN, complete string
	eventually(t, 10*time.Second, func() bool {
		require.NoError(t, c.QueryRow(ctx, `SELECT ready, source_lsn::text, complete_up_to_lsn::text FROM archive.status WHERE version = 1`).Scan(&ready, &srcLSN, &complete))
		return ready
	})
	require.Equal(t, hb.String(), srcLSN)
	require.Equal(t, hb.String(), complete)
	st, err := s.Status(ctx)
	require.NoError(t, err)
	require.Len(t, st.Versions, 1)
	require.Equal(t, "live", st.Versions[0].State)
	require.Equal(t, "live", st.Versions[0].Health)
	require.Len(t, st.Versions[0].Partitions, 4)
	require.Zero(t, st.Versions[0].LagEvents)
	for _, p := range st.Versions[0].Partitions {
		require.Equal(t, "w1", p.Owner)
		require.True(t, p.Leased)
		require.NotZero(t, p.Cursor)
	}
}

// The runtime creates snapshot jobs when it applies a commit, and the
// batcher it runs completes them; archive.snapshots shows the live
// version's documents.
func TestSnapshotJobsThroughRuntime(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	cfg := e.config("w1")
	cfg.SnapshotRoots = []string{"public.orders"}
	e.start(cfg)
	t1 := e.nextTx(append(orderRows(1, 2), orderRows(2, 1)...)...)
	e.publish(t1)
	c := e.conn()
	eventually(t, 30*time.Second, func() bool {
		return count(t, c, `SELECT count(*) FROM archive.snapshots WHERE status = 'complete'`) == 2
	})
	var lines int
	require.NoError(t, c.QueryRow(context.Background(), `SELECT jsonb_array_length(payload->'children'->'public.order_lines')
		FROM archive.snapshots WHERE root_key = '{"id":1}'`).Scan(&lines))
	require.Equal(t, 2, lines)
	require.Equal(t, 1, count(t, c, `SELECT count(*) FROM archive.snapshots WHERE correlation_id = $1 AND root_key = '{"id":2}'`,
		event.CorrelationID(src, t1.xid, t1.lsn)))
}

// A transaction much larger than a page (40 pages): every row archived
// once, roots decided across pages (orders root, every line not).
func TestLargeTransactionAcrossPages(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	var rows []row
	for o := 0; o < 2000; o++ {
		rows = append(rows, orderRows(o+1, 9)...)
	}
	tx := e.nextTx(rows...)
	e.publishAll(e.messages(tx))
	e.start(e.config("w1"))
	c := e.conn()
	eventually(t, 60*time.Second, func() bool {
		return count(t, c, `SELECT count(*) FROM archive.rows WHERE is_root IS NOT NULL`) == 20000
	})
	require.Equal(t, 2000, count(t, c, `SELECT count(*) FROM archive.rows WHERE is_root`))
	require.Equal(t, 2000, count(t, c, `SELECT count(*) FROM archive.rows WHERE is_root AND table_name = 'orders'`))
	require.Equal(t, 1, count(t, c, `SELECT count(DISTINCT correlation_id) FROM archive.rows`))
}
