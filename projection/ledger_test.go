package projection_test

import (
	"context"
	"encoding/json"
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/erasure"
	"github.com/epitaph-dev/epitaph/projection/status"
	"github.com/epitaph-dev/epitaph/projection/trust"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// publishSeqs publishes tx like the capture and returns the stream
// sequence of each of its messages (rows in seq order, then the commit).
func publishSeqs(t *testing.T, e *env, tx *txn) []uint64 {
	t.Helper()
	e.pub.Lock()
	defer e.pub.Unlock()
	var seqs []uint64
	for _, m := range e.messages(tx) {
		ack, err := e.pubMsg(context.Background(), m)
		require.NoError(t, err)
		seqs = append(seqs, ack.Sequence)
	}
	return seqs
}

// purgeRow deletes row seq of tx from the stream, recording it in the
// erasure ledger first when ledger (as erase --purge-stream does).
func purgeRow(t *testing.T, e *env, tx *txn, seqs []uint64, seq int, ledger bool) {
	t.Helper()
	ctx := context.Background()
	st, err := e.js.Stream(ctx, event.StreamName(src))
	require.NoError(t, err)
	m, err := st.GetMsg(ctx, seqs[seq])
	require.NoError(t, err)
	if ledger {
		kv, err := erasure.OpenLedger(ctx, e.js, src, true)
		require.NoError(t, err)
		sum := event.BodyHash(m.Data)
		require.NoError(t, erasure.RecordErased(ctx, kv, erasure.LedgerEntry{Stream: event.StreamName(src), StreamSeq: seqs[seq],
			CommitLSN: tx.lsn, Seq: seq, BodySHA256: fmt.Sprintf("%x", sum[:])}))
	}
	require.NoError(t, st.SecureDeleteMsg(ctx, seqs[seq]))
}

// without is tx with the rows of the given seqs left out.
func without(tx *txn, seqs ...int) *txn {
	out := *tx
	out.rows = nil
	for i, r := range tx.rows {
		if !containsInt(seqs, i) {
			out.rows = append(out.rows, r)
		}
	}
	return &out
}

func containsInt(s []int, v int) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}

// Digest v2 transactions with members purged from the stream, each
// recorded in the erasure ledger (inside, last, all of them): the other
// rows are verified and archived, the purged ones are not, nothing of
// them is quarantined and no gap is recorded for them; a later removal
// without an entry is still a gap (and its transaction refused). With a
// page of 2
// the transactions span pages (the slow path reads them back).
func TestPurgedMembersInTheLedgerCostNoOtherRow(t *testing.T) {
	t.Parallel()
	for _, batch := range []int{2, 500} {
		t.Run(fmt.Sprint(batch), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, 1)
			e.signer = testenv.NewSignerV2()
			tx1 := e.nextTx(orderRows(1, 3)...) // seqs 0-3
			tx2 := e.nextTx(orderRows(2, 2)...) // 0-2
			tx3 := e.nextTx(orderRows(3, 1)...) // 0-1
			tx4 := e.nextTx(orderRows(4, 2)...)
			s1, s2, s3 := publishSeqs(t, e, tx1), publishSeqs(t, e, tx2), publishSeqs(t, e, tx3)
			publishSeqs(t, e, tx4)
			purgeRow(t, e, tx1, s1, 1, true) // inside
			purgeRow(t, e, tx2, s2, 2, true) // the last member
			purgeRow(t, e, tx3, s3, 0, true) // all of them
			purgeRow(t, e, tx3, s3, 1, true)

			// A removal the ledger does not know after them: a gap as ever.
			tx5, tx6 := e.nextTx(orderRows(5, 2)...), e.nextTx(orderRows(6, 1)...)
			s5 := publishSeqs(t, e, tx5)
			purgeRow(t, e, tx5, s5, 1, false)
			publishSeqs(t, e, tx6)

			cfg := e.config("w1")
			cfg.BatchSize = batch
			e.start(cfg)
			c := e.conn()
			last := streamLast(t, e)
			eventually(t, 20*time.Second, func() bool {
				return count(t, c, `SELECT cursor FROM epitaph.progress`) == int(last)
			})
			want := expected(t, c, without(tx1, 1), without(tx2, 2), tx4, tx6)
			require.Equal(t, want, archived(t, c, "archive.rows"))
			require.Equal(t, want, archived(t, c, "archive_v1.rows"), "nothing left invisible")
			g := gaps(t, c, 0)
			require.Len(t, g, 1, "the unrecorded removal is a gap")
			require.Equal(t, int64(s5[0]), g[0].fromSeq)
			require.GreaterOrEqual(t, g[0].toSeq, int64(s5[1]), "the range holds the removed member")
			q := quarantined(t, c)
			require.NotEmpty(t, q)
			for _, r := range q {
				require.GreaterOrEqual(t, r.seq, int64(s5[0]), "only tx5 is refused: %+v", q)
				require.Less(t, r.seq, int64(s5[len(s5)-1]+1))
				require.Equal(t, trust.CategoryUnauthenticated, r.category)
			}
		})
	}
}

// A ledger entry only stands for an absent message: one whose hash
// differs from the body the commit signed does not verify the
// transaction, and a v1 transaction (whose digest covers whole bodies)
// with a purged member is refused whatever the ledger says (the upgrade
// caveat).
func TestLedgerEntryNeverMakesAMessageBelieved(t *testing.T) {
	t.Parallel()
	for _, v2 := range []bool{true, false} {
		t.Run(fmt.Sprintf("v2=%v", v2), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, 1)
			if v2 {
				e.signer = testenv.NewSignerV2()
			}
			ctx := context.Background()
			tx1, tx2 := e.nextTx(orderRows(1, 2)...), e.nextTx(orderRows(2, 1)...)
			s1 := publishSeqs(t, e, tx1)
			publishSeqs(t, e, tx2)
			kv, err := erasure.OpenLedger(ctx, e.js, src, true)
			require.NoError(t, err)
			entry := erasure.LedgerEntry{Stream: event.StreamName(src), StreamSeq: s1[1], CommitLSN: tx1.lsn, Seq: 1,
				BodySHA256: fmt.Sprintf("%x", event.BodyHash([]byte(`{"forged":true}`)))}
			if !v2 {
				st, err := e.js.Stream(ctx, event.StreamName(src))
				require.NoError(t, err)
				m, err := st.GetMsg(ctx, s1[1])
				require.NoError(t, err)
				sum := event.BodyHash(m.Data)
				entry.BodySHA256 = fmt.Sprintf("%x", sum[:]) // the true hash: v1 cannot use it
			}
			require.NoError(t, erasure.RecordErased(ctx, kv, entry))
			st, err := e.js.Stream(ctx, event.StreamName(src))
			require.NoError(t, err)
			require.NoError(t, st.SecureDeleteMsg(ctx, s1[1]))

			e.start(e.config("w1"))
			c := e.conn()
			last := streamLast(t, e)
			eventually(t, 20*time.Second, func() bool {
				return count(t, c, `SELECT cursor FROM epitaph.progress`) == int(last)
			})
			require.Equal(t, expected(t, c, tx2), archived(t, c, "archive.rows"))
			var subjects []string
			for _, q := range quarantined(t, c) {
				require.Equal(t, trust.CategoryUnauthenticated, q.category)
				subjects = append(subjects, q.subject)
			}
			require.Len(t, subjects, 3, "tx1's two other rows and its commit: %v", subjects)
		})
	}
}

// sharedTx deletes customer cust and, in the same transaction, an order
// with two lines of each customer of owners (orders numbered from base).
func sharedTx(e *env, cust int, base int, owners ...int) *txn {
	rows := []row{{schema: "public", table: "customers", key: fmt.Sprintf(`{"id":%d}`, cust),
		image: fmt.Sprintf(`{"id":%d,"email":"c%d@example.com"}`, cust, cust)}}
	for i, k := range owners {
		o := base + i
		for _, r := range orderRows(o, 2) {
			if r.table == "orders" {
				r.image = fmt.Sprintf(`{"id":%d,"customer_id":%d,"note":"for c%d@example.com"}`, o, k, k)
			}
			rows = append(rows, r)
		}
	}
	return e.nextTx(rows...)
}

// rowsOf lists "table:id" of every row of txs but the erased customers
// and their children: their orders and those orders' lines deleted in the
// same transaction as the customer (what --with-children erases), sorted.
func rowsOf(txs []*txn, erased ...int) []string {
	var out []string
	for _, tx := range txs {
		var cust struct{ ID int }
		_ = json.Unmarshal([]byte(tx.rows[0].image), &cust)
		if !containsInt(erased, cust.ID) {
			cust.ID = -1 // this transaction deletes no erased customer
		}
		gone := map[int]bool{} // order ids of the erased customer
		for _, r := range tx.rows {
			var img struct{ ID, CustomerID, OrderID int }
			_ = json.Unmarshal([]byte(strings.ReplaceAll(strings.ReplaceAll(r.image, "customer_id", "customerid"), "order_id", "orderid")), &img)
			switch r.table {
			case "customers":
				if containsInt(erased, img.ID) {
					continue
				}
			case "orders":
				if img.CustomerID == cust.ID {
					gone[img.ID] = true
					continue
				}
			case "order_lines":
				if gone[img.OrderID] {
					continue
				}
			}
			out = append(out, fmt.Sprintf("%s:%d", r.table, img.ID))
		}
	}
	sort.Strings(out)
	return out
}

// The scenario: transactions each deleting a customer with orders
// and lines of several customers; some customers erased with
// --with-children --purge-stream, one fence only. A rebuilt version
// archives every row nobody erased (row by row), none of the erased ones,
// quarantines nothing and becomes ready; so does a second target (its own
// database and consumer group) started after the purge, which knows
// nothing of the erasures but the ledger: it gets every row but the purged
// ones.
func TestPurgeInSharedTransactionsCostsNoOtherRow(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	e.signer = testenv.NewSignerV2()
	ctx := context.Background()
	s := e.start(retentionConfig(e, "w1"))
	var txs []*txn
	for cust := 1; cust <= 6; cust++ {
		// Its own order, and one of the next two customers.
		txs = append(txs, sharedTx(e, cust, cust*10, cust, cust%6+1, (cust+1)%6+1))
	}
	for _, tx := range txs {
		e.publish(tx)
	}
	total := 0
	for _, tx := range txs {
		total += len(tx.rows)
	}
	c := e.conn()
	eventually(t, 30*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == total })

	pool := newPool(t, e.url)
	for _, cust := range []int{1, 2, 3} {
		purge := cust != 3
		rc, err := erasure.Erase(ctx, pool, erasure.EraseOptions{Table: "public.customers", Key: json.RawMessage(fmt.Sprintf(`{"id":%d}`, cust)),
			WithChildren: true, Actor: "dpo", PurgeStream: purge})
		require.NoError(t, err)
		if purge {
			rc, err = erasure.PurgeStream(ctx, pool, e.js, src, rc.ID)
			require.NoError(t, err)
			require.Equal(t, 1+3, rc.Removed["stream:"+event.StreamName(src)], "customer %d, its order and two lines", cust)
		}
	}
	kv, err := erasure.OpenLedger(ctx, e.js, src, false)
	require.NoError(t, err)
	require.NotNil(t, kv)
	st, err := kv.Status(ctx)
	require.NoError(t, err)
	require.Equal(t, uint64(2*4), st.Values(), "every purged message is in the ledger")

	keys := func(schema string) []string {
		return keysOf(t, c, fmt.Sprintf(`SELECT table_name || ':' || (key->>'id') FROM %s.rows ORDER BY 1`, schema))
	}
	kept := rowsOf(txs, 1, 2, 3)
	require.Equal(t, kept, keys("archive_v1"))

	v2, err := version.CreateVersion(ctx, s.Pool(), e.js, version.RebuildOptions{Projection: archive.Projection})
	require.NoError(t, err)
	e.heartbeat()
	eventually(t, 60*time.Second, func() bool {
		return state(t, s.Pool(), v2.Version) == version.StateReady && count(t, c, fmt.Sprintf(`SELECT count(*) FROM %s.rows`, v2.Schema)) == len(kept)
	}, "the rebuilt version is ready with every row nobody erased")
	require.Equal(t, kept, keys(v2.Schema))
	require.Equal(t, 0, count(t, c, fmt.Sprintf(`SELECT count(*) FROM (
		(SELECT commit_lsn, seq, table_name, key, row FROM archive_v1.rows EXCEPT SELECT commit_lsn, seq, table_name, key, row FROM %[1]s.rows)
		UNION ALL
		(SELECT commit_lsn, seq, table_name, key, row FROM %[1]s.rows EXCEPT SELECT commit_lsn, seq, table_name, key, row FROM archive_v1.rows)) d`, v2.Schema)),
		"the same values as the live version")
	require.Empty(t, quarantined(t, c))
	require.Empty(t, keysOf(t, c, fmt.Sprintf(`SELECT concat_ws(' ', kind, partition, 'from_seq=' || coalesce(from_seq::text, '-'), 'to_seq=' || coalesce(to_seq::text, '-'), 'from_lsn=' || coalesce(from_lsn::text, '-'), 'to_lsn=' || coalesce(to_lsn::text, '-'), acknowledged_at IS NOT NULL) FROM %s.gaps`, v2.Schema)))

	// A second target, started after the purge.
	url2 := testenv.NewDatabase(t)
	cfg2 := retentionConfig(e, "t2")
	cfg2.TargetURL = testenv.NoSearchPath(url2)
	cfg2.Group = "second"
	e.start(cfg2)
	e.heartbeat()
	c2, err := pgx.Connect(ctx, url2)
	require.NoError(t, err)
	t.Cleanup(func() { c2.Close(context.Background()) })
	pool2 := newPool(t, url2)
	purgedOnly := rowsOf(txs, 1, 2)
	eventually(t, 60*time.Second, func() bool {
		return count(t, c2, `SELECT count(*) FROM archive.rows`) == len(purgedOnly) && state(t, pool2, 1) == version.StateLive
	}, "the second target archives every row but the purged ones")
	require.Equal(t, purgedOnly, keysOf(t, c2, `SELECT table_name || ':' || (key->>'id') FROM archive.rows ORDER BY 1`))
	require.Equal(t, 0, count(t, c2, `SELECT count(*) FROM epitaph.quarantine`))
	require.Equal(t, 0, count(t, c2, `SELECT count(*) FROM archive_v1.gaps`))
	var last status.Readiness
	eventually(t, 20*time.Second, func() bool {
		rs, err := status.ReadReadiness(ctx, c2, archive.Projection)
		require.NoError(t, err)
		require.Len(t, rs, 1)
		last = rs[0]
		return last.Ready
	}, "the second target becomes ready: %+v", &last)
}

// A digest v2 transaction spanning pages: its half-hashed digest is kept
// with the cursor (in v2) and its rows become visible at its commit.
func TestV2TransactionSpanningPages(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	e.signer = testenv.NewSignerV2()
	cfg := e.config("w1")
	cfg.BatchSize = 10
	e.start(cfg)
	c := e.conn()
	tx := e.nextTx(orderRows(1, 40)...)
	msgs := e.messages(tx)
	for _, m := range msgs[:len(msgs)-1] {
		_, err := e.pubMsg(context.Background(), m)
		require.NoError(t, err)
		require.Equal(t, "v2", m.Header.Get(event.HeaderDigestAlg))
	}
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == 41 })
	require.Equal(t, 41, count(t, c, `SELECT count(*) FROM archive_v1.rows WHERE NOT verified`))
	require.Equal(t, 0, count(t, c, `SELECT count(*) FROM archive.rows`))
	_, err := e.pubMsg(context.Background(), msgs[len(msgs)-1])
	require.NoError(t, err)
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 41 })
	require.Equal(t, expected(t, c, tx), archived(t, c, "archive.rows"))
	require.Empty(t, quarantined(t, c))
}

// A digest v2 transaction of a TRUNCATE (seq 0) and two deletes (seq 1,
// 2) whose delete is purged (erase --purge-stream, recorded in the
// erasure ledger) verifies with the ledger's hash for it: its other rows
// archived, nothing quarantined, no gap. Its members are three, one more
// than the commit's count of deletes: with its last delete purged, the
// members tried stopped at two, and the transaction was refused.
func TestPurgedLastDeleteAfterATruncateCostsNoOtherRow(t *testing.T) {
	t.Parallel()
	// purge: the seq purged (0: none, the control; 1: the middle member,
	// which verifies; 2: the last member, the defect).
	for _, purge := range []int{0, 1, 2} {
		t.Run(fmt.Sprintf("purge=%d", purge), func(t *testing.T) {
			t.Parallel()
			purgedAfterATruncate(t, purge)
		})
	}
}

func purgedAfterATruncate(t *testing.T, purge int) {
	e := newEnv(t, 1)
	e.signer = testenv.NewSignerV2()
	ctx := context.Background()

	tx := e.nextTx(orderRows(1, 1)...) // the deletes: orders 1 (seq 1), order_lines 1000 (seq 2)
	msgs := e.messages(tx)
	// Shift the deletes' seqs by one and put a truncate at seq 0.
	var out []*nats.Msg
	trunc := &event.Event{Op: event.OpTruncate, Source: src, Schema: "public", Table: "audit", XID: tx.xid,
		CommitLSN: tx.lsn, CommitTime: tx.time, Seq: 0}
	out = append(out, e.msg(event.TruncateSubject(src, tx.partition, "public", "audit"), event.MsgID(src, tx.lsn, 0), trunc))
	for i, m := range msgs[:len(msgs)-1] {
		var ev event.Event
		require.NoError(t, json.Unmarshal(m.Data, &ev))
		ev.Seq = i + 1
		out = append(out, e.msg(m.Subject, event.MsgID(src, tx.lsn, i+1), &ev))
	}
	out = append(out, msgs[len(msgs)-1]) // the commit: rows 2
	var seqs []uint64
	for _, m := range out {
		ack, err := e.pubMsg(ctx, m)
		require.NoError(t, err)
		seqs = append(seqs, ack.Sequence)
	}
	after := e.nextTx(orderRows(2, 1)...)
	publishSeqs(t, e, after)

	// erase --purge-stream of a delete: ledger first.
	if purge > 0 {
		purgeRow(t, e, tx, seqs, purge, true)
	}

	e.start(e.config("w1"))
	c := e.conn()
	last := streamLast(t, e)
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == int(last) })

	q := quarantined(t, c)
	g := gaps(t, c, 0)
	t.Logf("archived: %v\nquarantined: %+v\ngaps: %+v", archived(t, c, "archive.rows"), q, g)
	kept := tx
	if purge > 0 {
		kept = without(tx, purge-1) // tx.rows[i] has seq i+1
	}
	require.Equal(t, expected(t, c, kept, after), archived(t, c, "archive.rows"), "the other rows are archived")
	require.Empty(t, g, "no gap")
	require.Empty(t, q, fmt.Sprintf("nothing quarantined: %+v", q))
}
