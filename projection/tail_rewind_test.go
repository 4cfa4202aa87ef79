package projection_test

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection"
	"github.com/epitaph-dev/epitaph/quarantine"
)

// unknownVersionTail is a projector that archived tx1 and tx2's rows but
// one, quarantined (a wire version this build does not know), invisible
// while tx2's commit is not applied; stopped, and the stream lost
// everything since (it is empty again).
func unknownVersionTail(t *testing.T) (e *env, c *pgx.Conn, tx2 *txn, m1, m2 []*nats.Msg) {
	t.Helper()
	e = newEnv(t, 1)
	ctx := context.Background()
	require.NoError(t, migrations.Apply(ctx, e.pool()))
	tx1 := e.nextTx(orderRows(1, 3)...)
	tx2 = e.nextTx(orderRows(2, 7)...)
	m1, m2 = e.messages(tx1), e.messages(tx2)
	m2[3].Data = bytes.Replace(m2[3].Data, []byte(`"v":1`), []byte(`"v":2`), 1)
	for _, m := range append(m1, m2[:len(m2)-1]...) { // tx2 without its commit
		_, err := e.pubMsg(ctx, m)
		require.NoError(t, err)
	}
	svc, err := projection.New(e.config("w1"), projection.WithLogger(testLogger(t)), projection.WithRegistry(prometheus.NewRegistry()))
	require.NoError(t, err)
	require.NoError(t, svc.Start(ctx))
	c = e.conn()
	eventually(t, 20*time.Second, func() bool {
		return count(t, c, `SELECT max(cursor) FROM epitaph.progress`) == len(m1)+len(m2)-1
	})
	require.Equal(t, 7, count(t, c, `SELECT count(*) FROM archive_v1.rows WHERE NOT verified`))
	require.Equal(t, 1, count(t, c, `SELECT count(*) FROM epitaph.quarantine WHERE status = 'open' AND category = 'unknown_version'`))
	require.NoError(t, svc.Stop(ctx))
	require.NoError(t, e.js.DeleteStream(ctx, event.StreamName(src)))
	e.createStream()
	return e, c, tx2, m1, m2
}

// replayUpgraded replays the archive's open quarantine entries with a
// decoder that reads wire version 2 as 1.
func replayUpgraded(t *testing.T, e *env) quarantine.ReplayResult {
	t.Helper()
	apply := projection.ReplayFunc(projection.ReplayConfig{Logger: testLogger(t),
		Decoder: &event.Decoder{Upgraders: map[int]func([]byte) ([]byte, error){
			2: func(b []byte) ([]byte, error) { return bytes.Replace(b, []byte(`"v":2`), []byte(`"v":1`), 1), nil },
		}}})
	res, err := quarantine.Replay(context.Background(), e.pool(), quarantine.Selection{Filter: quarantine.Filter{Projection: "archive"}}, apply)
	require.NoError(t, err)
	return res
}

// The rewound transaction is re-sent whole (its quarantined row again
// quarantined, under its new sequence): once its commit is applied, the
// row's entry replays, and the transaction's eight rows are visible.
func TestRewoundTransactionsQuarantinedRowReplaysOnceResent(t *testing.T) {
	t.Parallel()
	e, c, tx2, m1, m2 := unknownVersionTail(t)
	ctx := context.Background()
	for _, m := range append(append([]*nats.Msg{}, m1...), m2...) {
		e.signer.Sign(m) // signed already, except tx2's commit
		_, err := e.js.PublishMsg(ctx, m)
		require.NoError(t, err)
	}
	e.start(e.config("w1"))
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 4+7 },
		"rows: %d", count(t, c, `SELECT count(*) FROM archive.rows`))
	res := replayUpgraded(t, e)
	require.NotEmpty(t, res.Replayed)
	require.Equal(t, 8, count(t, c, `SELECT count(*) FROM archive.rows WHERE commit_lsn = $1::pg_lsn`, tx2.lsn.String()))
	require.Zero(t, count(t, c, `SELECT count(*) FROM archive_v1.rows WHERE NOT verified`))
}

// A row of an open transaction is quarantined (a wire version this build
// does not know), its siblings archived invisible; then the stream loses
// the whole transaction for good (the capture had confirmed it: nothing is
// re-sent) and the partition rewinds. The quarantined row's transaction was
// never closed by a signed commit: a replay of its entry must not archive
// it visible.
func TestReplayAfterRewindKeepsAnUnverifiedTransactionsRowOut(t *testing.T) {
	t.Parallel()
	e, c, tx2, m1, _ := unknownVersionTail(t)
	// The broker kept tx1 and lost tx2 (acknowledged, confirmed by the
	// capture: never sent again).
	ctx := context.Background()
	for _, m := range m1 {
		_, err := e.js.PublishMsg(ctx, m)
		require.NoError(t, err)
	}
	e.start(e.config("w1"))
	eventually(t, 20*time.Second, func() bool {
		return count(t, c, `SELECT max(cursor) FROM epitaph.progress`) == len(m1)
	})
	require.Equal(t, 4, count(t, c, `SELECT count(*) FROM archive.rows`))
	replayUpgraded(t, e)
	require.Zero(t, count(t, c, `SELECT count(*) FROM archive.rows WHERE commit_lsn = $1::pg_lsn`, tx2.lsn.String()),
		"no signed commit ever covered tx2's rows")
	require.Equal(t, 4, count(t, c, `SELECT count(*) FROM archive.rows`))
}

// The re-sent stream puts another partition's transaction first, so that
// tx1 (applied before the loss) straddles the old cursor: the rewind must
// not leave tx1's tail in tx2's window, refused as a forgery.
func TestRewindPastAReappliedTransactionsTail(t *testing.T) {
	t.Parallel()
	sc := newTailScene(t, 8, nil, nil)
	c := sc.c
	sc.resend(t)
	sc.e.start(sc.e.config("w1"))
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 4+8+9 },
		"rows: %d", count(t, c, `SELECT count(*) FROM archive.rows`))
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT max(cursor) FROM epitaph.progress`) == sc.all() })
	require.Zero(t, count(t, c, `SELECT count(*) FROM archive_v1.rows WHERE NOT verified`))
	require.Empty(t, keysOf(t, c, `SELECT format('%s %s %s', stream_seq, category, error) FROM epitaph.quarantine`))
}

// The rewind's search meets a row of the rewound transaction that this
// build cannot decode (a wire version it does not know): its position is
// unknown, and taken as "at or after" the transaction, the cursor must not
// land inside the transaction, whose rows would then be refused as not
// matching its signed digest.
func TestRewindSearchOverAnUndecodableRowKeepsTheTransaction(t *testing.T) {
	t.Parallel()
	// After the loss the stream is other (1-3), tx1 (4-8), tx2 (9-17): the
	// search in [1, 13] (the old cursor) reads sequence 11, this row.
	sc := newTailScene(t, 1, func(m2 []*nats.Msg) {
		m2[2].Data = bytes.Replace(m2[2].Data, []byte(`"v":1`), []byte(`"v":2`), 1)
	}, nil)
	e, c, tx2 := sc.e, sc.c, sc.tx2
	sc.resend(t)
	e.start(e.config("w1"))
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT max(cursor) FROM epitaph.progress`) == sc.all() })
	eventually(t, 20*time.Second, func() bool {
		return count(t, c, `SELECT count(*) FROM archive.rows WHERE commit_lsn = $1::pg_lsn`, tx2.lsn.String()) == 7
	}, "tx2's rows: %d; quarantine: %v", count(t, c, `SELECT count(*) FROM archive.rows WHERE commit_lsn = $1::pg_lsn`, tx2.lsn.String()),
		keysOf(t, c, `SELECT format('%s %s %s', stream_seq, category, error) FROM epitaph.quarantine WHERE status = 'open'`))
	require.Len(t, replayUpgraded(t, e).Replayed, 1)
	require.Equal(t, 8, count(t, c, `SELECT count(*) FROM archive.rows WHERE commit_lsn = $1::pg_lsn`, tx2.lsn.String()))
}
