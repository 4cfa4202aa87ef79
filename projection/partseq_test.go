package projection_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/status"
)

// shortDedup makes the stream's duplicate window short, so a message
// published again verbatim (same Nats-Msg-Id, same signature) is stored
// again once the window passed: what an attacker holding a publishing
// credential does after waiting out the production window.
func shortDedup(t *testing.T, e *env) {
	t.Helper()
	ctx := context.Background()
	st, err := e.js.Stream(ctx, event.StreamName(src))
	require.NoError(t, err)
	cfg := st.CachedInfo().Config
	cfg.Duplicates = 500 * time.Millisecond
	_, err = e.js.UpdateStream(ctx, cfg)
	require.NoError(t, err)
}

// republish publishes m again verbatim, retrying until JetStream stores it
// as a new message (the duplicate window passed).
func republish(t *testing.T, e *env, m *nats.Msg) {
	t.Helper()
	again := nats.NewMsg(m.Subject)
	again.Data = m.Data
	for k, v := range m.Header {
		again.Header[k] = append([]string(nil), v...)
	}
	eventually(t, 20*time.Second, func() bool {
		ack, err := e.js.PublishMsg(context.Background(), again)
		require.NoError(t, err)
		return !ack.Duplicate
	}, "the duplicate window passes")
}

// signedTx publishes tx signed as the capture does and returns its
// messages as published (with their trust headers).
func signedTx(t *testing.T, e *env, tx *txn) []*nats.Msg {
	t.Helper()
	msgs := e.messages(tx)
	for _, m := range msgs {
		_, err := e.pubMsg(context.Background(), m)
		require.NoError(t, err)
	}
	return msgs
}

func readiness(t *testing.T, e *env) status.Readiness {
	t.Helper()
	c := e.conn()
	rs, err := status.ReadReadiness(context.Background(), c, archive.Projection)
	require.NoError(t, err)
	require.Len(t, rs, 1)
	return rs[0]
}

// An applied signed transaction (rows and commit) and a heartbeat,
// published again verbatim by a holder of a publishing credential: the
// projector recognises the replay (partition sequence not above the last
// applied one, position not new), ignores it and counts it; the archive is
// unchanged row by row, no gap is recorded, nothing is quarantined, the
// target stays ready and the next real transaction continues.
func TestReplayedSignedTransactionIsIgnored(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	shortDedup(t, e)
	svc := e.start(e.config("w1"))
	c := e.conn()
	tx1, tx2 := e.nextTx(orderRows(1, 2)...), e.nextTx(orderRows(2, 1)...)
	m1 := signedTx(t, e, tx1) // seq 1-4
	m2 := signedTx(t, e, tx2) // seq 5-7
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == 7 })
	require.Equal(t, expected(t, c, tx1, tx2), archived(t, c, "archive.rows"))

	for _, m := range m1 {
		republish(t, e, m) // seq 8-11
	}
	republish(t, e, m2[len(m2)-1]) // seq 12: tx2's commit alone
	tx3 := e.nextTx(orderRows(3, 1)...)
	signedTx(t, e, tx3) // seq 13-15, partition sequences 8-10
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == 15 })

	require.Equal(t, expected(t, c, tx1, tx2, tx3), archived(t, c, "archive.rows"))
	require.Equal(t, 0, count(t, c, `SELECT count(*) FROM archive_v1.rows WHERE NOT verified`))
	require.Empty(t, gaps(t, c, 0))
	require.Equal(t, 0, count(t, c, `SELECT count(*) FROM archive_v1.gaps`))
	require.Empty(t, quarantined(t, c))
	require.Equal(t, 2.0, metricSum(t, svc, "epitaph_projector_replayed_events_total"), "the two replayed commits")
	eventually(t, 20*time.Second, func() bool { return readiness(t, e).Ready }, "still ready")
	wctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	_, err := status.WaitComplete(wctx, c, archive.Projection, tx3.lsn, 0)
	require.NoError(t, err, "wait --lsn for the next real transaction succeeds")
}

// A signed message whose partition sequence goes back on a new position
// (a capture numbering again from an earlier point, as after its counters
// were taken from a stream whose tail was removed) is a regression: its
// transaction is archived, a removed_from_stream gap ending at it is
// recorded, unacknowledged, and the target is not ready.
func TestRegressedPartitionSequenceIsAGap(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	e.start(e.config("w1"))
	c := e.conn()
	tx1, tx2 := e.nextTx(orderRows(1, 1)...), e.nextTx(orderRows(2, 1)...)
	signedTx(t, e, tx1) // seq 1-3, partition sequences 1-3
	signedTx(t, e, tx2) // seq 4-6, 4-6
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == 6 })

	e.signer.Rewind(0, 2) // numbered from 3 again, as a capture that lost its counters
	tx3 := e.nextTx(orderRows(3, 1)...)
	signedTx(t, e, tx3) // seq 7-9, 3-5 again
	tx4 := e.nextTx(orderRows(4, 1)...)
	signedTx(t, e, tx4) // seq 10-12, 6-8: continues the new numbering
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == 12 })

	require.Equal(t, expected(t, c, tx1, tx2, tx3, tx4), archived(t, c, "archive.rows"))
	require.Empty(t, quarantined(t, c))
	// No message of the stream is known removed (the new numbering begins
	// right after tx2): the range is empty, not from_seq > to_seq.
	var g []string
	rows, err := c.Query(context.Background(), `SELECT format('%s %s %s %s %s %s', partition, from_lsn, to_lsn, from_seq, to_seq, acknowledged_at IS NOT NULL)
		FROM archive_v1.gaps ORDER BY id`)
	require.NoError(t, err)
	g, err = pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{"0 " + tx2.lsn.String() + " " + tx3.lsn.String() + "   f"}, g)
	rs := readiness(t, e)
	require.False(t, rs.Ready)
	require.Equal(t, 1, rs.GapsUnacknowledged)
}

// A new target on a stream whose head was removed (purged, aged out, or
// deleted by a holder of a deleting credential) records the removed head
// as a removed_from_stream gap on its first run, as a rebuild does: it is
// not ready and a wait for a later position fails as incomplete, while
// what the stream still holds is archived.
func TestFirstRunOnAStreamMissingItsHeadIsAGap(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	ctx := context.Background()
	tx1, tx2, tx3 := e.nextTx(orderRows(1, 1)...), e.nextTx(orderRows(2, 1)...), e.nextTx(orderRows(3, 1)...)
	e.publish(tx1) // seq 1-3
	e.publish(tx2) // 4-6
	e.publish(tx3) // 7-9
	stream, err := e.js.Stream(ctx, event.StreamName(src))
	require.NoError(t, err)
	require.NoError(t, stream.Purge(ctx, jetstream.WithPurgeSequence(4)))

	e.start(e.config("w1"))
	c := e.conn()
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == 9 })
	require.Equal(t, expected(t, c, tx2, tx3), archived(t, c, "archive.rows"))
	require.Equal(t, 1, count(t, c, `SELECT count(*) FROM archive_v1.gaps`))
	require.Equal(t, 1, count(t, c, `SELECT count(*) FROM archive_v1.gaps WHERE kind = 'removed_from_stream'
		AND partition IS NULL AND from_seq = 1 AND to_seq = 3 AND to_lsn = $1::pg_lsn AND acknowledged_at IS NULL`, tx2.lsn.String()))
	rs := readiness(t, e)
	require.False(t, rs.Ready)
	require.Equal(t, 1, rs.GapsUnacknowledged)
	wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	_, err = status.WaitComplete(wctx, c, archive.Projection, tx3.lsn, 0)
	var incomplete *status.IncompleteError
	require.ErrorAs(t, err, &incomplete, "wait --lsn exits 3")
}

// A suspected gap (the stream's first sequence moved past an idle
// partition's cursor) is not acknowledged by a signed message whose
// partition sequence went back (a capture that numbered again after the
// stream was emptied): the gap is completed at that message and stays
// unacknowledged; the target is not ready.
func TestSuspectedGapIsNotClearedByARegressedSequence(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	ctx := context.Background()
	tx1 := e.nextTx(orderRows(1, 1)...)
	e.publish(tx1) // seq 1-3, partition sequences 1-3
	svc := e.start(e.config("w1"))
	c := e.conn()
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == 3 })
	require.NoError(t, svc.Stop(ctx))

	tx2 := e.nextTx(orderRows(2, 1)...)
	e.publish(tx2) // seq 4-6, 4-6: never applied
	stream, err := e.js.Stream(ctx, event.StreamName(src))
	require.NoError(t, err)
	require.NoError(t, stream.Purge(ctx))
	e.start(e.config("w2"))
	eventually(t, 20*time.Second, func() bool { return len(gaps(t, c, 0)) == 1 }, "a suspected gap")
	require.Equal(t, []gap{{partition: 0, fromSeq: 4, toSeq: 6}}, gaps(t, c, 0))

	e.signer.Rewind(0, 1) // the capture counts again from 2: below the continuation
	tx3 := e.nextTx(orderRows(3, 1)...)
	e.publish(tx3) // seq 7-9, partition sequences 2-4
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == 9 })
	require.Equal(t, expected(t, c, tx1, tx3), archived(t, c, "archive.rows"))
	require.Equal(t, []gap{{partition: 0, fromSeq: 4, toSeq: 6, toLSN: ptr(tx3.lsn.String())}}, gaps(t, c, 0), "completed, not acknowledged")
	rs := readiness(t, e)
	require.False(t, rs.Ready)
	require.Equal(t, 1, rs.GapsUnacknowledged)
}
