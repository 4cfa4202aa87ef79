package projection_test

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
)

// A mark emitted inside a deleting transaction
// (pg_logical_emit_message(true, 'epitaph.mark', ...)) is published by the
// capture between the transaction's rows, on every partition, the
// transaction's own too: the transaction's rows are archived all the same.
func TestTransactionalMarkBetweenRowsKeepsThem(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	tx := e.nextTx(orderRows(1, 3)...)
	ms := e.messages(tx)
	markLSN := tx.lsn - 0x80
	mark := e.msg(event.MarkSubject(src, tx.partition), event.MarkMsgID(src, markLSN, tx.partition), &event.Event{
		Op: event.OpMark, Source: src, Partition: tx.partition, LSN: markLSN, Kind: event.MarkUser, Content: "in-tx",
		Time: tx.time, XID: tx.xid, CommitLSN: tx.lsn, CommitTime: tx.time})
	ctx := context.Background()
	for _, m := range append([]*nats.Msg{ms[0], mark}, ms[1:]...) {
		_, err := e.pubMsg(ctx, m)
		require.NoError(t, err)
	}
	e.publish(e.nextTx(orderRows(2, 1)...)) // the partition goes on after it
	e.start(e.config("w1"))
	c := e.conn()
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT max(cursor) FROM epitaph.progress`) == len(ms)+1+3 })
	eventually(t, 10*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 4+2 },
		"rows: %d, quarantined: %d", count(t, c, `SELECT count(*) FROM archive.rows`), count(t, c, `SELECT count(*) FROM epitaph.quarantine`))
	require.Equal(t, 0, count(t, c, `SELECT count(*) FROM epitaph.quarantine`))
	require.Equal(t, 0, count(t, c, `SELECT count(*) FROM archive.gaps`), "no gap")
}
