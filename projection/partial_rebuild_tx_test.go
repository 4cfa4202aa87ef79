package projection_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/projection/version"
)

// A partial rebuild (--from-time T) whose T falls inside a transaction's
// messages (its first rows stored before T, the rest and its commit after)
// must not start the partition in the middle of the transaction: the
// transaction is whole in the stream and verified by the live version, so
// the new version either holds it whole or not at all, and never
// quarantines it as unauthenticated (which keeps it from ever being ready).
func TestPartialRebuildDoesNotSplitATransaction(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	ctx := context.Background()
	e.start(e.config("w1"))
	c := e.conn()
	pool := e.pool()
	e.publish(e.nextTx(orderRows(1, 1)...))

	msgs := e.messages(e.nextTx(orderRows(2, 3)...)) // 4 rows + commit
	e.pub.Lock()
	for _, m := range msgs[:2] {
		_, err := e.pubMsg(ctx, m)
		require.NoError(t, err)
	}
	time.Sleep(50 * time.Millisecond)
	from := time.Now()
	time.Sleep(50 * time.Millisecond)
	for _, m := range msgs[2:] {
		_, err := e.pubMsg(ctx, m)
		require.NoError(t, err)
	}
	e.pub.Unlock()
	e.publish(e.nextTx(orderRows(3, 1)...))
	e.heartbeat()
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows WHERE verified`) == 8 })
	require.Equal(t, 0, count(t, c, `SELECT count(*) FROM epitaph.quarantine WHERE version = 1`), "the live version verified every transaction")

	v, err := version.CreateVersion(ctx, pool, e.js, version.RebuildOptions{Source: src, FromTime: from})
	require.NoError(t, err)
	eventually(t, 20*time.Second, func() bool {
		return count(t, c, `SELECT count(*) FROM archive_v2.rows WHERE verified AND key->>'id' = '3'`) == 1
	})
	time.Sleep(time.Second)
	var cats []string
	rows, err := pool.Query(ctx, `SELECT category || ' seq ' || stream_seq FROM epitaph.quarantine WHERE version = $1 ORDER BY stream_seq`, v.Version)
	require.NoError(t, err)
	for rows.Next() {
		var s string
		require.NoError(t, rows.Scan(&s))
		cats = append(cats, s)
	}
	require.NoError(t, rows.Err())
	require.Empty(t, cats, "a partial rebuild quarantines the transaction its start time cut in two")
}
