package snapshot_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/projection/snapshot"
)

// RunBatchFor (what the projector runs right after committing commits it
// left pending jobs for) claims the jobs of the transactions it is given
// and no others, each once, and skips jobs another batch holds.
func TestRunBatchForClaimsOnlyTheGivenTransactions(t *testing.T) {
	t.Parallel()
	e := setup(t)
	txs := make([]*sourceTx, 3)
	for i := range txs {
		e.seedOrder(t, i+1, 1)
		txs[i] = e.begin(t)
		txs[i].deleteOrder(t, i+1)
		require.Equal(t, 1, txs[i].apply(t, orderRoots))
	}
	ref := func(s *sourceTx) snapshot.TxRef {
		return snapshot.TxRef{Source: s.commit.Source, XID: s.commit.XID, CommitLSN: s.commit.CommitLSN}
	}
	res, err := snapshot.RunBatchFor(e.ctx, e.pool, snapshot.Config{Schema: "archive_v1"}, nil)
	require.NoError(t, err)
	require.Zero(t, res)

	// Another batch holds the third transaction's job.
	holder, err := e.pool.Begin(e.ctx)
	require.NoError(t, err)
	defer holder.Rollback(e.ctx) //nolint:errcheck // a test's lock holder
	_, err = holder.Exec(e.ctx, `SELECT id FROM archive_v1.snapshots WHERE correlation_id = $1 FOR UPDATE`, txs[2].correlationID())
	require.NoError(t, err)

	res, err = snapshot.RunBatchFor(e.ctx, e.pool, snapshot.Config{Schema: "archive_v1"},
		[]snapshot.TxRef{ref(txs[0]), ref(txs[0]), ref(txs[2])})
	require.NoError(t, err)
	require.Equal(t, snapshot.Result{Claimed: 1, Completed: 1}, res)
	status := func(i int) string { return e.show(t, txs[i].correlationID())[fmt.Sprintf(`{"id":%d}`, i+1)].Status }
	require.Equal(t, snapshot.StatusComplete, status(0))
	require.Equal(t, snapshot.StatusPending, status(1), "not given")
	require.Equal(t, snapshot.StatusPending, status(2), "held by another batch")
	d := decodeDoc(t, e.show(t, txs[0].correlationID())[`{"id":1}`])
	require.Equal(t, len(txs[0].rows), d.Meta.EntityCount)
	require.NoError(t, holder.Rollback(e.ctx))

	// The batcher's batch does the rest, the completed one untouched.
	require.Equal(t, snapshot.Result{Claimed: 2, Completed: 2}, e.batch(t, snapshot.Config{}))
	for i := range txs {
		require.Equal(t, snapshot.StatusComplete, status(i))
	}
}
