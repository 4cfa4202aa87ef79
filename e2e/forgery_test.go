package e2e_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/bench"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/internal/workload"
)

// forger plays a hostile client on a permissive broker (no auth): it
// publishes garbage, valid-shaped forged deletes, far-future positions and
// marks, and forgeries that take the message ids of real rows the capture
// is about to publish. It remembers the stream sequence of every forgery
// the stream stored.
type forger struct {
	js  jetstream.JetStream
	rng *rand.Rand

	mu     sync.Mutex
	stored map[uint64]string // stream seq -> what
	kinds  map[string]int
}

func (f *forger) publish(ctx context.Context, what string, m *nats.Msg) {
	ack, err := f.js.PublishMsg(ctx, m)
	if err != nil || ack.Duplicate {
		return // refused (e.g. the id was taken already): nothing stored
	}
	f.mu.Lock()
	f.stored[ack.Sequence] = what
	f.kinds[what]++
	f.mu.Unlock()
}

func forgedDelete(lsn event.LSN, seq, partition int, id string) *nats.Msg {
	ev := &event.Event{Op: event.OpDelete, Source: "main", Schema: "public", Table: "orders", XID: 42,
		CommitLSN: lsn, CommitTime: time.Now().UTC(), Seq: seq, Identity: event.IdentityFull,
		Columns: []event.Column{{Name: "id", Type: "bigint", PK: true}},
		Key:     json.RawMessage(`{"id":999999999}`), Row: json.RawMessage(`{"id":999999999,"customer_id":1,"total":"0.00","forged":true}`)}
	b, _ := event.Encode(ev)
	m := nats.NewMsg(event.DeleteSubject("main", partition, "public", "orders"))
	m.Data = b
	m.Header.Set(event.HeaderMsgID, id)
	m.Header.Set(event.HeaderVersion, "1")
	m.Header.Set(event.HeaderPosition, fmt.Sprintf("%s#%d", lsn, seq))
	m.Header.Set(event.HeaderPartitionSeq, "1")
	return m
}

// Pre-empting forgeries race the capture for the ids of a transaction's
// next rows and its commit while it publishes them: they follow the first
// row they see on the stream and publish seqs 1-3 and the commit under the
// ids they would have without their keyed tag (event.MsgIDTagger), the
// best a writer without the signing key can predict. Before row ids were tagged, one that won the
// race displaced the real row (published without an acknowledgement of its
// own, it was dropped as a duplicate unnoticed) and the transaction ended
// in quarantine with its rows missing; now the forgeries are merely
// foreign messages in the chain.

// run forges until ctx is done; pre-empting forgeries follow the real rows
// it sees on the stream (a core subscription), taking the ids of the next
// seqs of the same transaction before the capture publishes them.
func (f *forger) run(ctx context.Context, nc *nats.Conn) error {
	seen := make(chan *nats.Msg, 1024)
	sub, err := nc.Subscribe("epitaph.main.*.delete.>", func(m *nats.Msg) {
		select {
		case seen <- m:
		default:
		}
	})
	if err != nil {
		return err
	}
	defer func() { _ = sub.Unsubscribe() }() // the connection closes anyway
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	preempted := map[event.LSN]bool{}
	i := 0
	for {
		select {
		case <-ctx.Done():
			return nil
		case m := <-seen:
			ev, err := event.Decode(m.Data)
			if err != nil || ev.Seq != 0 || preempted[ev.CommitLSN] || len(preempted) > 40 {
				continue
			}
			preempted[ev.CommitLSN] = true
			p := event.Partition(ev.CommitLSN, 8)
			for seq := 1; seq <= 3; seq++ {
				f.publish(ctx, "pre-empting", forgedDelete(ev.CommitLSN, seq, p, event.MsgID("main", ev.CommitLSN, seq)))
			}
			// And the transaction's commit, under its plain id: before
			// commit ids were tagged, one stored between the last row
			// and the commit could keep the real commit out of the
			// stream.
			c := &event.Event{Op: event.OpCommit, Source: "main", XID: ev.XID, CommitLSN: ev.CommitLSN, CommitTime: ev.CommitTime, Rows: 1,
				Tables: map[string]int{"public.orders": 1}}
			b, _ := event.Encode(c)
			fc := nats.NewMsg(event.CommitSubject("main", p))
			fc.Data = b
			fc.Header.Set(event.HeaderMsgID, event.CommitMsgID("main", ev.CommitLSN))
			fc.Header.Set(event.HeaderVersion, "1")
			f.publish(ctx, "pre-empting commit", fc)
		case <-tick.C:
			i++
			p := f.rng.IntN(8)
			switch i % 5 {
			case 0:
				m := nats.NewMsg(event.DeleteSubject("main", p, "public", "orders"))
				m.Data = []byte("not json")
				f.publish(ctx, "garbage", m)
			case 1:
				lsn := event.LSN(f.rng.Uint64N(1 << 40))
				f.publish(ctx, "forged delete", forgedDelete(lsn, 0, f.rng.IntN(8), fmt.Sprintf("main/forged/%d", i)))
			case 2:
				far := event.LSN(0xFFFFFFFFFFFFFFF0)
				f.publish(ctx, "far-future delete", forgedDelete(far, i, event.Partition(far, 8), fmt.Sprintf("main/far/%d", i)))
			case 3:
				far := event.LSN(0xFFFFFFFFFFFFFF00)
				ev := &event.Event{Op: event.OpMark, Source: "main", Partition: p, LSN: far, Kind: event.MarkUser, Time: time.Now()}
				b, _ := event.Encode(ev)
				m := nats.NewMsg(event.MarkSubject("main", p))
				m.Data = b
				m.Header.Set(event.HeaderMsgID, fmt.Sprintf("main/mark/%d", i))
				m.Header.Set(event.HeaderPosition, "FFFFFFFF/FFFFFFF0#0")
				m.Header.Set(event.HeaderPartitionSeq, "999999")
				f.publish(ctx, "far-future mark", m)
			case 4:
				lsn := event.LSN(f.rng.Uint64N(1 << 40))
				ev := &event.Event{Op: event.OpCommit, Source: "main", XID: 1, CommitLSN: lsn, CommitTime: time.Now().UTC(), Rows: 1,
					Tables: map[string]int{"public.orders": 1}}
				b, _ := event.Encode(ev)
				m := nats.NewMsg(event.CommitSubject("main", event.Partition(lsn, 8)))
				m.Data = b
				m.Header.Set(event.HeaderMsgID, event.CommitMsgID("main", lsn))
				m.Header.Set(event.HeaderDigest, "sha256:00")
				m.Header.Set(event.HeaderSignature, "ed25519:AAAA")
				f.publish(ctx, "forged commit", m)
			}
		}
	}
}

// TestForgeriesNeverReachTheArchive is the projector half of the trust
// proof, through the real binaries on a deliberately permissive broker (an
// external nats-server without authentication): while the randomized
// workload runs, and the capture and two projector workers are each
// SIGKILLed and restarted, a hostile client publishes garbage, forged
// deletes and commits, far-future positions and marks, and forgeries that
// pre-empt real rows' message ids. At the end the archive equals the
// deleted rows exactly (none missing, none extra, values equal), every
// forgery the stream stored is in quarantine, and the partitions'
// watermarks were never moved by a forged mark.
func TestForgeriesNeverReachTheArchive(t *testing.T) {
	t.Parallel()
	bins := binaries(t)
	seed := testSeed(t)
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 11))

	url := testenv.NewDatabase(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	require.NoError(t, workload.Setup(ctx, url))
	_, err := workload.Seed(ctx, url, workload.SeedConfig{Customers: 400, OrdersPerCustomer: 8})
	require.NoError(t, err)

	broker := testenv.NewNATS(t) // external, no auth: anyone may publish
	nc, js := broker.Connect(t)
	metrics, err := bench.LocalAddr()
	require.NoError(t, err)
	dataDir := t.TempDir()
	cenv := bench.CaptureEnv(url, broker.URL, "", dataDir, metrics, "main", "epitaph_e2e_forgery")
	capture := supervise(t, "capture", bins["capture"], joinEnv(cenv, "EPITAPH_HEARTBEAT_INTERVAL=1s"), seed)
	watch, err := bench.WatchStream(broker.URL, "main")
	require.NoError(t, err)
	defer watch.Close()
	require.NoError(t, bench.WaitCaptureReady(ctx, watch, url, "epitaph_e2e_forgery", captureReadyTimeout, nil))

	workers := superviseProjectors(t, bins["projector"], url, broker.URL, 2, seed)
	// The projectors run every partition before any forgery exists (no
	// legacy boundary is recorded: unsigned messages are never believed).
	require.NoError(t, workload.WaitFor(ctx, time.Minute, 100*time.Millisecond, func(ctx context.Context) (bool, error) {
		n, err := bench.Count(ctx, url, "SELECT count(*) FROM epitaph.progress")
		return n >= 8, err
	}))

	f := &forger{js: js, rng: rand.New(rand.NewPCG(seed, 12)), stored: map[uint64]string{}, kinds: map[string]int{}}
	fctx, stopForger := context.WithCancel(ctx)
	forged := make(chan error, 1)
	go func() { forged <- f.run(fctx, nc) }()

	type outcome struct {
		res workload.Result
		err error
	}
	done := make(chan outcome, 1)
	go func() {
		res, err := workload.Run(ctx, url, workload.Plan{Seed: seed, Transactions: 300, MaxOrdersPerTx: 10, Reinserts: 3,
			Pause: 20 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))})
		done <- outcome{res, err}
	}()
	faults := chaos(ctx, rng, time.Second, 3*time.Second, map[string]func(){
		"kill-capture-1":    capture.Kill,
		"kill-capture-2":    capture.Kill,
		"kill-projector0-1": workers[0].Kill,
		"kill-projector0-2": workers[0].Kill,
		"kill-projector1-1": workers[1].Kill,
		"kill-projector1-2": workers[1].Kill,
	})
	out := <-done
	require.NoError(t, out.err)
	stopForger()
	require.NoError(t, <-forged)
	t.Logf("faults: %s", summary(faults))
	t.Logf("forgeries stored by the stream: %v", f.kinds)
	require.Positive(t, f.kinds["garbage"])
	require.Positive(t, f.kinds["forged delete"])
	require.Positive(t, f.kinds["far-future mark"])

	expected, err := workload.Expected(ctx, url)
	require.NoError(t, err)
	require.Equal(t, out.res.Deleted, int64(len(expected)))

	// First the stream, as a projector must see it: every deleted row a
	// member of a transaction signed with the capture's key. A shortfall
	// here is the capture's (a real row the forgeries displaced).
	pubPEM, err := os.ReadFile(filepath.Join(dataDir, "signing.pub"))
	require.NoError(t, err)
	pub, err := event.ParsePublicKey(pubPEM)
	require.NoError(t, err)
	var srep workload.Report
	err = workload.WaitFor(ctx, 2*time.Minute, time.Second, func(ctx context.Context) (bool, error) {
		verified, err := workload.VerifiedDeletes(ctx, broker.URL, "main", pub)
		if err != nil {
			return false, err
		}
		srep, err = workload.VerifyStream(ctx, url, expected, verified)
		return err == nil && srep.OK(), err
	})
	require.NoError(t, err, "the stream's verified deletes (capture side): %s", srep.String())

	// A last signed heartbeat settles rows no commit claimed.
	var archived int64
	err = workload.WaitFor(ctx, 5*time.Minute, 250*time.Millisecond, func(ctx context.Context) (bool, error) {
		n, err := bench.Count(ctx, url, "SELECT count(*) FROM archive.rows WHERE source = 'main'")
		archived = n
		if err != nil || n < int64(len(expected)) {
			return false, err
		}
		q, err := bench.Count(ctx, url, "SELECT count(DISTINCT stream_seq) FROM epitaph.quarantine WHERE projection = 'archive' AND version = 1")
		return q >= int64(len(f.stored)), err
	})
	if err != nil {
		t.Fatalf("archive has %d of %d rows: %v\n%s", archived, len(expected), err, pipelineState(ctx, url, watch))
	}
	rep, err := workload.VerifyArchive(ctx, url, expected)
	require.NoError(t, err)
	t.Logf("archive verification: %s", rep.String())
	require.True(t, rep.OK(), rep.String())

	conn, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer conn.Close(ctx)
	rows, err := conn.Query(ctx, `SELECT stream_seq, category FROM epitaph.quarantine WHERE projection = 'archive' AND version = 1`)
	require.NoError(t, err)
	type qe struct {
		seq int64
		cat string
	}
	got, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (qe, error) {
		var e qe
		return e, r.Scan(&e.seq, &e.cat)
	})
	require.NoError(t, err)
	inQuarantine := map[uint64]string{}
	for _, e := range got {
		inQuarantine[uint64(e.seq)] = e.cat
	}
	var missing []string
	for seq, what := range f.stored {
		cat, ok := inQuarantine[seq]
		switch {
		case !ok:
			missing = append(missing, fmt.Sprintf("%d (%s)", seq, what))
		case what == "garbage":
			require.Equal(t, "malformed", cat, "seq %d", seq)
		default:
			require.Equal(t, "unauthenticated", cat, "seq %d (%s)", seq, what)
		}
	}
	require.Empty(t, missing, "forgeries the stream holds but no quarantine entry names")
	require.Zero(t, count(t, conn, `SELECT count(*) FROM archive_v1.rows WHERE key = '{"id":999999999}'`), "no forged row, not even invisibly")
	require.Zero(t, count(t, conn, `SELECT count(*) FROM epitaph.progress WHERE source_lsn >= 'FFFFFFFF/00000000'`), "no forged mark moved a watermark")
	require.Zero(t, count(t, conn, `SELECT count(*) FROM archive_v1.gaps WHERE acknowledged_at IS NULL`), "nothing was removed from the stream")
	for _, w := range workers {
		t.Logf("%s: %s", w.name, w.Stats())
		require.Zero(t, w.LogCount("panic"))
	}
	t.Logf("%s", capture.Stats())
	require.False(t, strings.Contains(capture.logTail(50), "panic"))
}

func count(t *testing.T, c *pgx.Conn, sql string) int {
	t.Helper()
	var n int
	require.NoError(t, c.QueryRow(context.Background(), sql).Scan(&n))
	return n
}
