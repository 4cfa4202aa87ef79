package projection_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/projection/erasure"
	"github.com/epitaph-dev/epitaph/projection/trust"
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
