package capture

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// TestMessageRightBeforeACommitKeepsPositionsIncreasing: pgoutput gives a
// non-transactional message (a heartbeat, a mark) the LSN where its WAL
// record ends, and a transaction the LSN where its commit record starts.
// When the commit record directly follows the message record, the two are
// equal, and positions built from them alone would repeat: a capture
// restarted while the message was the stream's last one would take the
// transaction's first messages for re-sends and skip them (rows lost). The
// test makes that adjacency happen (a heartbeat emitted inside the deleting
// transaction, right before COMMIT, on a private server with nothing else
// writing WAL), checks positions are strictly increasing, then stops the
// capture with the heartbeat as the stream's last message (a per-subject
// limit refuses the next row) and checks the restarted capture publishes
// every row.
func TestMessageRightBeforeACommitKeepsPositionsIncreasing(t *testing.T) {
	t.Parallel()
	pg := testenv.NewPostgres(t)
	e := &env{db: pg.NewDatabase(t), nats: testenv.NewNATS(t), dir: t.TempDir()}
	e.slot = dbName(t, e.db)
	_, e.js = e.nats.Connect(t)
	ctx := context.Background()
	e.exec(t, `CREATE TABLE items (id int PRIMARY KEY, v text); ALTER TABLE items REPLICA IDENTITY FULL;
		INSERT INTO items SELECT g, 'item ' || g FROM generate_series(1, 4) g`)
	// One partition: every delete of items has one subject, which holds at
	// most one message until the limit is lifted.
	sc := jetstream.StreamConfig{
		Name:                 event.StreamName("main"),
		Subjects:             []string{event.StreamSubjects("main")},
		Storage:              jetstream.FileStorage,
		Duplicates:           2 * time.Minute,
		MaxMsgsPerSubject:    1,
		Discard:              jetstream.DiscardNew,
		DiscardNewPerSubject: true,
		Metadata:             map[string]string{MetaPartitions: "1", MetaSource: "main", MetaWireVersion: "1"},
	}
	_, err := e.js.CreateStream(ctx, sc)
	require.NoError(t, err)
	mod := func(c *Config) { c.Partitions = 1; c.BrokerSyncInterval = time.Hour } // nothing confirmed: a restart re-reads all
	svc := e.start(t, mod)

	e.exec(t, `DELETE FROM items WHERE id = 1`) // items' subject is now full
	e.exec(t, `BEGIN; DELETE FROM items WHERE id IN (2, 3);
		SELECT pg_logical_emit_message(false, 'epitaph.heartbeat', ''); COMMIT`)
	require.Error(t, waitEnded(t, svc), "the second transaction's first row is refused")
	ms := e.messages(t, "main", 3)
	require.Equal(t, []string{"delete public.items", "commit", "mark"}, ops(ms), "the stream ends with the heartbeat")
	hb := ms[2]
	t.Logf("heartbeat at %s (position %s)", hb.ev.LSN, hb.pos)

	sc.MaxMsgsPerSubject, sc.DiscardNewPerSubject, sc.Discard = -1, false, jetstream.DiscardOld
	sc.DenyPurge = true // the capture set it, and it cannot be cancelled
	_, err = e.js.UpdateStream(ctx, sc)
	require.NoError(t, err)
	e.start(t, mod)
	ms = e.messages(t, "main", 6)
	require.Equal(t, []string{"delete public.items", "commit", "mark", "delete public.items", "delete public.items", "commit"}, ops(ms))
	require.Equal(t, hb.ev.LSN, ms[3].ev.CommitLSN,
		"precondition: the commit record directly follows the heartbeat's record (nothing else wrote WAL in between)")
	var prev position
	for i, m := range ms {
		p, err := parsePosition(m.pos)
		require.NoError(t, err)
		if i > 0 {
			require.True(t, p.after(prev), "position %s of message %d does not follow %s", m.pos, m.seq, prev)
		}
		prev = p
	}
	requireOnce(t, ms, 3)
}
