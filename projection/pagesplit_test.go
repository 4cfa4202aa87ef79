package projection_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/projection"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/status"
)

// pageSplitState is what a reader of the archive can tell after a stream
// was applied: the visible rows, the quarantine entries and the gaps.
type pageSplitState struct {
	rows       []string
	quarantine []qrow
	gaps       []string
}

func pageSplitEndState(t *testing.T, c *pgx.Conn) pageSplitState {
	t.Helper()
	rs, err := c.Query(context.Background(), `SELECT format('%s %s %s %s %s', kind, from_lsn, to_lsn, from_seq, to_seq)
		FROM archive_v1.gaps ORDER BY kind, from_lsn, to_lsn, from_seq`)
	require.NoError(t, err)
	g, err := pgx.CollectRows(rs, pgx.RowTo[string])
	require.NoError(t, err)
	return pageSplitState{rows: archived(t, c, "archive.rows"), quarantine: quarantined(t, c), gaps: g}
}

// applyInPages starts a worker that applies e's stream in pages of size
// events, waits until its cursor is at last, and returns a connection to
// the archive and what a reader can tell.
func applyInPages(t *testing.T, e *env, size, last int) (*pgx.Conn, pageSplitState) {
	t.Helper()
	cfg := e.config("w1")
	cfg.BatchSize = size
	e.start(cfg)
	c := e.conn()
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == last })
	return c, pageSplitEndState(t, c)
}

// sameAsFirst keeps got as the first run's end state, or requires the
// same.
func sameAsFirst(t *testing.T, first **pageSplitState, got pageSplitState) {
	t.Helper()
	if *first == nil {
		*first = &got
		return
	}
	require.Equal(t, **first, got, "the same archive as with the first page size")
}

// A signed transaction one of whose rows was deleted from the stream is
// refused at its commit (a removed_from_stream gap says so). The capture's
// copy of the whole transaction, stored again later, is its real rows and
// signed commit: it is applied, whatever the page size. Before, a copy in
// the page of the refused commit was ignored as a replay (verification's
// in-page source position had moved to the refused commit, which the
// partition never applied), while in a later page it was applied: the
// transaction's rows were visible with pages of 1 to 4 events and missing
// with the default page.
func TestACopyOfARefusedTransactionIsAppliedWhateverThePageSize(t *testing.T) {
	t.Parallel()
	var first *pageSplitState
	for _, size := range []int{1, 2, 3, 5, 500} {
		t.Run(fmt.Sprintf("batch %d", size), func(t *testing.T) {
			e := newEnv(t, 1)
			shortDedup(t, e)
			ctx := context.Background()
			tx1, tx2 := e.nextTx(orderRows(1, 1)...), e.nextTx(orderRows(2, 1)...)
			m1 := signedTx(t, e, tx1) // seq 1-3, partition sequences 1-3
			st, err := e.js.Stream(ctx, event.StreamName(src))
			require.NoError(t, err)
			require.NoError(t, st.DeleteMsg(ctx, 2)) // tx1's line, removed from the stream
			for _, m := range m1 {
				republish(t, e, m) // seq 4-6: the capture's copy, verbatim
			}
			signedTx(t, e, tx2) // seq 7-9, partition sequences 4-6

			c, got := applyInPages(t, e, size, 9)
			require.Equal(t, expected(t, c, tx1, tx2), got.rows, "the copy's rows are tx1's real rows, signed")
			sameAsFirst(t, &first, got)
		})
	}
}

// A signed transaction with a truncate, applied, then stored again
// verbatim (the capture's copy, a duplicate the stream did not drop): the
// copy is a replay, ignored with its rows and its truncate, whatever the
// page size. Before, a replayed truncate in the page of its replayed commit
// was recorded again, a second truncate gap of the same transaction and
// table, while with the truncate in an earlier page than its commit there
// was one.
func TestAReplayedTruncateIsNoSecondGapWhateverThePageSize(t *testing.T) {
	t.Parallel()
	var first *pageSplitState
	for _, size := range []int{1, 2, 3, 500} {
		t.Run(fmt.Sprintf("batch %d", size), func(t *testing.T) {
			e := newEnv(t, 1)
			shortDedup(t, e)
			ctx := context.Background()
			tx1, tx2 := e.nextTx(orderRows(1, 1)...), e.nextTx(orderRows(2, 1)...)
			msgs := e.messages(tx1)
			trunc := &event.Event{Op: event.OpTruncate, Source: src, Schema: "public", Table: "order_lines", XID: tx1.xid,
				CommitLSN: tx1.lsn, CommitTime: tx1.time, Seq: len(tx1.rows)}
			commit := msgs[len(msgs)-1]
			msgs = append(msgs[:len(msgs)-1], e.msg(event.TruncateSubject(src, tx1.partition, "public", "order_lines"),
				event.MsgID(src, tx1.lsn, len(tx1.rows)), trunc), commit)
			for _, m := range msgs { // seq 1-4
				_, err := e.pubMsg(ctx, m)
				require.NoError(t, err)
			}
			for _, m := range msgs {
				republish(t, e, m) // seq 5-8: the copy, verbatim
			}
			signedTx(t, e, tx2) // seq 9-11

			c, got := applyInPages(t, e, size, 11)
			require.Equal(t, expected(t, c, tx1, tx2), got.rows)
			require.Empty(t, got.quarantine)
			require.Equal(t, []string{fmt.Sprintf("truncate %s %s  ", tx1.lsn, tx1.lsn)}, got.gaps, "one truncate, recorded once")
			sameAsFirst(t, &first, got)
		})
	}
}

// A transaction removed from the stream between two applied ones is a
// removed_from_stream gap whose from_lsn is the last position known
// complete: the commit before it, whatever the page size. Before, a gap
// found in the page of that commit started at the position the partition
// had before the page (none here): the gap claimed the applied
// transactions before it might be lost, and a wait for them (wait --lsn,
// complete_up_to_lsn) was blocked by it, while with one event per page it
// was not.
func TestARemovedTransactionsGapStartsAtTheLastAppliedCommitWhateverThePageSize(t *testing.T) {
	t.Parallel()
	var first *pageSplitState
	for _, size := range []int{1, 2, 3, 500} {
		t.Run(fmt.Sprintf("batch %d", size), func(t *testing.T) {
			e := newEnv(t, 1)
			ctx := context.Background()
			tx1, tx2, tx3, tx4 := e.nextTx(orderRows(1, 1)...), e.nextTx(orderRows(2, 1)...), e.nextTx(orderRows(3, 1)...), e.nextTx(orderRows(4, 1)...)
			signedTx(t, e, tx1) // seq 1-3
			signedTx(t, e, tx2) // seq 4-6
			signedTx(t, e, tx3) // seq 7-9, removed below
			signedTx(t, e, tx4) // seq 10-12
			st, err := e.js.Stream(ctx, event.StreamName(src))
			require.NoError(t, err)
			for seq := uint64(7); seq <= 9; seq++ {
				require.NoError(t, st.DeleteMsg(ctx, seq))
			}

			c, got := applyInPages(t, e, size, 12)
			require.Equal(t, expected(t, c, tx1, tx2, tx4), got.rows)
			require.Equal(t, []string{fmt.Sprintf("removed_from_stream %s %s 7 9", tx2.lsn, tx4.lsn)}, got.gaps,
				"the loss lies after tx2, up to tx4")
			bs, err := status.Blockers(ctx, c, archive.Projection, tx2.lsn, 10)
			require.NoError(t, err)
			require.Empty(t, bs, "tx2 is complete: nothing blocks a wait for it")
			sameAsFirst(t, &first, got)
		})
	}
}

// An unsigned row (a forgery) between two signed transactions is refused
// at the next commit and quarantined with the watermark its partition had
// when it met it (after_lsn: the first transaction's commit), whatever the
// page size: it lies after the first transaction, so a wait for that one
// is not blocked by it. Before, a forgery met in an earlier page than the
// commit that refused it was quarantined with after_lsn 0/0, blocking every
// wait (wait --lsn, complete_up_to_lsn) as if it came first, while in the
// page of that commit it did not.
func TestARefusedForgeryLiesWhereItWasMetWhateverThePageSize(t *testing.T) {
	t.Parallel()
	for _, size := range []int{1, 2, 3, 500} {
		t.Run(fmt.Sprintf("batch %d", size), func(t *testing.T) {
			e := newEnv(t, 1)
			ctx := context.Background()
			tx1, forged, tx2 := e.nextTx(orderRows(1, 1)...), e.nextTx(orderRows(66, 0)...), e.nextTx(orderRows(2, 1)...)
			signedTx(t, e, tx1)              // seq 1-3
			e.foreign(e.messages(forged)[0]) // seq 4: a row, unsigned, no commit
			signedTx(t, e, tx2)              // seq 5-7

			c, got := applyInPages(t, e, size, 7)
			require.Equal(t, expected(t, c, tx1, tx2), got.rows)
			require.Empty(t, got.gaps)
			bs, err := status.Blockers(ctx, c, archive.Projection, tx1.lsn, 10)
			require.NoError(t, err)
			require.Empty(t, bs, "tx1 is complete: nothing blocks a wait for it")
			var after string
			require.NoError(t, c.QueryRow(ctx, `SELECT format('%s %s %s', stream_seq, category, after_lsn) FROM epitaph.quarantine`).Scan(&after))
			require.Equal(t, fmt.Sprintf("4 unauthenticated %s", tx1.lsn), after, "met after tx1")
		})
	}
}

// One hostile stream applied with pages of 1 to 6 events and the default,
// and applied live (pages as messages arrive) by a worker stopped and
// started again mid-stream: the archive's end state is the same, row by
// row, entry by entry, gap by gap.
func TestAHostileStreamGivesOneArchiveWhateverThePageSize(t *testing.T) {
	t.Parallel()
	var first *pageSplitState
	var firstAfter []string
	type run struct {
		size int
		live bool // the worker runs while the stream is published, and restarts in its middle
	}
	runs := []run{{1, false}, {2, false}, {3, false}, {4, false}, {5, false}, {6, false}, {500, false}, {1, true}, {500, true}}
	for _, r := range runs {
		size := r.size
		t.Run(fmt.Sprintf("batch %d live %v", size, r.live), func(t *testing.T) {
			e := newEnv(t, 1)
			cfg := e.config("w1")
			cfg.BatchSize = size
			var svc *projection.Service
			c := e.conn()
			var lastSeq func() uint64
			// live: the worker applies what was published so far, then stops
			// (deletions from the stream are made while it is stopped, so it
			// never sees what they remove) and starts again.
			pause := func() {
				if svc == nil {
					return
				}
				eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == int(lastSeq()) })
				require.NoError(t, svc.Stop(context.Background()))
				svc = nil
			}
			resume := func() {
				if r.live {
					svc = e.start(cfg)
				}
			}
			resume()
			shortDedup(t, e)
			ctx := context.Background()
			st, err := e.js.Stream(ctx, event.StreamName(src))
			require.NoError(t, err)
			pub := func(msgs ...*nats.Msg) {
				for _, m := range msgs {
					_, err := e.pubMsg(ctx, m)
					require.NoError(t, err)
				}
			}
			truncOf := func(tx *txn) *nats.Msg {
				ev := &event.Event{Op: event.OpTruncate, Source: src, Schema: "public", Table: "order_lines", XID: tx.xid,
					CommitLSN: tx.lsn, CommitTime: tx.time, Seq: len(tx.rows)}
				return e.msg(event.TruncateSubject(src, tx.partition, "public", "order_lines"), event.MsgID(src, tx.lsn, len(tx.rows)), ev)
			}
			lastSeq = func() uint64 {
				info, err := st.Info(ctx)
				require.NoError(t, err)
				return info.State.LastSeq
			}
			tx1, tx2, tx3, tx4, tx5, tx6 := e.nextTx(orderRows(1, 2)...), e.nextTx(orderRows(2, 2)...), e.nextTx(orderRows(3, 1)...),
				e.nextTx(orderRows(4, 1)...), e.nextTx(orderRows(5, 1)...), e.nextTx(orderRows(6, 1)...)

			m1 := signedTx(t, e, tx1)
			// A forged row claiming tx2's first row, before it.
			f := e.messages(tx2)[0]
			f.Data = []byte(strings.Replace(string(f.Data), `"id":2,`, `"id":666,`, 1))
			f.Header.Set(event.HeaderMsgID, "forged")
			e.foreign(f)
			// tx2, its last line of a wire version this build does not know.
			m2 := e.messages(tx2)
			m2[2].Data = []byte(strings.Replace(string(m2[2].Data), `"v":1`, `"v":2`, 1))
			pub(m2...)
			// tx1 again, verbatim.
			for _, m := range m1 {
				republish(t, e, m)
			}
			// tx3 with its line removed from the stream, then its copy.
			pause()
			m3 := signedTx(t, e, tx3)
			require.NoError(t, st.DeleteMsg(ctx, lastSeq()-1))
			resume()
			pause() // between tx3's commit and its copy
			resume()
			for _, m := range m3 {
				republish(t, e, m)
			}
			// tx4 with a truncate, then its copy.
			m4 := e.messages(tx4)
			m4 = append(m4[:len(m4)-1], truncOf(tx4), m4[len(m4)-1])
			pub(m4...)
			for _, m := range m4 {
				republish(t, e, m)
			}
			// tx5 removed from the stream whole.
			pause()
			signedTx(t, e, tx5)
			for seq := lastSeq() - 2; seq <= lastSeq(); seq++ {
				require.NoError(t, st.DeleteMsg(ctx, seq))
			}
			resume()
			signedTx(t, e, tx6)
			e.heartbeat()
			last := lastSeq()

			if !r.live {
				e.start(cfg)
			}
			eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == int(last) })

			got := pageSplitEndState(t, c)
			rs, err := c.Query(ctx, `SELECT format('%s %s %s', stream_seq, category, after_lsn) FROM epitaph.quarantine ORDER BY stream_seq`)
			require.NoError(t, err)
			after, err := pgx.CollectRows(rs, pgx.RowTo[string])
			require.NoError(t, err)
			t.Logf("rows %d, quarantine %v, gaps %v", len(got.rows), after, got.gaps)
			if first == nil {
				first, firstAfter = &got, after
				return
			}
			require.Equal(t, *first, got, "the same archive as with pages of 1")
			require.Equal(t, firstAfter, after, "the same quarantine as with pages of 1")
		})
	}
}

// A signed transaction one of whose rows is of a wire version this build
// does not know, with a copy of another of its rows in its window (the
// capture sent it again): the copy is no forgery, the transaction is
// verified, its other rows are visible and the unknown row waits in the
// quarantine as unknown_version, which the upgraded projector's replay
// archives (upgrade.md: "does not lose it"), whatever the page size.
// Before, the slow path (the copy failed the fast one) could not place the
// undecodable row: every row of the transaction was quarantined as
// unauthenticated, which replay never archives, its commit refused, and a
// removed_from_stream gap recorded though nothing was removed.
func TestAnUnknownVersionRowsTransactionWithACopyIsVerifiedWhateverThePageSize(t *testing.T) {
	t.Parallel()
	for _, size := range []int{1, 2, 3, 500} {
		t.Run(fmt.Sprintf("batch %d", size), func(t *testing.T) {
			e := newEnv(t, 1)
			shortDedup(t, e)
			ctx := context.Background()
			tx1, tx2 := e.nextTx(orderRows(1, 2)...), e.nextTx(orderRows(2, 1)...)
			m1 := e.messages(tx1)
			m1[2].Data = []byte(strings.Replace(string(m1[2].Data), `"v":1`, `"v":2`, 1))
			for _, m := range m1[:3] { // seq 1-3
				_, err := e.pubMsg(ctx, m)
				require.NoError(t, err)
			}
			republish(t, e, m1[0]) // seq 4: its first row again
			_, err := e.pubMsg(ctx, m1[3])
			require.NoError(t, err) // seq 5: the commit
			signedTx(t, e, tx2)     // seq 6-8

			c, got := applyInPages(t, e, size, 8)
			require.Empty(t, got.gaps, "nothing was removed")
			require.Equal(t, []qrow{{seq: 3, subject: m1[2].Subject, category: "unknown_version"}}, got.quarantine)
			want := expected(t, c, tx1, tx2)
			require.Equal(t, []string{want[0], want[1], want[3], want[4]}, got.rows)

			res := upgradedReplay(t, e, "unknown_version")
			require.Len(t, res.Replayed, 1)
			require.Equal(t, want, archived(t, c, "archive.rows"), "the upgraded replay archives the row")
		})
	}
}
