package projection

import (
	"context"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// A partition whose first fetch comes back full is behind even when the
// page fetched after it without waiting is short (it reached the end of
// what is stored, as a live partition under load does): the group is cut
// at its last commit and the open transaction at its end carried into the
// next group, not written across two target transactions. A partition
// with less than a page stored is caught up and gets its short page whole.
func TestFetchPageBehindIsCutAtItsLastCommit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srv := testenv.NewNATS(t)
	nc, js := srv.Connect(t)
	defer nc.Close()
	const source = "fetch"
	stream, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: event.StreamName(source), Subjects: []string{event.StreamSubjects(source)}})
	require.NoError(t, err)
	// publish puts txs transactions of 9 rows and a commit on partition p,
	// then open rows of a transaction whose commit is not stored yet.
	publish := func(p, txs, open int) {
		lsn := event.LSN(0x1000)
		for i := 0; i < txs+1; i++ {
			lsn += 0x100
			rows := 9
			if i == txs {
				rows = open
			}
			for s := 0; s < rows; s++ {
				ev := &event.Event{V: 1, Op: event.OpDelete, Source: source, Schema: "public", Table: "t", XID: int64(i + 1),
					CommitLSN: lsn, CommitTime: time.Now(), Seq: s, Identity: "default", Key: []byte(`{"id":1}`), Row: []byte(`{"id":1}`)}
				b, err := event.Encode(ev)
				require.NoError(t, err)
				_, err = js.Publish(ctx, event.DeleteSubject(source, p, "public", "t"), b)
				require.NoError(t, err)
			}
			if i == txs {
				break
			}
			b, err := event.Encode(&event.Event{V: 1, Op: event.OpCommit, Source: source, XID: int64(i + 1), CommitLSN: lsn,
				CommitTime: time.Now(), Rows: rows})
			require.NoError(t, err)
			_, err = js.Publish(ctx, event.CommitSubject(source, p), b)
			require.NoError(t, err)
		}
	}
	worker := func(p int) *partitionWorker {
		cons, err := stream.CreateConsumer(ctx, jetstream.ConsumerConfig{
			Durable: "fetch-p" + itoa(p), FilterSubject: event.PartitionFilter(source, p),
			AckPolicy: jetstream.AckAllPolicy, MaxAckPending: maxAckPending,
		})
		require.NoError(t, err)
		cfg := &Config{BatchSize: MaxBatchSize, FetchWait: 500 * time.Millisecond, Decoder: &event.Decoder{}}
		return &partitionWorker{workerEnv: workerEnv{cfg: cfg}, cons: cons, log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	}

	// Partition 0: 70 transactions (700 messages) and 5 rows of an open
	// one: a full page of 500, then 205 without waiting.
	publish(0, 70, 5)
	p := worker(0).fetchPage()
	require.NoError(t, p.err)
	require.Len(t, p.items, 705)
	require.True(t, p.full, "the first page came back full: the partition is behind")
	apply, carry := splitAtCommit(p.items)
	require.Len(t, apply, 700)
	require.Equal(t, event.OpCommit, apply[len(apply)-1].ev.Op)
	require.Len(t, carry, 5)
	for i, it := range p.items {
		require.Equal(t, uint64(i+1), it.dseq, "deliveries in order")
	}

	// Partition 1: 30 transactions and 5 open rows, less than a page: the
	// partition is caught up, its page is applied whole.
	publish(1, 30, 5)
	p = worker(1).fetchPage()
	require.NoError(t, p.err)
	require.Len(t, p.items, 305)
	require.False(t, p.full, "less than a page stored: caught up")
}

// A fetch ends when the server ends it (the batch full, or its expiry
// passed), not at a deadline of the client's own: a client that gave up
// first left what the server still delivered to an inbox no longer read,
// delivered and never seen, and the partition reset its consumer for the
// gap (TestTwoTargetsFromOneStream's unexplained reset, "page starts at 153
// but the partition continues at 152"). Messages published while short
// fetches come and go all arrive, in order, no delivery skipped, and an
// idle fetch is no error.
func TestFetchPageLosesNoDeliveryToAnEndingFetch(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srv := testenv.NewNATS(t)
	nc, js := srv.Connect(t)
	defer nc.Close()
	const source = "ending"
	stream, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: event.StreamName(source), Subjects: []string{event.StreamSubjects(source)}})
	require.NoError(t, err)
	cons, err := stream.CreateConsumer(ctx, jetstream.ConsumerConfig{
		Durable: "ending-p0", FilterSubject: event.PartitionFilter(source, 0),
		AckPolicy: jetstream.AckAllPolicy, AckWait: 5 * time.Minute, MaxAckPending: maxAckPending,
	})
	require.NoError(t, err)
	cfg := &Config{BatchSize: MaxBatchSize, FetchWait: 10 * time.Millisecond, Decoder: &event.Decoder{}}
	w := &partitionWorker{workerEnv: workerEnv{cfg: cfg}, cons: cons, log: slog.New(slog.NewTextHandler(io.Discard, nil))}

	const n = 400
	published := make(chan error, 1)
	go func() {
		// Paced so that messages arrive while fetches are open and end.
		tick := time.NewTicker(time.Millisecond)
		defer tick.Stop()
		for i := 1; i <= n; i++ {
			if i%4 == 0 {
				<-tick.C
			}
			if _, err := js.Publish(ctx, event.CommitSubject(source, 0), []byte(itoa(i))); err != nil {
				published <- err
				return
			}
		}
		published <- nil
	}()
	var seq, dseq uint64
	idle := 0
	for deadline := time.Now().Add(2 * time.Minute); seq < n; {
		require.True(t, time.Now().Before(deadline), "received %d of %d messages", seq, n)
		p := w.fetchPage()
		require.NoError(t, p.err, "fetch after %d messages", seq)
		if len(p.items) == 0 {
			idle++
			continue
		}
		for _, it := range p.items {
			require.Equal(t, dseq+1, it.dseq, "delivery after %d (delivered to a fetch no longer read?)", dseq)
			require.Equal(t, seq+1, it.seq)
			require.Equal(t, itoa(int(it.seq)), string(it.data))
			dseq, seq = it.dseq, it.seq
		}
		require.NoError(t, p.items[len(p.items)-1].msg.Ack())
	}
	require.NoError(t, <-published)
	t.Logf("%d messages, %d deliveries, %d idle fetches", seq, dseq, idle)
}
