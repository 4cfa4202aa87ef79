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
