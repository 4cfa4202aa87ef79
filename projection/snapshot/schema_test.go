package snapshot_test

import (
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/projection/snapshot"
)

// The snapshots table keeps exactly the indexes something reads by: a
// version made before, with the (source, commit_lsn) index its jobs were
// once found by, loses it at the next Migrate (every start runs it), and
// its jobs are still claimed and completed, by the batch and by
// RunBatchFor, through correlation_id.
func TestMigrateDropsTheTransactionIndex(t *testing.T) {
	t.Parallel()
	e := setup(t)
	indexes := func() []string {
		rows, err := e.pool.Query(e.ctx, `SELECT indexname FROM pg_indexes
			WHERE schemaname = 'archive_v1' AND tablename = 'snapshots' ORDER BY 1`)
		require.NoError(t, err)
		names, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		return names
	}
	want := []string{"snapshots_correlation_id_root_table_root_key_key", "snapshots_due", "snapshots_failed",
		"snapshots_pending_since", "snapshots_pkey", "snapshots_root_idx"}
	require.Equal(t, want, indexes(), "a new version")

	// A version made before: the index is there, with pending jobs.
	e.exec(t, `CREATE INDEX snapshots_tx ON archive_v1.snapshots (source, commit_lsn)`)
	require.Contains(t, indexes(), "snapshots_tx")
	txs := make([]*sourceTx, 2)
	for i := range txs {
		e.seedOrder(t, i+1, 2)
		txs[i] = e.begin(t)
		txs[i].deleteOrder(t, i+1)
		require.Equal(t, 1, txs[i].apply(t, orderRoots))
	}

	require.NoError(t, snapshot.Migrate(e.ctx, e.pool, e.schema))
	require.Equal(t, want, indexes(), "after Migrate")
	require.NoError(t, snapshot.Migrate(e.ctx, e.pool, e.schema))
	require.Equal(t, want, indexes(), "Migrate again")

	res, err := snapshot.RunBatchFor(e.ctx, e.pool, snapshot.Config{Schema: e.schema},
		[]snapshot.TxRef{{Source: txs[0].commit.Source, XID: txs[0].commit.XID, CommitLSN: txs[0].commit.CommitLSN}})
	require.NoError(t, err)
	require.Equal(t, snapshot.Result{Claimed: 1, Completed: 1}, res)
	require.Equal(t, snapshot.Result{Claimed: 1, Completed: 1}, e.batch(t, snapshot.Config{}))
	for i, s := range txs {
		d := decodeDoc(t, e.show(t, s.correlationID())[fmt.Sprintf(`{"id":%d}`, i+1)])
		require.Equal(t, len(s.rows), d.Meta.EntityCount, "order %d", i+1)
	}
}
