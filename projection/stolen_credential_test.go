package projection_test

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/broker"
	"github.com/epitaph-dev/epitaph/internal/natsconn"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/status"
)

// A holder of the capture's NATS credential (which may update the stream)
// sets max_msgs_per_subject 1 (DiscardOld) on the stream while a partition
// has applied tx1 and not yet tx2, tx3: every message but the last of each
// subject goes, the message at the partition's cursor (tx1's commit) and
// all of tx2 with it, while an older message of another subject (tx0's
// customers row) keeps the stream's first sequence below the cursor. The
// worker finds the message at its cursor gone and rewinds; the rewind must
// not forget the partition sequence, or tx3 (the next verified commit,
// whose partition sequence skips tx2's) is taken as a continuation and
// tx2 is lost without a gap: the archive says it is complete and ready.
func TestRewindAfterRemovalStillRecordsTheGap(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	e := newEnvAuth(t, dir, 1) // e.js is the capture's connection
	ctx := context.Background()
	cfg := e.config("w1")
	cfg.NATSAuth = natsconn.Auth{CredsFile: broker.ProjectorCreds(dir)}
	c := e.conn()
	{ // the stream as the capture makes it (capture/stream.go)
		st, err := e.js.Stream(ctx, event.StreamName(src))
		require.NoError(t, err)
		sc := st.CachedInfo().Config
		sc.DenyPurge, sc.Discard = true, jetstream.DiscardOld
		_, err = e.js.UpdateStream(ctx, sc)
		require.NoError(t, err)
	}

	customers := row{schema: "public", table: "customers", key: `{"id":7}`, image: `{"id":7}`}
	tx0 := e.nextTx(customers)          // seq 1-2, partition sequences 1-2
	tx1 := e.nextTx(orderRows(1, 0)...) // seq 3-4
	e.publish(tx0)
	e.publish(tx1)
	svc := e.start(cfg)
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == 4 })
	require.NoError(t, svc.Stop(ctx))

	tx2, tx3 := e.nextTx(orderRows(2, 0)...), e.nextTx(orderRows(3, 0)...)
	e.publish(tx2) // seq 5-6, partition sequences 5-6
	e.publish(tx3) // seq 7-8, partition sequences 7-8

	// The attack: the capture's credential may update the stream.
	st, err := e.js.Stream(ctx, event.StreamName(src))
	require.NoError(t, err)
	sc := st.CachedInfo().Config
	require.True(t, sc.DenyPurge, "as the capture makes it: no purge, no roll-up")
	sc.MaxMsgsPerSubject = 1 // a limit the capture itself offers (--retention), DiscardOld
	_, err = e.js.UpdateStream(ctx, sc)
	require.NoError(t, err)
	info, err := st.Info(ctx)
	require.NoError(t, err)
	require.Equal(t, uint64(3), info.State.Msgs, "tx0's row, tx3's row and commit are left")
	require.Equal(t, uint64(1), info.State.FirstSeq)

	e.start(cfg)
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == 8 })
	eventually(t, 20*time.Second, func() bool {
		return count(t, c, `SELECT count(*) FROM archive.rows WHERE key = '{"id":3}'`) == 1
	})
	require.Equal(t, 0, count(t, c, `SELECT count(*) FROM archive.rows WHERE key = '{"id":2}'`), "tx2 is gone")
	time.Sleep(2 * time.Second) // status sampled
	rs, err := status.ReadReadiness(ctx, c, archive.Projection)
	require.NoError(t, err)
	require.Len(t, rs, 1)
	t.Logf("ready=%v gaps_unacknowledged=%d reasons=%v", rs[0].Ready, rs[0].GapsUnacknowledged, rs[0].NotReadyReasons)
	require.NotEmpty(t, gaps(t, c, 0), "tx2 removed from the stream before it was applied: a removed_from_stream gap")
	require.False(t, rs[0].Ready, "not ready while tx2 is missing")
}

// A holder of the projector's NATS credential (which may create, and so
// update, consumers of the stream) narrows the filter of a running
// worker's consumer in place to the partition's marks while the worker
// waits in a fetch. The capture then publishes a heartbeat, a transaction
// and another heartbeat: the fetch delivers the two heartbeats only. The
// page starts at the message after the cursor (page_gap passes) and its
// deliveries are consecutive, so the worker verifies it and, the second
// heartbeat's partition sequence skipping the transaction's, records a
// removed_from_stream gap and moves past the transaction, which the
// stream still holds: a gap that did not happen, and a transaction never
// applied. A worker must not move past messages of its partition its
// consumer did not deliver: it resets to its cursor instead.
func TestNarrowedConsumerFilterIsNoGap(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	ctx := context.Background()
	cfg := e.config("w1")
	cfg.FetchWait = 3 * time.Second // the worker waits in its fetch most of the time
	cfg.LeaseTTL = 15 * time.Second
	e.start(cfg)
	c := e.conn()
	tx1 := e.nextTx(orderRows(1, 1)...)
	e.publish(tx1) // seq 1-3
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == 3 })
	time.Sleep(500 * time.Millisecond) // the worker is idle, waiting in a fetch

	st, err := e.js.Stream(ctx, event.StreamName(src))
	require.NoError(t, err)
	cons, err := st.Consumer(ctx, e.consumerName(1, 0))
	require.NoError(t, err)
	cc := cons.CachedInfo().Config
	cc.FilterSubject = event.MarkSubject(src, 0)
	_, err = st.UpdateConsumer(ctx, cc) // the projector's credential may (CONSUMER.CREATE)
	require.NoError(t, err)

	e.heartbeat() // seq 4
	tx2 := e.nextTx(orderRows(2, 1)...)
	e.publish(tx2) // seq 5-7
	e.heartbeat()  // seq 8
	eventually(t, 30*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == 8 })
	// The worker finds its consumer's configuration is not its own at its
	// next idle round and resets it; give it that time.
	time.Sleep(8 * time.Second)
	require.Empty(t, gaps(t, c, 0), "nothing was removed from the stream")
	require.Equal(t, expected(t, c, tx1, tx2), archived(t, c, "archive.rows"), "tx2 is in the stream")
}

// A holder of the capture's NATS credential (which may update the stream)
// rewrites the stream's epitaph.partitions metadata from 2 to 1 before a
// new target's projector first runs. The metadata is not signed, yet the
// projector takes it as the partition count of its first version: it
// consumes partition 0 only, and every transaction of partition 1 (signed,
// in the stream) is never read, while archive.status says the version is
// ready. The stream's own subjects say otherwise: it holds messages of
// partition 1.
func TestPartitionCountFromTamperedMetadataIsNotBelieved(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	ctx := context.Background()
	var txs []*txn
	parts := map[int]int{}
	for len(parts) < 2 || parts[0] < 2 || parts[1] < 2 {
		tx := e.nextTx(orderRows(len(txs)+1, 1)...)
		e.publish(tx)
		txs = append(txs, tx)
		parts[tx.partition]++
	}
	e.heartbeat()

	st, err := e.js.Stream(ctx, event.StreamName(src))
	require.NoError(t, err)
	sc := st.CachedInfo().Config
	sc.Metadata[event.MetaPartitions] = "1"
	_, err = e.js.UpdateStream(ctx, sc)
	require.NoError(t, err)

	e.start(e.config("w1"))
	c := e.conn()
	time.Sleep(8 * time.Second) // lag sampled, readiness settled
	rs, err := status.ReadReadiness(ctx, c, archive.Projection)
	require.NoError(t, err)
	n := count(t, c, `SELECT count(*) FROM archive.rows`)
	ready := len(rs) == 1 && rs[0].Ready
	t.Logf("archived rows %d of %d, ready=%v", n, 2*len(txs), ready)
	require.False(t, ready && n < 2*len(txs), "ready while the transactions of partition 1 are not archived")
}

// A holder of the capture's NATS credential sets max_msgs_per_subject 1 on
// the stream (a limit the capture itself offers as retention): every
// message but the last of its subject goes. Partition 0's only
// transaction survives whole at sequences 1-2, so the stream still starts
// at sequence 1 and a new target sees no removed head; but tx1 and tx2 of
// partition 1 are gone. The new target's first verified commit of
// partition 1 (tx3's) carries partition sequence 6 where a partition read
// from its beginning starts at 1: the loss must be a gap, yet the target
// archives tx0 and tx3 and says it is ready.
func TestNewTargetOnAStreamMissingAPartitionsHistoryIsAGap(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	ctx := context.Background()
	txIn := func(p int, rows []row) *txn {
		for {
			if tx := e.nextTx(rows...); tx.partition == p {
				return tx
			}
		}
	}
	customers := row{schema: "public", table: "customers", key: `{"id":7}`, image: `{"id":7}`}
	tx0 := txIn(0, []row{customers})
	e.publish(tx0)                      // seq 1-2, partition 0
	e.publish(txIn(1, orderRows(1, 0))) // 3-4, partition 1, partition sequences 1-2
	e.publish(txIn(1, orderRows(2, 0))) // 5-6, 3-4
	tx3 := txIn(1, orderRows(3, 0))
	e.publish(tx3) // 7-8, 5-6
	st, err := e.js.Stream(ctx, event.StreamName(src))
	require.NoError(t, err)
	sc := st.CachedInfo().Config
	sc.MaxMsgsPerSubject = 1
	_, err = e.js.UpdateStream(ctx, sc)
	require.NoError(t, err)
	info, err := st.Info(ctx)
	require.NoError(t, err)
	require.Equal(t, uint64(1), info.State.FirstSeq)
	require.Equal(t, uint64(4), info.State.Msgs, "tx0 whole, tx3 whole")

	e.start(e.config("w1"))
	c := e.conn()
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT max(cursor) FROM epitaph.progress`) == 8 })
	time.Sleep(3 * time.Second) // lag sampled
	rs, err := status.ReadReadiness(ctx, c, archive.Projection)
	require.NoError(t, err)
	t.Logf("rows %d, quarantined %d, gaps %d, ready=%v", count(t, c, `SELECT count(*) FROM archive.rows`),
		len(quarantined(t, c)), count(t, c, `SELECT count(*) FROM archive_v1.gaps`), rs[0].Ready)
	require.Equal(t, expected(t, c, tx0, tx3), archived(t, c, "archive.rows"))
	require.Positive(t, count(t, c, `SELECT count(*) FROM archive_v1.gaps WHERE kind = 'removed_from_stream'`), "tx1 and tx2 were removed")
	require.False(t, rs[0].Ready)
}

// A holder of the projector's NATS credential switches the filter of
// partition 0's consumer, in place, to partition 1's subjects while its
// worker waits in a fetch. The worker is then delivered partition 1's
// transaction and mark (signed, for their own subjects) instead of its
// own. Believed, partition 1's mark moves partition 0's watermark past
// partition 0's transaction that was never delivered: the archive says it
// is complete up to an LSN it lacks a transaction below, and partition 1's
// sequence numbers make a gap in partition 0 that did not happen. A
// worker must take nothing from a message outside its partition.
func TestSwitchedConsumerFilterIsNotBelieved(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	ctx := context.Background()
	txIn := func(p int, rows []row) *txn {
		for {
			if tx := e.nextTx(rows...); tx.partition == p {
				return tx
			}
		}
	}
	cfg := e.config("w1")
	cfg.FetchWait = 3 * time.Second // the worker waits in its fetch most of the time
	cfg.LeaseTTL = 15 * time.Second
	e.start(cfg)
	c := e.conn()
	a0, b0 := txIn(0, orderRows(1, 1)), txIn(1, orderRows(2, 1))
	e.publish(a0)
	e.publish(b0)
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 4 })
	time.Sleep(500 * time.Millisecond) // the workers are idle, waiting in a fetch

	st, err := e.js.Stream(ctx, event.StreamName(src))
	require.NoError(t, err)
	cons, err := st.Consumer(ctx, e.consumerName(1, 0))
	require.NoError(t, err)
	cc := cons.CachedInfo().Config
	cc.FilterSubject = event.PartitionFilter(src, 1)
	_, err = st.UpdateConsumer(ctx, cc) // the projector's credential may (CONSUMER.CREATE)
	require.NoError(t, err)

	a1, b1 := txIn(0, orderRows(3, 1)), txIn(1, orderRows(4, 1))
	e.publish(a1)
	e.publish(b1)
	hb := e.heartbeat()
	require.Greater(t, hb, a1.lsn)
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		var wm *string
		require.NoError(t, c.QueryRow(ctx, `SELECT source_lsn::text FROM epitaph.progress WHERE projection = 'archive' AND partition = 0`).Scan(&wm))
		have := count(t, c, `SELECT count(*) FROM archive.rows WHERE key = '{"id":3}'`) == 1
		if wm != nil && !have {
			at, err := event.ParseLSN(*wm)
			require.NoError(t, err)
			require.Less(t, at, a1.lsn, "partition 0's watermark passed its transaction %s, never applied", a1.lsn)
		}
		time.Sleep(50 * time.Millisecond)
	}
	eventually(t, 30*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows WHERE key = '{"id":3}'`) == 1 })
	require.Empty(t, gaps(t, c, 0), "nothing was removed from partition 0")
	require.Empty(t, gaps(t, c, 1), "nothing was removed from partition 1")
	require.Equal(t, expected(t, c, a0, b0, a1, b1), archived(t, c, "archive.rows"))
}

// The same holder widens partition 0's consumer filter to every subject of
// the stream. Partition 0's next page then starts with its own next
// message (so the page's start is right) and carries partition 1's
// transaction between partition 0's own. Partition sequences count per
// partition: when partition 1's transaction carries the numbers partition
// 0 expects next, it passes for partition 0's continuation, and partition
// 0's own next transaction, with the same numbers, for a replay.
func TestWidenedConsumerFilterIsNotBelieved(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	ctx := context.Background()
	txIn := func(p int, rows []row) *txn {
		for {
			if tx := e.nextTx(rows...); tx.partition == p {
				return tx
			}
		}
	}
	cfg := e.config("w1")
	cfg.FetchWait = 10 * time.Second
	cfg.LeaseTTL = 30 * time.Second
	e.start(cfg)
	c := e.conn()
	a0, b0, b0b := txIn(0, orderRows(1, 1)), txIn(1, orderRows(2, 1)), txIn(1, orderRows(3, 1))
	e.publish(a0)  // partition 0, partition sequences 1-3
	e.publish(b0)  // partition 1, 1-3
	e.publish(b0b) // partition 1, 4-6
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 6 })
	time.Sleep(500 * time.Millisecond)

	st, err := e.js.Stream(ctx, event.StreamName(src))
	require.NoError(t, err)
	cons, err := st.Consumer(ctx, e.consumerName(1, 0))
	require.NoError(t, err)
	cc := cons.CachedInfo().Config
	cc.FilterSubject = event.StreamSubjects(src)
	_, err = st.UpdateConsumer(ctx, cc)
	require.NoError(t, err)

	a1, b1, a2 := txIn(0, orderRows(4, 1)), txIn(1, orderRows(5, 1)), txIn(0, orderRows(6, 1))
	e.publish(a1) // partition 0, 4-6
	e.publish(b1) // partition 1, 7-9: what partition 0 expects after a1
	e.publish(a2) // partition 0, 7-9
	e.heartbeat()
	eventually(t, 30*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 12 })
	require.Empty(t, gaps(t, c, 0), "nothing was removed from partition 0")
	require.Empty(t, gaps(t, c, 1), "nothing was removed from partition 1")
	require.Zero(t, count(t, c, `SELECT count(*) FROM epitaph.quarantine`), "partition 1's messages are authentic, and partition 1's")
	require.Equal(t, expected(t, c, a0, b0, b0b, a1, b1, a2), archived(t, c, "archive.rows"))
}
