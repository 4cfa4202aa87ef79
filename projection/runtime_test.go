package projection_test

import (
	"context"
	"fmt"
	"sort"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/progress"
	"github.com/epitaph-dev/epitaph/projection"
)

func owned(s *projection.Service) []int {
	var out []int
	for _, k := range s.Owned() {
		out = append(out, k.Partition)
	}
	sort.Ints(out)
	return out
}

// Re-applying the whole stream (cursor reset to 0, and the same events
// re-published under new stream sequences) leaves every row exactly once.
func TestReapplyIsIdempotent(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	var txs []*txn
	for i := 0; i < 20; i++ {
		tx := e.nextTx(orderRows(i+1, 2)...)
		txs = append(txs, tx)
		e.publish(tx)
	}
	s := e.start(e.config("w1"))
	c := e.conn()
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 60 })
	require.NoError(t, s.Stop(context.Background()))

	ctx := context.Background()
	_, err := c.Exec(ctx, `UPDATE epitaph.progress SET cursor = 0, last_msg_id = NULL`)
	require.NoError(t, err)
	// Re-publish without message ids, so JetStream keeps the copies.
	for _, tx := range txs[:5] {
		for _, m := range e.messages(tx) {
			m.Header.Del(event.HeaderMsgID)
			_, err := e.pubMsg(ctx, m)
			require.NoError(t, err)
		}
	}
	info, err := e.js.Stream(ctx, event.StreamName(src))
	require.NoError(t, err)
	last := info.CachedInfo().State.LastSeq
	require.Equal(t, uint64(20*4+5*4), last)

	e.start(e.config("w2"))
	eventually(t, 20*time.Second, func() bool {
		return count(t, c, `SELECT count(*) FROM epitaph.progress WHERE cursor > 0 AND last_advance_at > now() - interval '1 minute'`) == 2 &&
			count(t, c, `SELECT max(cursor) FROM epitaph.progress`) == int(last)
	})
	require.Equal(t, 60, count(t, c, `SELECT count(*) FROM archive.rows`))
	require.Equal(t, 60, count(t, c, `SELECT count(DISTINCT (source, commit_lsn, seq)) FROM archive.rows`))
	require.Equal(t, 20, count(t, c, `SELECT count(*) FROM archive.rows WHERE is_root`))
}

func TestTwoWorkersShareAndHandOver(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 8)
	a := e.start(e.config("a"))
	eventually(t, 10*time.Second, func() bool { return len(owned(a)) == 8 })
	b := e.start(e.config("b"))
	eventually(t, 10*time.Second, func() bool { return len(owned(a)) == 4 && len(owned(b)) == 4 },
		"a=%v b=%v", owned(a), owned(b))

	// Both apply: events on every partition arrive.
	for i := 0; i < 40; i++ {
		e.publish(e.nextTx(orderRows(i+1, 1)...))
	}
	c := e.conn()
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 80 })
	require.Equal(t, 4, count(t, c, `SELECT count(*) FROM epitaph.progress WHERE owner = 'a'`))
	require.Equal(t, 4, count(t, c, `SELECT count(*) FROM epitaph.progress WHERE owner = 'b'`))

	// a stops gracefully: b owns everything well before a's leases (3s)
	// would have expired.
	start := time.Now()
	require.NoError(t, a.Stop(context.Background()))
	require.Equal(t, 0, count(t, c, `SELECT count(*) FROM epitaph.progress WHERE owner = 'a'`), "a released its leases")
	eventually(t, 10*time.Second, func() bool { return len(owned(b)) == 8 })
	require.Less(t, time.Since(start), 2500*time.Millisecond)
	for i := 0; i < 10; i++ {
		e.publish(e.nextTx(orderRows(100+i, 1)...))
	}
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 100 })
}

// A worker whose lease is taken over while it runs cannot commit: its CAS
// fails, it stops the partition, and nothing it fetched is applied by it.
func TestCASLoserStops(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	a := e.start(e.config("a"))
	eventually(t, 10*time.Second, func() bool { return len(owned(a)) == 1 })
	e.publish(e.nextTx(orderRows(1, 1)...))
	c := e.conn()
	eventually(t, 10*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 2 })

	// A thief takes the partition (as after a pause longer than the TTL)
	// and holds it for an hour.
	ctx := context.Background()
	l, err := progress.NewLeaser(c, "thief", time.Hour)
	require.NoError(t, err)
	require.NoError(t, l.Heartbeat(ctx))
	// a renews its lease on its own schedule: a renewal between expiring the
	// lease and claiming it makes the claim find nothing, so try again.
	var stolen []progress.Lease
	eventually(t, 30*time.Second, func() bool {
		_, err := c.Exec(ctx, `UPDATE epitaph.progress SET lease_expires_at = now() - interval '1 second'`)
		require.NoError(t, err)
		stolen, err = l.Claim(ctx, "archive", 1, 1)
		require.NoError(t, err)
		return len(stolen) == 1
	}, "the thief claims the expired partition")
	cursor := count(t, c, `SELECT cursor FROM epitaph.progress`)

	e.publish(e.nextTx(orderRows(2, 1)...))
	eventually(t, 10*time.Second, func() bool { return len(owned(a)) == 0 }, "a must stop the partition")
	// Nothing new was applied by the loser, the cursor is where the thief
	// found it, and the thief still owns the partition.
	require.Equal(t, 2, count(t, c, `SELECT count(*) FROM archive.rows`))
	require.Equal(t, cursor, count(t, c, `SELECT cursor FROM epitaph.progress`))
	require.Equal(t, 1, count(t, c, `SELECT count(*) FROM epitaph.progress WHERE owner = 'thief' AND epoch = $1`, stolen[0].Epoch))
	// a keeps running but does not grab it back while the lease holds.
	time.Sleep(time.Second) // observation window: nothing must happen
	require.Empty(t, owned(a))
}

// 10,000 delete events applied set-based in pages of 500.
func TestSetBasedApply10k(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	ctx := context.Background()
	const txs, per = 10, 1000
	var msgs []*nats.Msg
	for i := 0; i < txs; i++ {
		rows := make([]row, per)
		for j := range rows {
			id := i*per + j
			rows[j] = row{schema: "public", table: "events", key: fmt.Sprintf(`{"id":%d}`, id),
				image: fmt.Sprintf(`{"id":%d,"payload":"%0200d","n":%d}`, id, id, id)}
		}
		msgs = append(msgs, e.messages(e.nextTx(rows...))...)
	}
	e.publishAll(msgs)
	c := e.conn()
	var before int64
	require.NoError(t, c.QueryRow(ctx, `SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()`).Scan(&before))
	start := time.Now()
	// The count below is of every transaction in the database: keep the
	// background ones (lease renewals, status refreshes) rare, so that a slow
	// machine, on which the apply takes many intervals, counts pages.
	cfg := e.config("w1")
	cfg.BalanceInterval, cfg.StatusInterval = time.Second, time.Minute
	e.start(cfg)
	polls := int64(0) // each a transaction of this database, too
	eventually(t, 60*time.Second, func() bool {
		polls++
		return count(t, c, `SELECT count(*) FROM archive.rows`) == txs*per
	})
	elapsed := time.Since(start)
	t.Logf("applied %d events in %s (%.0f/s)", txs*per, elapsed, float64(txs*per)/elapsed.Seconds())
	require.Equal(t, txs*per, count(t, c, `SELECT count(*) FROM archive.rows WHERE is_root`))
	// Pages, not rows: far fewer transactions than events.
	var after int64
	require.NoError(t, c.QueryRow(ctx, `SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()`).Scan(&after))
	committed := after - before - polls - 2 // the test's polls, the is_root count and the xact_commit read
	t.Logf("transactions committed while applying: %d (besides the test's %d polls)", committed, polls)
	require.Less(t, committed, int64(txs*per/10), "transactions committed while applying")
}

// Another reader takes deliveries from the partition's durable consumer (a
// stale worker still fetching before it dies): the pages the worker gets
// then skip messages of the partition, or nothing arrives while the stolen
// deliveries wait for their ack timeout. The worker notices, resets the
// consumer to its cursor and archives everything, without waiting.
func TestStolenDeliveriesAreNotSkipped(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	cfg := e.config("w1")
	cfg.BatchSize = 5
	s := e.start(cfg)
	eventually(t, 10*time.Second, func() bool { return len(owned(s)) == 1 })
	ctx := context.Background()
	stream, err := e.js.Stream(ctx, event.StreamName(src))
	require.NoError(t, err)
	var cons jetstream.Consumer
	eventually(t, 10*time.Second, func() bool {
		cons, err = stream.Consumer(ctx, e.consumerName(1, 0))
		return err == nil
	})
	stop := make(chan struct{})
	stolen := make(chan int, 1)
	go func() {
		n := 0
		defer func() { stolen <- n }()
		for n < 10 { // like a stale worker: it reads a little, then dies
			select {
			case <-stop:
				return
			default:
			}
			b, err := cons.Fetch(3, jetstream.FetchMaxWait(50*time.Millisecond))
			if err != nil {
				continue
			}
			for range b.Messages() {
				n++ // taken, never acked
			}
		}
	}()
	for i := 0; i < 30; i++ {
		e.publish(e.nextTx(orderRows(i+1, 1)...))
	}
	c := e.conn()
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 60 },
		"rows: %d", count(t, c, `SELECT count(*) FROM archive.rows`))
	close(stop)
	require.GreaterOrEqual(t, <-stolen, 1, "the other reader took deliveries")
	require.Equal(t, 30, count(t, c, `SELECT count(*) FROM archive.rows WHERE is_root`))
	eventually(t, 10*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == 90 })
}

// A worker that dies without handing over (hard stop: its context is
// cancelled, nothing is released) loses its partitions to the survivor once
// its leases expire; the survivor takes them with higher epochs and goes on.
func TestTakeoverAfterHardStop(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 4)
	ctx, cancel := context.WithCancel(context.Background())
	cfgA := e.config("a")
	cfgA.LeaseTTL = 1500 * time.Millisecond
	a, err := projection.New(cfgA, projection.WithLogger(testLogger(t)), projection.WithRegistry(prometheus.NewRegistry()))
	require.NoError(t, err)
	require.NoError(t, a.Start(ctx))
	t.Cleanup(func() { require.NoError(t, a.Stop(context.Background())) }) // closes its connections; its leases are fenced by then
	eventually(t, 10*time.Second, func() bool { return len(owned(a)) == 4 })
	cfgB := e.config("b")
	cfgB.LeaseTTL = 1500 * time.Millisecond
	b := e.start(cfgB)
	eventually(t, 10*time.Second, func() bool { return len(owned(a)) == 2 && len(owned(b)) == 2 })
	c := e.conn()
	epochs := count(t, c, `SELECT sum(epoch) FROM epitaph.progress`)

	cancel() // a dies
	<-a.Done()
	require.Equal(t, 2, count(t, c, `SELECT count(*) FROM epitaph.progress WHERE owner = 'a'`), "nothing released")
	for i := 0; i < 20; i++ {
		e.publish(e.nextTx(orderRows(i+1, 1)...))
	}
	eventually(t, 15*time.Second, func() bool { return len(owned(b)) == 4 })
	eventually(t, 15*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 40 })
	require.Equal(t, 4, count(t, c, `SELECT count(*) FROM epitaph.progress WHERE owner = 'b'`))
	require.Equal(t, epochs+2, count(t, c, `SELECT sum(epoch) FROM epitaph.progress`), "each takeover raised the epoch")
}
