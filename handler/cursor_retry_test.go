package handler

import (
	"context"
	"fmt"
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

// refusedRange is a cursor handler (an hour's backoff) whose first batch,
// rows 1-3 of public.orders, was sent and refused: the range waits for
// its retry. It returns the rows' LSNs.
func (e *cursorEnv) refusedRange() (*batchReceiver, Def, []string, *Dispatcher) {
	e.t.Helper()
	secret := NewSecret()
	br, srv := newBatchReceiver(e.t, secret, refuseOnce)
	def := e.handler(srv.URL, secret, func(d *Def) { d.Backoff = time.Hour })
	lsns := e.archive("orders", true, 1, 2, 3)
	e.horizon(lsns[2])
	d := e.dispatcher()
	flushBriefly(e.t, d)
	require.Len(e.t, br.got(), 1, "rows 1-3 sent and refused: the range waits for its retry")
	return br, def, lsns, d
}

// A refused batch whose rows were all erased before its retry has
// nothing to resend: the cursor passes its range, and the rows after it
// are delivered (it was held for good before).
func TestCursorRetryOfAnErasedRangePassesIt(t *testing.T) {
	e := newCursorEnv(t)
	br, def, _, d := e.refusedRange()

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
	br, def, lsns, d := e.refusedRange()

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
// handler (StopCursorRows): the cursor leaves them out, its backlog
// does not count them, and Flush does not wait for them. Rows at or
// behind its claimed position (delivered, or in a batch in flight) are
// left alone: the batch in flight goes out whole.
func TestCursorLeavesOutRowsARestoreSuperseded(t *testing.T) {
	e := newCursorEnv(t)
	ctx := context.Background()
	br, def, first, d := e.refusedRange()
	more := e.archive("orders", true, 4, 5, 6)
	supersede := func(lsns ...string) int {
		var rows []CursorRow
		for _, l := range lsns {
			rows = append(rows, CursorRow{Source: "main", Schema: "public", Table: "orders", CommitLSN: l})
		}
		tx, err := e.pool.Begin(ctx)
		require.NoError(t, err)
		n, err := StopCursorRows(ctx, tx, rows, StopRestored)
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

// A handler of a table deleted from rarely passes the rows of other
// tables up to the horizon, with a partial batch or with none: its next
// claim reads only the rows archived since, not the stream from its last
// row (which every claim, and every poll, read before). A row of its table
// applied behind it later is then a late row, queued.
func TestCursorPassesOtherTablesUpToTheHorizon(t *testing.T) {
	e := newCursorEnv(t)
	secret := NewSecret()
	br, srv := newBatchReceiver(t, secret, func(int) int { return 200 })
	def := e.handler(srv.URL, secret) // Flush sends a partial batch at once
	order := e.archive("orders", true, 1)
	lines := e.archive("lines", true, 11, 12, 13)
	e.horizon(lines[2])
	d := e.dispatcher()
	e.flush(d)
	require.Len(t, br.got(), 1)
	require.Equal(t, idsOf(def.ID, order...), ids(br.got()[0]), "a partial batch of the one order")
	at, ok := e.cursorAt(def.ID)
	require.True(t, ok)
	require.Equal(t, lines[2], at, "the partial batch claimed up to the horizon")

	more := e.archive("lines", true, 14, 15)
	e.horizon(more[1])
	e.flush(d)
	require.Len(t, br.got(), 1, "nothing of the table: nothing sent")
	at, _ = e.cursorAt(def.ID)
	require.Equal(t, more[1], at, "no row of the table: the cursor moved to the horizon")

	last := e.archive("orders", true, 2)
	e.horizon(last[0])
	e.flush(d)
	require.Len(t, br.got(), 2)
	require.Equal(t, idsOf(def.ID, last...), ids(br.got()[1]))
	require.Equal(t, []string{"done:done:1", "done:done:1"}, e.settled(def.ID))
}

// A batch in flight whose settle Postgres aborts in a deadlock with an
// erasure of two of its rows (the erasure stops row 3's delivery, the
// settle inserts rows 1 and 2 and waits for row 3, the erasure then
// stops row 1's) is settled again: row 2, sent and accepted, is recorded
// done once and never sent again, rows 1 and 3 stay stopped, and the
// cursor passes the batch. (StopCursorRows inserts one call's rows in
// commit order, so one erasure cannot wait in this order; the two calls
// here take the locks of two erasures of the same batch.) Without the
// settle's retry, the claim stayed held until it expired and row 2 was
// sent a second time under another webhook-id.
func TestCursorSettleOutlivesADeadlockWithAnErasure(t *testing.T) {
	e := newCursorEnv(t)
	ctx := context.Background()
	secret := NewSecret()
	br, srv := newBatchReceiver(t, secret, answers())
	def := e.handler(srv.URL, secret, func(d *Def) { d.ClaimTimeout = 30 * time.Second })
	lsns := e.archive("orders", true, 1, 2, 3)
	e.horizon(lsns[2])
	d := e.dispatcher()
	live, err := d.live(ctx)
	require.NoError(t, err)
	send, tok, _, _, err := d.cursorClaim(ctx, def, live)
	require.NoError(t, err)
	require.Len(t, send, 3)

	row := func(l string) []CursorRow {
		return []CursorRow{{Source: "main", Schema: "public", Table: "orders", CommitLSN: l}}
	}
	etx, err := e.pool.Begin(ctx)
	require.NoError(t, err)
	defer etx.Rollback(ctx) //nolint:errcheck
	_, err = etx.Exec(ctx, `DELETE FROM archive_v1.rows WHERE commit_lsn = ANY($1::pg_lsn[])`, []string{lsns[0], lsns[2]})
	require.NoError(t, err)
	_, err = StopCursorRows(ctx, etx, row(lsns[2]), StopErased)
	require.NoError(t, err)

	settled := make(chan error, 1)
	go func() { settled <- d.cursorSend(context.Background(), def, live, send, tok, time.Now()) }()
	waitsForALock(t, e.pool, "WITH adv AS (UPDATE epitaph.handler_cursors", "the settle waits for the erasure's row 3")
	require.Len(t, br.got(), 1, "the batch was sent and accepted")

	// The erasure now waits for the settle's row 1: Postgres aborts one
	// of them (the settle, which waited first, in practice).
	_, eraseErr := StopCursorRows(ctx, etx, row(lsns[0]), StopErased)
	if eraseErr != nil {
		t.Skip("the erasure was the deadlock's victim (erase retries it): this run does not test the settle")
	}
	require.NoError(t, etx.Commit(ctx))
	select {
	case err := <-settled:
		require.NoError(t, err, "the settle runs again after the deadlock")
	case <-time.After(20 * time.Second):
		t.Fatal("the settle did not end")
	}
	require.Equal(t, []string{"stopped:stop_revoked:0", "done:done:1", "stopped:stop_revoked:0"}, e.settled(def.ID))
	at, _ := e.cursorAt(def.ID)
	require.Equal(t, lsns[2], at, "the cursor passed the batch")
	_, err = e.pool.Exec(ctx, `UPDATE epitaph.handler_cursors SET claim_expires_at = now() - interval '1 second' WHERE handler_id = $1`, def.ID)
	require.NoError(t, err)
	e.flush(d)
	require.Equal(t, idsOf(def.ID, lsns...), sentIDs(br), "every row sent once, in the one batch")
}

// A retry resends its batch's whole range: while a row of the range reads
// unverified (a version promoted while the batch waited for its retry may
// not have applied the row's commit yet), the retry waits, and sends the
// whole range once it is verified. Before, the retry sent the rows before
// it and the settle passed the rest, never sent; with the first row
// unverified, the whole range was passed unsent.
func TestCursorRetryWaitsForAnUnverifiedRowOfItsRange(t *testing.T) {
	for _, unverified := range []int{0, 1} {
		t.Run(fmt.Sprint("row ", unverified+1), func(t *testing.T) {
			e := newCursorEnv(t)
			ctx := context.Background()
			br, def, lsns, d := e.refusedRange()

			setVerified := func(v bool) {
				_, err := e.pool.Exec(ctx, `UPDATE archive_v1.rows SET verified = $2 WHERE commit_lsn = $1::pg_lsn`, lsns[unverified], v)
				require.NoError(t, err)
			}
			setVerified(false)
			e.dueNow(def.ID)
			flushBriefly(t, d)
			require.Len(t, br.got(), 1, "no partial resend")
			require.Empty(t, e.settled(def.ID), "nothing passed")

			setVerified(true)
			flushBriefly(t, d)
			posts := br.got()
			require.Len(t, posts, 2)
			require.Equal(t, ids(posts[0]), ids(posts[1]), "the whole range, resent")
			require.Equal(t, []string{"done:done:2", "done:done:2", "done:done:2"}, e.settled(def.ID))
		})
	}
}
