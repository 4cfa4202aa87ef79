package capture

import (
	"context"
	"crypto/ed25519"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
)

// cutScene is one source whose capture published a small fixed workload
// (full: the stream it wrote) with nothing confirmed to the slot, so that
// the slot replays all of it at every start.
type cutScene struct {
	e    *env
	mod  func(*Config)
	full []*jetstream.RawStreamMsg
	sc   jetstream.StreamConfig
	pub  ed25519.PublicKey
	slot string // the slot's confirmed position after the first run
	// seqRows and seqFile are the partition sequences' records after the
	// first run (restored before every cut: each cut is the first loss).
	seqRows [][3]string
	seqFile []byte
}

// newCutScene runs the workload: three transactions over two partitions
// (one of them of 20 rows), a mark between them and a heartbeat at the end.
func newCutScene(t *testing.T) *cutScene {
	t.Helper()
	e := setup(t)
	e.exec(t, `CREATE TABLE items (id int PRIMARY KEY, pad text); ALTER TABLE items REPLICA IDENTITY FULL;
		INSERT INTO items SELECT i, repeat('p', 50) FROM generate_series(1, 100) i`)
	cs := &cutScene{e: e, mod: func(c *Config) {
		c.Partitions = 2
		c.Tables = []string{"items"}
		c.BrokerSyncInterval = time.Hour // nothing is confirmed to the slot
		c.HeartbeatQuiet = -1
	}}
	ctx := context.Background()
	svc := e.start(t, cs.mod)
	// The transactions must cover both partitions (a commit LSN picks its
	// partition): one more small transaction until they do.
	e.exec(t, `DELETE FROM items WHERE id <= 3`)
	e.exec(t, `SELECT pg_logical_emit_message(false, 'epitaph.mark', 'between')`)
	e.exec(t, `DELETE FROM items WHERE id > 3 AND id <= 23`)
	e.exec(t, `DELETE FROM items WHERE id > 23 AND id <= 25`)
	txs, rows := 3, 25
	commits := commitPartitions(t, e, txs)
	for len(commits) < 2 {
		require.Less(t, txs, 15, "transactions in both partitions")
		rows++
		e.exec(t, `DELETE FROM items WHERE id = $1`, rows)
		txs++
		commits = commitPartitions(t, e, txs)
	}
	// The heartbeat last: its two messages end the stream.
	e.exec(t, `SELECT pg_logical_emit_message(false, 'epitaph.heartbeat', '')`)
	require.Len(t, e.messages(t, "main", rows+txs+2+2), rows+txs+2+2)
	require.NoError(t, svc.Stop(ctx))
	require.NoError(t, svc.Wait())

	st, err := e.js.Stream(ctx, event.StreamName("main"))
	require.NoError(t, err)
	info, err := st.Info(ctx)
	require.NoError(t, err)
	cs.sc = info.Config
	cs.full = storedMsgs(t, st, 1, info.State.LastSeq)
	cs.pub = e.publicKey(t)
	cs.slot = queryString(t, e.db, `SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1`, e.slot)
	first, err := event.ParseLSN(cs.full[0].Header.Get(event.HeaderPosition)[:strings.IndexByte(cs.full[0].Header.Get(event.HeaderPosition), '#')])
	require.NoError(t, err)
	slot, err := event.ParseLSN(cs.slot)
	require.NoError(t, err)
	require.Less(t, slot, first, "the slot holds the whole workload")
	cs.seqRows = cs.readSeqRows(t)
	cs.seqFile, err = os.ReadFile(seqFile(e.dir, "main"))
	if !os.IsNotExist(err) {
		require.NoError(t, err)
	}
	cs.check(t, cs.full, "the first run")
	t.Logf("the workload: %d messages, %d rows, commits per partition %v", len(cs.full), rows, commits)
	return cs
}

// commitPartitions waits until the stream holds n commits and returns
// how many there are per partition.
func commitPartitions(t *testing.T, e *env, n int) map[int]int {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		commits, total := map[int]int{}, 0
		for _, m := range e.messages(t, "main", 0) {
			if m.ev.Op == event.OpCommit {
				p, err := event.PartitionOf(m.subject)
				require.NoError(t, err)
				commits[p]++
				total++
			}
		}
		if total >= n {
			require.Equal(t, n, total)
			return commits
		}
		require.True(t, time.Now().Before(deadline), "%d of %d commits in the stream", total, n)
		time.Sleep(20 * time.Millisecond)
	}
}

func (cs *cutScene) readSeqRows(t *testing.T) [][3]string {
	t.Helper()
	conn, _ := cs.e.connect(t)
	rows, err := conn.Query(context.Background(), `SELECT stream, partition::text, seq::text || '/' || confirmed_lsn::text FROM `+seqTable+` ORDER BY 1, 2`)
	require.NoError(t, err)
	defer rows.Close()
	var out [][3]string
	for rows.Next() {
		var r [3]string
		require.NoError(t, rows.Scan(&r[0], &r[1], &r[2]))
		out = append(out, r)
	}
	require.NoError(t, rows.Err())
	return out
}

// restoreRecords puts the partition sequences' records back as the first
// run left them.
func (cs *cutScene) restoreRecords(t *testing.T) {
	t.Helper()
	cs.e.exec(t, `DELETE FROM `+seqTable)
	for _, r := range cs.seqRows {
		seq, lsn, _ := strings.Cut(r[2], "/")
		cs.e.exec(t, `INSERT INTO `+seqTable+` (stream, partition, seq, confirmed_lsn) VALUES ($1, $2::int, $3::bigint, $4::pg_lsn)`, r[0], r[1], seq, lsn)
	}
	path := seqFile(cs.e.dir, "main")
	if cs.seqFile == nil {
		if err := os.Remove(path); !os.IsNotExist(err) {
			require.NoError(t, err)
		}
		return
	}
	require.NoError(t, os.WriteFile(path, cs.seqFile, 0o600))
}

// recreate makes the stream anew holding msgs, as the capture stored them.
func (cs *cutScene) recreate(t *testing.T, msgs []*jetstream.RawStreamMsg) jetstream.Stream {
	t.Helper()
	ctx := context.Background()
	require.NoError(t, cs.e.js.DeleteStream(ctx, cs.sc.Name))
	st, err := cs.e.js.CreateStream(ctx, cs.sc)
	require.NoError(t, err)
	for _, m := range msgs {
		nm := nats.NewMsg(m.Subject)
		for k, v := range m.Header {
			if strings.HasPrefix(k, "Nats-Expected") {
				continue
			}
			nm.Header[k] = append([]string(nil), v...)
		}
		nm.Data = m.Data
		ack, err := cs.e.js.PublishMsg(ctx, nm)
		require.NoError(t, err)
		require.False(t, ack.Duplicate)
		require.Equal(t, m.Sequence, ack.Sequence)
	}
	return st
}

// check reads msgs, the whole stream in stream order, as a projector
// would: every message of the first run exactly once (ids without a
// republish suffix), nothing else, every partition's sequences 1..n in
// stream order, and every commit signed, with the rows pending before it
// in its partition exactly its transaction's rows, whose digest it signs.
func (cs *cutScene) check(t *testing.T, msgs []*jetstream.RawStreamMsg, what string) {
	t.Helper()
	want := map[string]bool{}
	for _, m := range cs.full {
		want[m.Header.Get(event.HeaderMsgID)] = true
	}
	seen := map[string]uint64{}
	partSeq := map[int]uint64{}
	type window struct {
		d    *event.Digest
		lsns []event.LSN
	}
	pending := map[int]*window{}
	for _, m := range msgs {
		id, _ := event.BaseMsgID(m.Header.Get(event.HeaderMsgID))
		require.True(t, want[id], "%s: stream message %d %s (id %s) is not one of the capture's", what, m.Sequence, m.Subject, id)
		if prev, dup := seen[id]; dup {
			require.Failf(t, "duplicate", "%s: message %s stored twice, at stream sequences %d and %d (%s)", what, id, prev, m.Sequence, m.Subject)
		}
		seen[id] = m.Sequence
		p, err := event.PartitionOf(m.Subject)
		require.NoError(t, err)
		ps, err := strconv.ParseUint(m.Header.Get(event.HeaderPartitionSeq), 10, 64)
		require.NoError(t, err, "%s: message %d", what, m.Sequence)
		require.Equal(t, partSeq[p]+1, ps, "%s: partition %d sequence of stream message %d (%s): a projector records a gap or a regression", what, p, m.Sequence, m.Subject)
		partSeq[p] = ps
		ev, err := event.Decode(m.Data)
		require.NoError(t, err)
		w := pending[p]
		if w == nil {
			w = &window{d: event.NewDigestV2()}
			pending[p] = w
		}
		switch ev.Op {
		case event.OpDelete, event.OpTruncate:
			w.d.Add(ps, m.Data)
			w.lsns = append(w.lsns, ev.CommitLSN)
		case event.OpCommit, event.OpMark, event.OpGap:
			require.NoError(t, event.VerifyMessage(cs.pub, m.Subject, m.Header, m.Data), "%s: message %d", what, m.Sequence)
			if ev.Op == event.OpCommit {
				require.Len(t, w.lsns, ev.Rows, "%s: rows pending before commit %d", what, m.Sequence)
				for _, l := range w.lsns {
					require.Equal(t, ev.CommitLSN, l, "%s: a row of another transaction before commit %d", what, m.Sequence)
				}
				require.Equal(t, m.Header.Get(event.HeaderDigest), w.d.Sum(), "%s: the digest of commit %d (stream sequence) fails: a projector refuses its rows", what, m.Sequence)
			} else {
				require.Empty(t, w.lsns, "%s: rows pending at marker %d: a projector refuses them", what, m.Sequence)
			}
			pending[p] = nil
		}
	}
	for p, w := range pending {
		require.True(t, w == nil || len(w.lsns) == 0, "%s: rows without their commit at the end of partition %d", what, p)
	}
	require.Len(t, seen, len(want), "%s: every message of the workload is in the stream", what)
}

// lostAt makes the stream hold only the first cut messages of the first
// run, as a broker that lost the rest (deleted: the rest deleted one by
// one, as erase --purge-stream or STREAM.MSG.DELETE do, inside the dedupe
// window; otherwise the stream recreated with the first cut, as a broker
// that recovered without its unsynced tail), runs a capture until the
// stream holds every message again, stops it and checks the stream.
func (cs *cutScene) lostAt(t *testing.T, cut int, deleted bool) {
	t.Helper()
	cs.restoreRecords(t)
	cs.loseAgainAt(t, cut, deleted)
}

// loseAgainAt is lostAt without restoring the records: a loss after the
// sessions that came before it.
func (cs *cutScene) loseAgainAt(t *testing.T, cut int, deleted bool) {
	t.Helper()
	ctx := context.Background()
	e := cs.e
	require.Equal(t, cs.slot, queryString(t, e.db, `SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1`, e.slot),
		"the slot was not confirmed past the cut")
	var st jetstream.Stream
	if deleted {
		st = cs.recreate(t, cs.full)
		for _, m := range cs.full[cut:] {
			require.NoError(t, st.DeleteMsg(ctx, m.Sequence))
		}
	} else {
		st = cs.recreate(t, cs.full[:cut])
	}
	what := fmt.Sprintf("cut after %d of %d messages (deleted: %v)", cut, len(cs.full), deleted)
	svc := e.start(t, cs.mod)
	want := map[string]bool{}
	for _, m := range cs.full {
		want[m.Header.Get(event.HeaderMsgID)] = true
	}
	var got []*jetstream.RawStreamMsg
	deadline := time.Now().Add(30 * time.Second)
	for {
		info, err := st.Info(ctx)
		require.NoError(t, err)
		got = readAll(t, st, info.State.FirstSeq, info.State.LastSeq)
		n := 0
		for _, m := range got {
			if id, _ := event.BaseMsgID(m.Header.Get(event.HeaderMsgID)); want[id] {
				n++
			}
		}
		if n >= len(want) {
			break
		}
		if time.Now().After(deadline) || svc.CurrentStatus().Error != "" {
			cs.check(t, got, what) // says what is missing
			t.Fatalf("%s: %d of %d messages in the stream; status error %q", what, n, len(want), svc.CurrentStatus().Error)
		}
		time.Sleep(20 * time.Millisecond)
	}
	require.NoError(t, svc.Stop(ctx))
	require.NoError(t, svc.Wait())
	info, err := st.Info(ctx)
	require.NoError(t, err)
	got = readAll(t, st, info.State.FirstSeq, info.State.LastSeq)
	cs.check(t, got, what)
	require.Zero(t, counterValue(t, svc.m.foreign), "%s: foreign messages", what)
}

// The broker loses the stream's tail after every message of a small
// workload in turn (a tail the capture had acknowledged, but not confirmed
// to its slot), because it lost its unsynced writes, or (at every sixth
// message: each such start waits out an adopter's fetch of 5s) because the
// messages were deleted from the end of the stream: each time, the next
// capture session leaves the stream holding every message exactly once,
// every partition numbered without a hole or a repeat, and every commit's
// digest matching the rows before it.
func TestEveryLostTailIsRepublishedExactlyOnce(t *testing.T) {
	t.Parallel()
	cs := newCutScene(t)
	for cut := 0; cut < len(cs.full); cut++ {
		cs.lostAt(t, cut, false)
		if cut%6 == 0 || cut == len(cs.full)-1 {
			cs.lostAt(t, cut, true)
		}
	}
}

// A capture restarts, and the broker then loses the tail it had not synced
// yet (the stream's tail the new session read at its start is not
// durable before the sync interval has passed; nothing was confirmed to
// the slot meanwhile): the next session re-sends what was lost with the
// partition sequences it had, adopting the stored rows of a transaction
// cut short, so the stream holds every message once and no partition
// jumps (a jump is a removed_from_stream gap readers see, for messages
// that are all there).
func TestLostTailAfterARestartIsNoGap(t *testing.T) {
	t.Parallel()
	cs := newCutScene(t)
	ctx := context.Background()
	for cut := 1; cut < len(cs.full); cut += 3 {
		cs.restoreRecords(t)
		cs.recreate(t, cs.full)
		svc := cs.e.start(t, cs.mod)
		require.Eventually(t, func() bool { return svc.CurrentStatus().Active }, 30*time.Second, 10*time.Millisecond)
		require.NoError(t, svc.Stop(ctx))
		require.NoError(t, svc.Wait())
		cs.loseAgainAt(t, cut, false)
	}
}

// readAll reads the stream's messages first..last one by one (a fetch
// through a consumer waits out its expiry at a deleted tail).
func readAll(t *testing.T, st jetstream.Stream, first, last uint64) []*jetstream.RawStreamMsg {
	t.Helper()
	var out []*jetstream.RawStreamMsg
	for seq := max(first, 1); seq <= last; seq++ {
		m, err := st.GetMsg(context.Background(), seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		require.NoError(t, err)
		out = append(out, m)
	}
	return out
}
