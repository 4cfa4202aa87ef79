package projection_test

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/status"
	"github.com/epitaph-dev/epitaph/projection/trust"
)

// signed returns tx's messages signed by s (in publish order), unpublished.
func (e *env) signed(s *testenv.Signer, tx *txn) []*nats.Msg {
	msgs := e.messages(tx)
	for _, m := range msgs {
		s.Sign(m)
	}
	return msgs
}

// foreign publishes m as it is: no signing, as a client other than the
// capture would.
func (e *env) foreign(m *nats.Msg) {
	e.t.Helper()
	_, err := e.js.PublishMsg(context.Background(), m)
	require.NoError(e.t, err)
}

func (e *env) publishRaw(msgs []*nats.Msg) {
	e.t.Helper()
	for _, m := range msgs {
		e.foreign(m)
	}
}

// archived lists "table key row" of what readers see, in key order.
func archived(t *testing.T, c *pgx.Conn, view string) []string {
	t.Helper()
	rows, err := c.Query(context.Background(), `SELECT table_name || ' ' || key::text || ' ' || row::text FROM `+view+` ORDER BY commit_lsn, seq`)
	require.NoError(t, err)
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return out
}

func expected(t *testing.T, c *pgx.Conn, txs ...*txn) []string {
	t.Helper()
	var out []string
	for _, tx := range txs {
		for _, r := range tx.rows {
			var s string
			require.NoError(t, c.QueryRow(context.Background(), `SELECT $1 || ' ' || $2::jsonb::text || ' ' || $3::jsonb::text`,
				r.table, r.key, r.image).Scan(&s))
			out = append(out, s)
		}
	}
	return out
}

type qrow struct {
	seq      int64
	subject  string
	category string
}

func quarantined(t *testing.T, c *pgx.Conn) []qrow {
	t.Helper()
	rows, err := c.Query(context.Background(), `SELECT stream_seq, subject, category FROM epitaph.quarantine ORDER BY stream_seq`)
	require.NoError(t, err)
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (qrow, error) {
		var q qrow
		return q, r.Scan(&q.seq, &q.subject, &q.category)
	})
	require.NoError(t, err)
	return out
}

func seqs(from, to int64, subjects []string, category string) []qrow {
	var out []qrow
	for s := from; s <= to; s++ {
		out = append(out, qrow{seq: s, subject: subjects[s-from], category: category})
	}
	return out
}

func subjects(msgs []*nats.Msg) []string {
	var out []string
	for _, m := range msgs {
		out = append(out, m.Subject)
	}
	return out
}

// An unsigned transaction, a tampered one and one signed by a key the
// target does not trust are quarantined as unauthenticated, rows and
// commit, and nothing of them is archived (not even invisibly); the signed
// transactions around them are archived with their values. Then the second
// key is trusted (projector trust-key) and what it signs is archived.
func TestUnauthenticatedTransactionsAreQuarantined(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	e.start(e.config("w1"))
	c := e.conn()
	ctx := context.Background()

	good1 := e.nextTx(orderRows(1, 1)...)
	e.publish(good1) // seq 1-3: the first key met is trusted
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 2 })

	unsigned := e.nextTx(orderRows(2, 1)...)
	uMsgs := e.messages(unsigned)
	e.publishRaw(uMsgs) // seq 4-6

	tampered := e.nextTx(orderRows(3, 1)...)
	tMsgs := e.signed(e.signer, tampered)
	tMsgs[1].Data = []byte(string(tMsgs[1].Data[:len(tMsgs[1].Data)-1]) + `,"extra":1}`)
	e.publishRaw(tMsgs) // seq 7-9

	other := testenv.NewSigner()
	wrong := e.nextTx(orderRows(4, 1)...)
	wMsgs := e.signed(other, wrong)
	e.publishRaw(wMsgs) // seq 10-12

	good2 := e.nextTx(orderRows(5, 1)...)
	e.publish(good2) // seq 13-15

	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == 15 })
	require.Equal(t, expected(t, c, good1, good2), archived(t, c, "archive.rows"))
	require.Equal(t, expected(t, c, good1, good2), archived(t, c, "archive_v1.rows"), "nothing refused is archived, not even invisibly")
	var want []qrow
	want = append(want, seqs(4, 6, subjects(uMsgs), trust.CategoryUnauthenticated)...)
	want = append(want, seqs(7, 9, subjects(tMsgs), trust.CategoryUnauthenticated)...)
	want = append(want, seqs(10, 12, subjects(wMsgs), trust.CategoryUnauthenticated)...)
	require.Equal(t, want, quarantined(t, c))
	require.Equal(t, 0, count(t, c, `SELECT count(*) FROM archive_v1.gaps`), "refused messages are not a removal")

	keys, err := trust.TrustedKeys(ctx, c)
	require.NoError(t, err)
	require.Len(t, keys, 1)
	require.Equal(t, event.KeyID(e.signer.Public()), keys[0].KeyID)
	require.Equal(t, "first use", keys[0].TrustedBy)

	// Key rotation: the operator trusts the new key; the old one stays.
	added, err := trust.TrustKey(ctx, c, other.Public(), "test", "rotated")
	require.NoError(t, err)
	require.True(t, added)
	rotated := e.nextTx(orderRows(6, 1)...)
	e.publishRaw(e.signed(other, rotated)) // seq 16-18
	old := e.nextTx(orderRows(7, 1)...)
	e.publish(old) // seq 19-21, the first key
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == 21 })
	require.Equal(t, expected(t, c, good1, good2, rotated, old), archived(t, c, "archive.rows"))
	require.Len(t, quarantined(t, c), 9)
}

// A forger publishes a row with a real pending row's commit LSN, seq and
// message id before the real one; the capture notices the collision and
// publishes the real row under another id. Only the real row is archived,
// once, with its real values; the forgery is quarantined. With a page of
// 2 events the forgery is archived invisibly first and replaced at the
// commit (the slow path across pages); with 500 all is in one page.
func TestForgedRowPreemptingARealOneLoses(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		batch int
		v2    bool // digest v2, as a capture writes now (v1: a stream written before)
	}{{2, false}, {500, false}, {2, true}, {500, true}} {
		batch := tc.batch
		t.Run(fmt.Sprintf("%d/v2=%v", batch, tc.v2), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, 1)
			if tc.v2 {
				e.signer = testenv.NewSignerV2()
			}
			cfg := e.config("w1")
			cfg.BatchSize = batch
			e.start(cfg)
			c := e.conn()
			pub := func(m *nats.Msg) {
				t.Helper()
				_, err := e.pubMsg(context.Background(), m)
				require.NoError(t, err)
			}

			tx := e.nextTx(orderRows(1, 3)...)
			msgs := e.messages(tx)
			forged := nats.NewMsg(msgs[2].Subject)
			forged.Header = nats.Header{}
			for k, v := range msgs[2].Header {
				forged.Header[k] = slices.Clone(v)
			}
			var ev event.Event
			require.NoError(t, json.Unmarshal(msgs[2].Data, &ev))
			ev.Row = json.RawMessage(`{"id":1001,"order_id":1,"qty":999}`)
			forged.Data, _ = event.Encode(&ev)
			forged.Header.Set(event.HeaderPartitionSeq, "3") // claims the real one's place

			pub(msgs[0])
			pub(msgs[1])
			e.foreign(forged) // seq 3 takes the id of the real seq-2 row
			real2 := msgs[2]
			real2.Header.Set(event.HeaderMsgID, event.RepublishedMsgID(real2.Header.Get(event.HeaderMsgID), 1))
			pub(real2) // seq 4
			pub(msgs[3])
			// And one claiming a seq beyond the transaction's last.
			ev.Seq = 4
			extra := nats.NewMsg(msgs[3].Subject)
			extra.Data, _ = event.Encode(&ev)
			extra.Header.Set(event.HeaderMsgID, event.MsgID(src, tx.lsn, 4))
			e.foreign(extra) // seq 6
			pub(msgs[4])     // the commit, seq 7
			after := e.nextTx(orderRows(2, 1)...)
			e.publish(after)

			eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == 10 })
			require.Equal(t, expected(t, c, tx, after), archived(t, c, "archive.rows"))
			require.Equal(t, expected(t, c, tx, after), archived(t, c, "archive_v1.rows"))
			require.Equal(t, []qrow{
				{seq: 3, subject: forged.Subject, category: trust.CategoryUnauthenticated},
				{seq: 6, subject: extra.Subject, category: trust.CategoryUnauthenticated},
			}, quarantined(t, c))
			require.Equal(t, 0, count(t, c, `SELECT count(*) FROM archive_v1.gaps`))
		})
	}
}

// stalePrefix is what a capture killed inside the transaction msgs had
// stored of it: copies of its first n rows with a key the first run read,
// since replaced (so the copies differ from msgs). msgs become the
// replay: their ids are republished ones, as the capture's.
func stalePrefix(t *testing.T, msgs []*nats.Msg, n int) []*nats.Msg {
	t.Helper()
	var prefix []*nats.Msg
	for i, m := range msgs[:n] {
		var ev event.Event
		require.NoError(t, json.Unmarshal(m.Data, &ev))
		ev.Key = json.RawMessage(fmt.Sprintf(`{"line":%d}`, i))
		p := nats.NewMsg(m.Subject)
		p.Header = nats.Header{}
		for k, v := range m.Header {
			p.Header[k] = slices.Clone(v)
		}
		var err error
		p.Data, err = event.Encode(&ev)
		require.NoError(t, err)
		prefix = append(prefix, p)
		m.Header.Set(event.HeaderMsgID, event.RepublishedMsgID(m.Header.Get(event.HeaderMsgID), 1))
	}
	return prefix
}

// A capture SIGKILLed inside a transaction stored a prefix of its rows;
// restarted, it decoded them again against a catalog that had changed
// since (a key replaced, a table dropped), found the stored prefix not
// what it publishes now and published the
// whole transaction again, the prefix's ids taken, after it. The commit's
// digest covers the replay. Every seq of the prefix has two candidates,
// 2^24 choices, far more than the slow path's budget: the replay (the last
// copy of each seq) is archived, each row once with its value, and only
// the stale prefix is quarantined. With a page of 2 events the prefix is
// archived invisibly first and replaced at the commit.
func TestTransactionRepublishedAfterAStalePrefixIsArchived(t *testing.T) {
	t.Parallel()
	const lines, stale = 29, 24 // 30 rows, the first 24 stored before the kill
	for _, tc := range []struct {
		batch int
		v2    bool
	}{{2, true}, {500, true}, {500, false}} {
		t.Run(fmt.Sprintf("%d/v2=%v", tc.batch, tc.v2), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, 1)
			if tc.v2 {
				e.signer = testenv.NewSignerV2()
			}
			cfg := e.config("w1")
			cfg.BatchSize = tc.batch
			e.start(cfg)
			c := e.conn()

			before := e.nextTx(orderRows(1, 1)...)
			e.publish(before) // seq 1-3
			tx := e.nextTx(orderRows(2, lines)...)
			msgs := e.signed(e.signer, tx) // the replay, numbered and signed as the capture does
			prefix := stalePrefix(t, msgs, stale)
			e.publishRaw(prefix) // seq 4-27: the killed run's
			e.publishRaw(msgs)   // seq 28-58: the replay and its commit
			after := e.nextTx(orderRows(3, 1)...)
			e.publish(after) // seq 59-61

			eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == 61 })
			want := expected(t, c, before, tx, after)
			require.Len(t, want, 2+lines+1+2)
			require.Equal(t, want, archived(t, c, "archive.rows"), "the replay archived, each row once, with its value")
			require.Equal(t, want, archived(t, c, "archive_v1.rows"), "nothing of the stale prefix left, not even invisibly")
			require.Equal(t, seqs(4, 3+stale, subjects(prefix), trust.CategoryUnauthenticated), quarantined(t, c),
				"only the stale prefix is quarantined")
			require.Equal(t, 0, count(t, c, `SELECT count(*) FROM archive_v1.gaps`))
		})
	}
}

// The slow path's memory is bounded: the same republished transaction,
// read back in pages of 2, with VerifyWindowBytes far below its window.
// The partition waits at the transaction (transient kind verify_window):
// nothing of it archived, nothing quarantined, no gap, the transaction
// after it not passed. A worker with the default bound takes over and
// archives the replay, quarantining only the stale prefix.
func TestSlowPathPastItsMemoryBoundHoldsThePartition(t *testing.T) {
	t.Parallel()
	const lines, stale = 29, 24
	e := newEnv(t, 1)
	e.signer = testenv.NewSignerV2()
	cfg := e.config("w1")
	cfg.BatchSize = 2
	cfg.VerifyWindowBytes = 20 << 10 // about ten messages of the window's 54
	s := e.start(cfg)
	c := e.conn()

	before := e.nextTx(orderRows(1, 1)...)
	e.publish(before) // seq 1-3
	tx := e.nextTx(orderRows(2, lines)...)
	msgs := e.signed(e.signer, tx)
	prefix := stalePrefix(t, msgs, stale)
	e.publishRaw(prefix) // seq 4-27
	e.publishRaw(msgs)   // seq 28-58
	after := e.nextTx(orderRows(3, 1)...)
	e.publish(after) // seq 59-61

	eventually(t, 20*time.Second, func() bool {
		return count(t, c, `SELECT count(*) FROM epitaph.progress WHERE last_failure_category = 'transient:verify_window'`) == 1
	})
	require.Less(t, count(t, c, `SELECT cursor FROM epitaph.progress`), 58, "the commit is not passed")
	require.Equal(t, expected(t, c, before), archived(t, c, "archive.rows"), "only the transaction before it is archived")
	require.Equal(t, 0, count(t, c, `SELECT count(*) FROM epitaph.quarantine`), "nothing quarantined on a guess")
	require.Equal(t, 0, count(t, c, `SELECT count(*) FROM archive_v1.gaps`))

	require.NoError(t, s.Stop(context.Background()))
	cfg.WorkerID, cfg.VerifyWindowBytes = "w2", 0 // the default
	e.start(cfg)
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == 61 })
	want := expected(t, c, before, tx, after)
	require.Equal(t, want, archived(t, c, "archive.rows"), "the replay archived, each row once")
	require.Equal(t, seqs(4, 3+stale, subjects(prefix), trust.CategoryUnauthenticated), quarantined(t, c),
		"only the stale prefix is quarantined")
}

// A holder of the stream's publish credentials copies every row of a
// 30-row transaction with other values (forged ids, the real partition
// sequences), all before the real rows or all after them, before the
// signed commit: 2^30 combinations, far past the slow path's budget. The
// real transaction is archived row by row and the 30 forgeries are
// quarantined; without trying the first and the last copies the whole
// transaction, real rows included, would be.
func TestForgedCopiesOfEveryRowLose(t *testing.T) {
	t.Parallel()
	const lines = 29
	for _, before := range []bool{true, false} {
		t.Run(fmt.Sprintf("before=%v", before), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, 1)
			e.signer = testenv.NewSignerV2()
			cfg := e.config("w1")
			cfg.BatchSize = 7 // the forgeries and the real rows span pages
			e.start(cfg)
			c := e.conn()

			tx := e.nextTx(orderRows(1, lines)...)
			msgs := e.signed(e.signer, tx)
			rows, commit := msgs[:len(msgs)-1], msgs[len(msgs)-1]
			var forged []*nats.Msg
			for i, m := range rows {
				var ev event.Event
				require.NoError(t, json.Unmarshal(m.Data, &ev))
				ev.Row = json.RawMessage(fmt.Sprintf(`{"id":%d,"order_id":1,"qty":999}`, 5000+i))
				f := nats.NewMsg(m.Subject)
				f.Header = nats.Header{}
				f.Header.Set(event.HeaderPartitionSeq, m.Header.Get(event.HeaderPartitionSeq))
				f.Header.Set(event.HeaderDigestAlg, event.DigestAlgV2)
				f.Header.Set(event.HeaderMsgID, fmt.Sprintf("forged-%d", i))
				var err error
				f.Data, err = event.Encode(&ev)
				require.NoError(t, err)
				forged = append(forged, f)
			}
			first, then := forged, rows // seq 1-30, then 31-60
			if !before {
				first, then = rows, forged
			}
			e.publishRaw(first)
			e.publishRaw(then)
			e.publishRaw([]*nats.Msg{commit}) // seq 61
			after := e.nextTx(orderRows(2, 1)...)
			e.publish(after) // seq 62-64

			eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == 64 })
			want := expected(t, c, tx, after)
			require.Equal(t, want, archived(t, c, "archive.rows"), "the real transaction archived, row by row")
			require.Equal(t, want, archived(t, c, "archive_v1.rows"), "no forgery left, not even invisibly")
			from := int64(1)
			if !before {
				from = 31
			}
			require.Equal(t, seqs(from, from+lines, subjects(forged), trust.CategoryUnauthenticated), quarantined(t, c),
				"the forgeries, and nothing else, quarantined")
		})
	}
}

// A forged mark (unsigned, or signed by an untrusted key) claiming a far
// future LSN is quarantined and does not move the partition's watermark.
func TestForgedMarkDoesNotMoveSourceLSN(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	e.start(e.config("w1"))
	c := e.conn()
	e.publish(e.nextTx(orderRows(1, 1)...))
	hb := e.heartbeat()
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == 4 })

	far := event.LSN(0xFFFFFFFFFFFFFF00)
	mark := func() *nats.Msg {
		ev := &event.Event{Op: event.OpMark, Source: src, Partition: 0, LSN: far, Kind: event.MarkUser, Time: time.Now()}
		return e.msg(event.MarkSubject(src, 0), event.MarkMsgID(src, far, 0), ev)
	}
	e.foreign(mark()) // unsigned
	m := mark()
	m.Header.Set(event.HeaderMsgID, "main/forged-1")
	other := testenv.NewSigner()
	other.Sign(m)
	e.foreign(m) // signed by a stranger
	m = mark()
	m.Header.Set(event.HeaderMsgID, "main/forged-2")
	m.Header.Set(event.HeaderPartitionSeq, "5")
	e.signer.SignOnly(m)                                      // signed by the right key ...
	m.Header.Set(event.HeaderPosition, "FFFFFFFF/FFFFFFF0#0") // ... but a header changed after signing
	e.foreign(m)
	e.publish(e.nextTx(orderRows(2, 1)...))
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == 10 })

	var lsn string
	require.NoError(t, c.QueryRow(context.Background(), `SELECT source_lsn::text FROM epitaph.progress`).Scan(&lsn))
	got, err := event.ParseLSN(lsn)
	require.NoError(t, err)
	require.Greater(t, got, hb)
	require.Less(t, got, event.LSN(0xFFFFFFFF00000000))
	q := quarantined(t, c)
	require.Len(t, q, 3)
	for i, r := range q {
		require.Equal(t, int64(5+i), r.seq)
		require.Equal(t, trust.CategoryUnauthenticated, r.category)
	}
	require.Equal(t, 4, count(t, c, `SELECT count(*) FROM archive.rows`))
}

// The rows of a transaction spanning pages are archived as they come but
// stay invisible to readers until its commit is applied and verified.
func TestTransactionSpanningPagesIsInvisibleUntilVerified(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	cfg := e.config("w1")
	cfg.BatchSize = 10
	e.start(cfg)
	c := e.conn()
	tx := e.nextTx(orderRows(1, 40)...)
	msgs := e.messages(tx)
	for _, m := range msgs[:len(msgs)-1] {
		_, err := e.pubMsg(context.Background(), m)
		require.NoError(t, err)
	}
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == 41 })
	require.Equal(t, 41, count(t, c, `SELECT count(*) FROM archive_v1.rows WHERE NOT verified`))
	require.Equal(t, 0, count(t, c, `SELECT count(*) FROM archive.rows`))
	require.Equal(t, 41, count(t, c, `SELECT tx_pending FROM epitaph.progress`))

	_, err := e.pubMsg(context.Background(), msgs[len(msgs)-1])
	require.NoError(t, err)
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 41 })
	require.Equal(t, expected(t, c, tx), archived(t, c, "archive.rows"))
	require.Equal(t, 0, count(t, c, `SELECT count(*) FROM archive_v1.rows WHERE NOT verified`))
	require.Equal(t, 0, count(t, c, `SELECT tx_pending FROM epitaph.progress`))
	require.Empty(t, quarantined(t, c))
}

// A stream written before signing: an operator records each partition's
// legacy boundary (projector trust-key --legacy-boundary, here the stream's
// last sequence) before the first run; unsigned messages at or before it
// are believed, unsigned ones after it quarantined, signed ones archived.
func TestLegacyBoundary(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	old1, old2 := e.nextTx(orderRows(1, 1)...), e.nextTx(orderRows(2, 2)...)
	e.publishRaw(e.messages(old1))
	e.publishRaw(e.messages(old2)) // seq 1-7, unsigned
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, e.url)
	require.NoError(t, err)
	defer pool.Close()
	require.NoError(t, migrations.Apply(ctx, pool))
	require.NoError(t, trust.RecordLegacyBoundary(ctx, pool, event.StreamName(src), 0, streamLast(t, e)))
	e.start(e.config("w1"))
	c := e.conn()
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == 7 })
	bs, err := trust.LegacyBoundaries(ctx, c)
	require.NoError(t, err)
	require.Len(t, bs, 1)
	require.Equal(t, uint64(7), bs[0].BoundarySeq)
	require.Equal(t, event.StreamName(src), bs[0].Stream)

	late := e.nextTx(orderRows(3, 1)...)
	lMsgs := e.messages(late)
	e.publishRaw(lMsgs) // seq 8-10, unsigned after the boundary
	signed := e.nextTx(orderRows(4, 1)...)
	e.publish(signed) // seq 11-13
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == 13 })
	require.Equal(t, expected(t, c, old1, old2, signed), archived(t, c, "archive.rows"))
	require.Equal(t, seqs(8, 10, subjects(lMsgs), trust.CategoryUnauthenticated), quarantined(t, c))
}

// Unsigned messages in a stream and no legacy boundary recorded (a stream
// emptied behind the capture's back and refilled with forged, unsigned
// deletes, or a stream written before signing that nobody vouched for): a
// new target's first run believes none of them. They are quarantined as
// unauthenticated, no boundary is inferred, nothing forged is archived;
// the signed transaction after them is.
func TestUnsignedStreamWithoutBoundaryIsNotBelieved(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	forged1, forged2 := e.nextTx(orderRows(150, 1)...), e.nextTx(orderRows(151, 1)...)
	f1, f2 := e.messages(forged1), e.messages(forged2)
	e.publishRaw(f1)
	e.publishRaw(f2) // seq 1-6, unsigned
	e.start(e.config("w1"))
	c := e.conn()
	real := e.nextTx(orderRows(4, 1)...)
	e.publish(real) // seq 7-9
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == 9 })
	require.Equal(t, expected(t, c, real), archived(t, c, "archive.rows"))
	require.Equal(t, 0, count(t, c, `SELECT count(*) FROM archive_v1.rows WHERE (key->>'id')::bigint IN (150, 150000, 151, 151000)`), "nothing forged, not even invisibly")
	require.Equal(t, seqs(1, 6, append(subjects(f1), subjects(f2)...), trust.CategoryUnauthenticated), quarantined(t, c))
	bs, err := trust.LegacyBoundaries(context.Background(), c)
	require.NoError(t, err)
	require.Empty(t, bs, "no boundary inferred")
}

type gap struct {
	partition      int
	fromSeq, toSeq int64
	toLSN          *string
	acked          bool
}

func gaps(t *testing.T, c *pgx.Conn, partition int) []gap {
	t.Helper()
	rows, err := c.Query(context.Background(), `SELECT partition, from_seq, to_seq, to_lsn::text, acknowledged_at IS NOT NULL
		FROM archive_v1.gaps WHERE kind = 'removed_from_stream' AND partition = $1 ORDER BY id`, partition)
	require.NoError(t, err)
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (gap, error) {
		var g gap
		return g, r.Scan(&g.partition, &g.fromSeq, &g.toSeq, &g.toLSN, &g.acked)
	})
	require.NoError(t, err)
	return out
}

func ptr(s string) *string { return &s }

// removal runs one scenario: partition 1 of 2 has applied tx1; with the
// projector stopped, tx2 and tx3 are published to it (and traffic to
// partition 0), then remove takes unapplied events away; the projector
// started again is idle on partition 1 first (a suspected gap when the
// stream's first sequence passed its cursor), then tx4 arrives and the gap
// is recorded with its range.
func removal(t *testing.T, limits func(*jetstream.StreamConfig), remove func(e *env, s jetstream.Stream)) {
	e := newEnv(t, 2)
	ctx := context.Background()
	st, err := e.js.Stream(ctx, event.StreamName(src))
	require.NoError(t, err)
	if limits != nil {
		cfg := st.CachedInfo().Config
		limits(&cfg)
		_, err := e.js.UpdateStream(ctx, cfg)
		require.NoError(t, err)
	}
	txIn := func(p int, rows []row) *txn {
		for {
			tx := e.nextTx(rows...)
			if tx.partition == p {
				return tx
			}
		}
	}
	tx1 := txIn(1, orderRows(1, 1))
	e.publish(tx1) // seq 1-3
	svc := e.start(e.config("w1"))
	c := e.conn()
	eventually(t, 20*time.Second, func() bool {
		return count(t, c, `SELECT cursor FROM epitaph.progress WHERE partition = 1`) == 3
	})
	require.NoError(t, svc.Stop(context.Background()))

	tx2, tx3 := txIn(1, orderRows(2, 1)), txIn(1, orderRows(3, 1))
	e.publish(tx2) // 4-6
	e.publish(tx3) // 7-9
	for i := 0; i < 5; i++ {
		e.publish(txIn(0, orderRows(100+i, 1))) // 10-24
	}
	remove(e, st)
	info, err := st.Info(ctx)
	require.NoError(t, err)
	first := info.State.FirstSeq
	require.Greater(t, first, uint64(9), "the removal took tx2 and tx3")

	e.start(e.config("w2"))
	eventually(t, 20*time.Second, func() bool { return len(gaps(t, c, 1)) == 1 }, "a suspected gap while nothing else arrived")
	require.Equal(t, []gap{{partition: 1, fromSeq: 4, toSeq: int64(first - 1)}}, gaps(t, c, 1))

	tx4 := txIn(1, orderRows(4, 1))
	e.publish(tx4)
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows WHERE key = '{"id":4}'`) == 1 })
	last := streamLast(t, e)
	require.Equal(t, []gap{{partition: 1, fromSeq: 4, toSeq: int64(last - 3), toLSN: ptr(tx4.lsn.String())}}, gaps(t, c, 1))
	// Readers are told: not ready, and waiting for tx4 cannot succeed.
	rs, err := status.ReadReadiness(ctx, c, archive.Projection)
	require.NoError(t, err)
	require.Len(t, rs, 1)
	require.False(t, rs[0].Ready)
	require.GreaterOrEqual(t, rs[0].GapsUnacknowledged, 1)
	wctx, wcancel := context.WithTimeout(ctx, 20*time.Second)
	defer wcancel()
	_, err = status.WaitComplete(wctx, c, archive.Projection, tx4.lsn, 0)
	var incomplete *status.IncompleteError
	require.ErrorAs(t, err, &incomplete, "wait --lsn exits 3")
	require.Equal(t, expected(t, c, tx1, tx4), archived(t, c, "(SELECT * FROM archive.rows WHERE commit_lsn IN ('"+tx1.lsn.String()+"', '"+tx2.lsn.String()+"', '"+tx3.lsn.String()+"', '"+tx4.lsn.String()+"')) r"))
	for _, q := range quarantined(t, c) {
		// Partition 0 may hold the rest of a transaction whose first rows
		// were discarded: unverifiable, and recorded as a gap too.
		require.NotContains(t, q.subject, ".1.")
	}
}

// Unapplied events purged from the stream end in a removed_from_stream gap.
func TestPurgedEventsAreAGap(t *testing.T) {
	t.Parallel()
	removal(t, nil, func(e *env, s jetstream.Stream) {
		require.NoError(t, s.Purge(context.Background()))
	})
}

// Unapplied events discarded by a max_bytes limit (DiscardOld) end in a
// removed_from_stream gap.
func TestMaxBytesDiscardIsAGap(t *testing.T) {
	t.Parallel()
	removal(t, func(c *jetstream.StreamConfig) {
		c.MaxBytes = 16 << 10
		c.Discard = jetstream.DiscardOld
	}, func(e *env, s jetstream.Stream) {
		// Traffic to partition 0 until the limit pushed tx2 and tx3 out.
		for i := 0; ; i++ {
			info, err := s.Info(context.Background())
			require.NoError(t, err)
			if info.State.FirstSeq > 9 {
				return
			}
			tx := e.nextTx(orderRows(1000+i, 5)...)
			if tx.partition == 0 {
				e.publish(tx)
			}
		}
	})
}

// Unapplied events aged out by max_age end in a removed_from_stream gap.
func TestMaxAgeIsAGap(t *testing.T) {
	t.Parallel()
	removal(t, func(c *jetstream.StreamConfig) {
		c.MaxAge = 8 * time.Second // long enough for tx4 to be applied under load
		c.Duplicates = time.Second
	}, func(e *env, s jetstream.Stream) {
		eventually(t, 10*time.Second, func() bool {
			info, err := s.Info(context.Background())
			require.NoError(t, err)
			return info.State.Msgs == 0
		})
	})
}
