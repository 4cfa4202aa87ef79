package capture

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/projection"
)

// TestForgedCommitBetweenLastRowAndCommitIsNotBelieved plays the hostile
// writer in the one race no dedupe window closed: while the capture
// publishes without waiting for each acknowledgement (past a session's
// first messages), a forgery under the commit's id is stored exactly
// between a transaction's last row and its commit, and the capture goes on
// to publish the next transaction before it reads the commit's
// acknowledgement (as under load). Both are made deterministic with test
// hooks on the capture's loop: it pauses before publishing the commit
// (the forgery and the next transaction are made then), and leaves
// acknowledgements uncollected until the next commit is published.
//
// Before commit ids were tagged, the forgery held the commit's predictable
// id: JetStream dropped the real commit as a duplicate, the next
// transaction chained to the forgery, and the new session resumed after
// it: the commit was never published and the transaction's rows ended in
// quarantine. Now the forgery cannot hold the real commit's id: it breaks
// the chain, the new session publishes the commit, and a projector
// archives every row, quarantining only the forgery.
func TestForgedCommitBetweenLastRowAndCommitIsNotBelieved(t *testing.T) {
	t.Parallel()
	e := setup(t)
	itemsTable(t, e, 320)
	cfg := e.config()
	cfg.MetricsAddr = "127.0.0.1:0"
	cfg.HeartbeatInterval = -1             // no mark between the two transactions
	cfg.DuplicateWindow = 10 * time.Minute // the forgery is in the window however slow the machine
	svc := newService(t, cfg)

	// stage: 0 streaming, 1 pause at the next commit (A's), 2 acks held
	// until the next commit (B's) is published, 3 done.
	type pause struct {
		lsn     event.LSN
		careful int
		resume  chan struct{}
	}
	var stage atomic.Int32
	paused := make(chan pause)
	done := make(chan struct{})
	t.Cleanup(func() { close(done) }) // never leave the capture paused (runs before its stop)
	svc.hooks = &testHooks{
		beforeCommit: func(lsn event.LSN) {
			switch {
			case stage.CompareAndSwap(1, 0):
				p := pause{lsn: lsn, careful: svc.st.careful, resume: make(chan struct{})}
				select {
				case paused <- p:
				case <-done:
					return
				}
				select {
				case <-p.resume:
				case <-done:
				}
			case stage.CompareAndSwap(2, 3):
				// B's commit is published next; the acknowledgements after it.
			}
		},
		holdAcks: func() bool { return stage.Load() == 2 },
	}
	require.NoError(t, svc.Start(context.Background()))
	requireStreaming(t, svc)
	pub := e.publicKey(t)
	// More messages than a session publishes one at a time.
	e.exec(t, `DELETE FROM items WHERE id <= 300`)
	e.requireRealDeletes(t, pub, ids(1, 300))

	stage.Store(1)
	e.exec(t, `DELETE FROM items WHERE id BETWEEN 301 AND 303`) // A
	var p pause
	select {
	case p = <-paused:
	case <-time.After(90 * time.Second):
		t.Fatal("the capture did not reach the commit of the transaction")
	}
	require.Zero(t, p.careful, "the capture publishes without waiting for each acknowledgement")
	ctx := context.Background()
	st, err := e.js.Stream(ctx, event.StreamName("main"))
	require.NoError(t, err)
	// A's rows were published without acknowledgements: wait until the
	// stream holds them, the last one last.
	require.Eventually(t, func() bool {
		info, err := st.Info(ctx)
		if err != nil {
			return false
		}
		m, err := st.GetMsg(ctx, info.State.LastSeq)
		if err != nil {
			return false
		}
		ev, err := event.Decode(m.Data)
		return err == nil && ev.Op == event.OpDelete && ev.CommitLSN == p.lsn && ev.Seq == 2
	}, 90*time.Second, 20*time.Millisecond, "A's rows are stored")
	forgedID := event.CommitMsgID("main", p.lsn) // the best a writer without the key can do
	part := event.Partition(p.lsn, cfg.Partitions)
	e.hostile(t, event.CommitSubject("main", part), map[string]string{
		event.HeaderMsgID: forgedID, event.HeaderVersion: "1", event.HeaderPosition: p.lsn.String() + "#3",
		event.HeaderSignature: "ed25519:AAAA",
	}, fmt.Sprintf(`{"v":1,"op":"commit","source":"main","xid":1,"commit_lsn":"%s","commit_time":"2026-01-01T00:00:00Z","rows":3,"tables":{"public.items":3}}`, p.lsn))
	e.exec(t, `DELETE FROM items WHERE id BETWEEN 304 AND 306`) // B, right after A in the slot
	stage.Store(2)
	close(p.resume)

	// Every real delete is in the stream once, in a transaction whose
	// commit verifies: A's too.
	e.requireRealDeletes(t, pub, ids(1, 306))
	require.Equal(t, int32(3), stage.Load(), "B's commit was published while acknowledgements were held")
	var commits, forgeries int
	for _, m := range e.rawMsgs(t, "main") {
		if m.Subject != event.CommitSubject("main", part) {
			continue
		}
		ev, err := event.Decode(m.Data)
		require.NoError(t, err)
		if ev.CommitLSN != p.lsn {
			continue
		}
		id := m.Header.Get(event.HeaderMsgID)
		if event.VerifyMessage(pub, m.Subject, m.Header, m.Data) != nil {
			forgeries++
			require.Equal(t, forgedID, id)
			continue
		}
		commits++
		base, _ := event.BaseMsgID(id)
		require.Equal(t, forgedID, event.UntaggedMsgID(base), "the real commit's id reads as the commit's")
		require.NotEqual(t, forgedID, base, "the real commit's id is tagged")
		require.Equal(t, 3, ev.Rows)
	}
	require.Equal(t, 1, forgeries, "the forgery is stored")
	require.Equal(t, 1, commits, "A's real commit is stored once")
	require.GreaterOrEqual(t, counterValue(t, svc.m.foreign), 1.0, "the forgery was noticed")

	// A projector archives A row by row and quarantines the forgery only.
	target := testenv.NewDatabase(t)
	proj, err := projection.New(projection.Config{TargetURL: target, NATSURL: e.nats.URL, SourceName: "main", WorkerID: "w1",
		LeaseTTL: 3 * time.Second, FetchWait: 100 * time.Millisecond, StatusInterval: 300 * time.Millisecond},
		projection.WithLogger(testLogger(t)), projection.WithRegistry(prometheus.NewRegistry()))
	require.NoError(t, err)
	require.NoError(t, proj.Start(ctx))
	t.Cleanup(func() { require.NoError(t, proj.Stop(context.Background())) })
	pool, err := pgxpool.New(ctx, target)
	require.NoError(t, err)
	defer pool.Close()
	var n int
	require.Eventually(t, func() bool {
		return pool.QueryRow(ctx, `SELECT count(*) FROM archive.rows WHERE source = 'main'`).Scan(&n) == nil && n >= 306
	}, 120*time.Second, 100*time.Millisecond, "every row is archived (%d)", n)
	rows, err := pool.Query(ctx, `SELECT (key->>'id')::int, row->>'pad', commit_lsn::text, seq FROM archive.rows WHERE source = 'main' ORDER BY 1`)
	require.NoError(t, err)
	type archived struct {
		id       int
		pad, lsn string
		seq      int
	}
	got, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (archived, error) {
		var a archived
		return a, r.Scan(&a.id, &a.pad, &a.lsn, &a.seq)
	})
	require.NoError(t, err)
	require.Len(t, got, 306)
	for i, a := range got {
		require.Equal(t, i+1, a.id)
		require.Equal(t, strings.Repeat("p", a.id%7+1), a.pad, "row %d's real values", a.id)
		if a.id > 300 && a.id <= 303 {
			require.Equal(t, p.lsn.String(), a.lsn, "row %d is A's", a.id)
			require.Equal(t, a.id-301, a.seq)
		}
	}
	require.Eventually(t, func() bool {
		return pool.QueryRow(ctx, `SELECT count(*) FROM epitaph.quarantine WHERE projection = 'archive'`).Scan(&n) == nil && n >= 1
	}, 120*time.Second, 100*time.Millisecond, "the forgery is quarantined")
	qrows, err := pool.Query(ctx, `SELECT subject || ' ' || category || ' ' || coalesce(headers::text, '') FROM epitaph.quarantine WHERE projection = 'archive'`)
	require.NoError(t, err)
	q, err := pgx.CollectRows(qrows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Len(t, q, 1, "only the forgery is in quarantine: %v", q)
	require.Contains(t, q[0], event.CommitSubject("main", part)+" unauthenticated ")
	require.Contains(t, q[0], strconv.Quote(forgedID))
}

// TestResumeOnAStreamWithUntaggedIDs: a stream written by an older capture,
// whose message ids carry no tag (rows, commits, marks, gaps), is resumed by
// this one as its own: its last commit is recognised by its signature and
// position, never by the shape of its id. The older capture is stopped
// inside a large transaction, after a transactional mark, with nothing
// confirmed to the slot, so the restart replays everything: what the old
// capture stored is skipped or adopted (the open transaction's untagged rows
// and mark copies), nothing is stored twice, nothing is lost, nothing of it
// is taken for foreign, and what is published from then on is tagged.
func TestResumeOnAStreamWithUntaggedIDs(t *testing.T) {
	t.Parallel()
	e := setup(t)
	itemsTable(t, e, 6010)
	base := func(c *Config) {
		trustConfig(c)
		c.HeartbeatInterval = -1         // the only marks are the test's
		c.BrokerSyncInterval = time.Hour // nothing confirmed: the restart replays it all
		c.MaxInFlight = 64
	}
	cfg := e.config()
	base(&cfg)
	old := newService(t, cfg)
	old.hooks = &testHooks{untaggedIDs: true}
	require.NoError(t, old.Start(context.Background()))
	requireStreaming(t, old)
	pub := e.publicKey(t)
	e.exec(t, `DELETE FROM items WHERE id <= 10`)
	e.exec(t, `SELECT pg_logical_emit_message(false, 'epitaph.mark', 'before')`)
	e.exec(t, `SELECT pg_logical_emit_message(false, 'epitaph.gap', '{"schema":"public","table":"gone","reason":"test"}')`)
	e.requireRealDeletes(t, pub, ids(1, 10))
	ctx := context.Background()
	st, err := e.js.Stream(ctx, event.StreamName("main"))
	require.NoError(t, err)
	e.exec(t, `BEGIN; DELETE FROM items WHERE id BETWEEN 11 AND 2000;
		SELECT pg_logical_emit_message(true, 'epitaph.mark', 'inside');
		DELETE FROM items WHERE id BETWEEN 2001 AND 6000; COMMIT`)
	require.Eventually(t, func() bool {
		// The mark's last copy (partition 3) is in: stop there.
		m, err := st.GetLastMsgForSubject(ctx, event.MarkSubject("main", 3))
		if err != nil {
			return false
		}
		ev, err := event.Decode(m.Data)
		return err == nil && ev.Content == "inside"
	}, 90*time.Second, 2*time.Millisecond)
	require.NoError(t, old.Stop(context.Background()))
	require.NoError(t, old.Wait())
	// Rows published without an acknowledgement of their own, after the
	// last acknowledged message, may still be stored after the stop
	// returned (the closed connection's last writes): read the stream once
	// its last sequence has settled.
	settled(t, st)

	signedPlain := func(m *jetstream.RawStreamMsg) bool {
		return !strings.Contains(m.Subject, ".delete.") && !strings.Contains(m.Subject, ".truncate.")
	}
	stored := e.rawMsgs(t, "main")
	var commits int
	for _, m := range stored {
		id := m.Header.Get(event.HeaderMsgID)
		require.Equal(t, id, event.UntaggedMsgID(id), "stream seq %d: the older capture's id is untagged", m.Sequence)
		if strings.HasSuffix(m.Subject, ".commit") {
			commits++
		}
		if signedPlain(m) {
			require.NoError(t, event.VerifyMessage(pub, m.Subject, m.Header, m.Data), "stream seq %d", m.Sequence)
		}
	}
	require.Equal(t, 1, commits, "stopped inside the big transaction")
	require.GreaterOrEqual(t, len(stored), 10+1+4+4+1990+4, "stopped after the transactional mark")

	svc := e.start(t, base)
	requireStreaming(t, svc)
	e.requireRealDeletes(t, pub, ids(1, 6000))
	e.exec(t, `DELETE FROM items WHERE id > 6000`)
	e.requireRealDeletes(t, pub, ids(1, 6010))

	tagger := e.tagger(t)
	marks, gaps := map[string]int{}, 0
	for i, m := range e.rawMsgs(t, "main") {
		id := m.Header.Get(event.HeaderMsgID)
		_, n := event.BaseMsgID(id)
		require.Zero(t, n, "stream seq %d: nothing republished", m.Sequence)
		ev, err := event.Decode(m.Data)
		require.NoError(t, err)
		switch ev.Op {
		case event.OpMark:
			marks[ev.Content]++
		case event.OpGap:
			gaps++
		}
		if i < len(stored) {
			require.Equal(t, stored[i].Header.Get(event.HeaderMsgID), id, "stream seq %d is the older capture's", m.Sequence)
			continue
		}
		// Published by this capture: tagged, every kind.
		require.NotEqual(t, id, event.UntaggedMsgID(id), "stream seq %d: tagged", m.Sequence)
		switch ev.Op {
		case event.OpCommit:
			require.Equal(t, tagger.CommitMsgID("main", ev.CommitLSN), id)
		case event.OpDelete:
			require.Equal(t, tagger.RowMsgID("main", ev.CommitLSN, ev.Seq), id)
		}
	}
	require.Equal(t, map[string]int{"before": 4, "inside": 4}, marks, "the mark copies are not published again")
	require.Equal(t, 4, gaps, "the gap copies are not published again")
	require.Zero(t, counterValue(t, svc.m.foreign), "nothing the older capture stored is foreign")
	require.Zero(t, counterValue(t, svc.m.collisions))
}

// settled waits until st's last sequence has not moved for half a second
// (up to a minute), so that what a stopped capture wrote is all stored.
func settled(t *testing.T, st jetstream.Stream) {
	t.Helper()
	ctx := context.Background()
	var last uint64
	stable := time.Now()
	require.Eventually(t, func() bool {
		info, err := st.Info(ctx)
		if err != nil {
			return false
		}
		if info.State.LastSeq != last {
			last, stable = info.State.LastSeq, time.Now()
			return false
		}
		return time.Since(stable) >= 500*time.Millisecond
	}, time.Minute, 50*time.Millisecond, "the stream's last sequence kept moving")
}
