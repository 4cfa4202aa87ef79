package handler

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// refuseOnce is a receiver answer refusing the first POST.
func refuseOnce(n int) int {
	if n == 1 {
		return 503
	}
	return 200
}

// flushBriefly runs Flush for at most a second: long enough to send what
// is due, not to wait out an hour's backoff.
func flushBriefly(t *testing.T, d *Dispatcher) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_, err := d.Flush(ctx)
	require.NoError(t, err)
}

// dueNow ends a failed batch's backoff.
func (e *cursorEnv) dueNow(handlerID string) {
	e.t.Helper()
	_, err := e.pool.Exec(context.Background(), `UPDATE epitaph.handler_cursors SET next_attempt_at = now() WHERE handler_id = $1::uuid`, handlerID)
	require.NoError(e.t, err)
}

// A refused batch whose rows were all erased before its retry has
// nothing to resend: the cursor passes its range, and the rows after it
// are delivered (it was held for good before).
func TestCursorRetryOfAnErasedRangePassesIt(t *testing.T) {
	e := newCursorEnv(t)
	secret := NewSecret()
	br, srv := newBatchReceiver(t, secret, refuseOnce)
	def := e.handler(srv.URL, secret, func(d *Def) { d.Backoff = time.Hour })
	lsns := e.archive("orders", true, 1, 2, 3)
	e.horizon(lsns[2])
	d := e.dispatcher()
	flushBriefly(t, d)
	require.Len(t, br.got(), 1, "the batch was sent and refused")

	_, err := e.pool.Exec(context.Background(), `DELETE FROM archive_v1.rows WHERE table_name = 'orders'`)
	require.NoError(t, err)
	e.dueNow(def.ID)
	later := e.archive("orders", true, 4)
	e.horizon(later[0])
	e.flush(d)
	posts := br.got()
	require.Len(t, posts, 2, "no resend of the erased range, then the next row")
	require.Equal(t, idsOf(def.ID, later...), ids(posts[1]))
}

// A retried batch waits until the horizon covers its whole range again
// (a promotion of a version that lags lowers it): resending the part
// behind the horizon would settle, and pass, the rest unsent.
func TestCursorRetryWaitsForTheHorizonToCoverItsRange(t *testing.T) {
	e := newCursorEnv(t)
	secret := NewSecret()
	br, srv := newBatchReceiver(t, secret, refuseOnce)
	def := e.handler(srv.URL, secret, func(d *Def) { d.Backoff = time.Hour })
	lsns := e.archive("orders", true, 1, 2, 3)
	e.horizon(lsns[2])
	d := e.dispatcher()
	flushBriefly(t, d)
	require.Len(t, br.got(), 1)

	e.horizon(lsns[1]) // the range's last row is past the horizon now
	e.dueNow(def.ID)
	flushBriefly(t, d)
	require.Len(t, br.got(), 1, "nothing resent while the range is not behind the horizon")

	e.horizon(lsns[2])
	e.flush(d)
	posts := br.got()
	require.Len(t, posts, 2)
	require.Equal(t, idsOf(def.ID, lsns...), ids(posts[1]), "the whole range, once")
	require.Equal(t, string(posts[0].body), string(posts[1].body), "byte-identical")
	require.Equal(t, []string{"done:done:2", "done:done:2", "done:done:2"}, e.settled(def.ID))
}

// Rows a restore put back before their batch are stopped for a cursor
// handler (SupersedeCursorRows): the cursor leaves them out, its backlog
// does not count them, and Flush does not wait for them. Rows at or
// behind its claimed position (delivered, or in a batch in flight) are
// left alone: the batch in flight goes out whole.
func TestCursorLeavesOutRowsARestoreSuperseded(t *testing.T) {
	e := newCursorEnv(t)
	ctx := context.Background()
	secret := NewSecret()
	br, srv := newBatchReceiver(t, secret, refuseOnce)
	def := e.handler(srv.URL, secret, func(d *Def) { d.Backoff = time.Hour })
	first := e.archive("orders", true, 1, 2, 3)
	e.horizon(first[2])
	d := e.dispatcher()
	flushBriefly(t, d) // refused: rows 1-3 are a batch waiting for its retry
	require.Len(t, br.got(), 1)
	more := e.archive("orders", true, 4, 5, 6)
	supersede := func(lsns ...string) int {
		var rows []CursorRow
		for _, l := range lsns {
			rows = append(rows, CursorRow{Source: "main", Schema: "public", Table: "orders", CommitLSN: l})
		}
		tx, err := e.pool.Begin(ctx)
		require.NoError(t, err)
		n, err := SupersedeCursorRows(ctx, tx, rows)
		require.NoError(t, err)
		require.NoError(t, tx.Commit(ctx))
		return n
	}
	require.Equal(t, 1, supersede(first[1], more[1]), "row 2 is in the batch in flight; row 5 is pending")
	require.Zero(t, supersede(more[1]), "once")

	bs, err := CursorBacklogs(ctx, e.pool, []Def{def})
	require.NoError(t, err)
	require.Equal(t, int64(5), bs[def.ID].Pending, "rows 1-3 wait for their retry, 4 and 6 for the cursor; row 5 is stopped")

	e.dueNow(def.ID)
	e.horizon(more[2])
	e.flush(d)
	posts := br.got()
	require.Len(t, posts, 3)
	require.Equal(t, idsOf(def.ID, first...), ids(posts[1]), "the batch in flight, whole")
	require.Equal(t, idsOf(def.ID, more[0], more[2]), ids(posts[2]), "row 5 left out")
	require.Equal(t, []string{"done:done:2", "done:done:2", "done:done:2", "done:done:1", "stopped:stop_superseded:0", "done:done:1"},
		e.settled(def.ID))
}
