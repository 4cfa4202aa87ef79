package revalidate_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/handler/revalidate"
)

// A claimed batch is decided as its deliveries one by one, in a constant
// number of statements for the cheap path: one read of the deliveries, one
// aggregate for all their groups, one source read for their table, and a
// full read only for the delivery whose pair differs.
func TestBatchDecidesAsOneByOne(t *testing.T) {
	e := setup(t)
	g := e.newGroup()
	var ids []string
	for i := range 20 {
		e.archive(g, i, int64(100+i), "row")
	}
	for i := range 20 {
		ids = append(ids, e.queue(e.handler, g, i, int64(100+i))) // unchanged: send, cheap
	}
	back := e.newGroup()
	e.archive(back, 0, 7, "eve")
	ids = append(ids, e.queue(e.handler, back, 0, 7))
	_, err := e.source.Exec(e.ctx, `INSERT INTO public.customers VALUES (7, 'back')`)
	require.NoError(t, err)
	grown := e.newGroup()
	e.archive(grown, 0, 8, "fay")
	ids = append(ids, e.queue(e.handler, grown, 0, 8))
	e.archive(grown, 1, 9, "gus") // added after queued: changed, full read
	gone := e.newGroup()
	e.archive(gone, 0, 10, "hal")
	ids = append(ids, e.queue(e.handler, gone, 0, 10))
	e.exec(`UPDATE archive_v1.rows SET expires_at = now() - interval '1 second' WHERE commit_lsn = $1::pg_lsn`, gone.lsn)
	ids = append(ids, "00000000-0000-4000-8000-00000000dead") // no such delivery

	alone := make([]revalidate.Result, len(ids))
	aloneErr := make([]error, len(ids))
	for i, id := range ids {
		alone[i], aloneErr[i] = e.ev.Evaluate(e.ctx, id)
	}
	tm, sm := e.targetQ.mark(), e.sourceQ.mark()
	batch, errs := e.ev.EvaluateBatch(e.ctx, ids)
	require.Equal(t, 3, e.targetQ.since(tm, ""), "the deliveries, the aggregate, one full read")
	require.Equal(t, 1, e.targetQ.since(tm, "sha256("), "the set read once, for the changed delivery")
	require.Equal(t, 1, e.sourceQ.since(sm, "customers"), "one source read for the table")

	require.Len(t, batch, len(ids))
	for i := range ids {
		require.Equal(t, alone[i].Outcome, batch[i].Outcome, ids[i])
		require.Equal(t, alone[i].Reason, batch[i].Reason, ids[i])
		require.Equal(t, alone[i].Path, batch[i].Path, ids[i])
		require.Equal(t, alone[i].ObservedFingerprint, batch[i].ObservedFingerprint, ids[i])
		require.Equal(t, aloneErr[i], errs[i], ids[i])
	}
	for i := range 20 {
		require.Equal(t, revalidate.Send, batch[i].Outcome)
		require.Equal(t, revalidate.PathCheap, batch[i].Path)
	}
	want := []revalidate.Outcome{revalidate.StopSuperseded, revalidate.StopChanged, revalidate.StopCompleted}
	for j, o := range want {
		require.Equal(t, o, batch[20+j].Outcome, ids[20+j])
	}
	require.ErrorIs(t, errs[23], revalidate.ErrNoDelivery)
}

// A key the source rejects defers its own delivery only: the batch's other
// deliveries of the table are decided as alone.
func TestBatchRejectedKeyDefersAlone(t *testing.T) {
	e := setup(t)
	g := e.newGroup()
	e.archive(g, 0, 1, "ada")
	good := e.queue(e.handler, g, 0, 1)
	bad := e.newGroup()
	e.archive(bad, 0, 2, "bob")
	badID := e.queue(e.handler, bad, 0, 2)
	e.exec(`UPDATE epitaph.deliveries SET key = '{"id":"not a number"}' WHERE id = $1`, badID)

	res, errs := e.ev.EvaluateBatch(e.ctx, []string{good, badID})
	require.NoError(t, errs[0])
	require.NoError(t, errs[1])
	require.Equal(t, revalidate.Send, res[0].Outcome)
	require.Equal(t, revalidate.Defer, res[1].Outcome)
	require.Equal(t, revalidate.ReasonSourceKeyInvalid, res[1].Reason)
}
