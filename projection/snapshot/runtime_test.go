package snapshot_test

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/projection"
	"github.com/epitaph-dev/epitaph/projection/snapshot"
)

// publish sends the source transaction's deletes and commit to JetStream as
// the capture does (subjects, message ids, headers).
func (s *sourceTx) publish(t *testing.T, js jetstream.JetStream, partitions int) {
	t.Helper()
	p := event.Partition(s.commit.CommitLSN, partitions)
	send := func(subject, id string, ev *event.Event) {
		b, err := event.Encode(ev)
		require.NoError(t, err)
		m := nats.NewMsg(subject)
		m.Data = b
		m.Header.Set(event.HeaderMsgID, id)
		m.Header.Set(event.HeaderVersion, strconv.Itoa(event.Version))
		_, err = js.PublishMsg(s.e.ctx, m)
		require.NoError(t, err)
	}
	for _, a := range s.rows {
		send(event.DeleteSubject(s.commit.Source, p, a.Schema, a.Name), event.MsgID(s.commit.Source, s.commit.CommitLSN, a.Seq),
			&event.Event{Op: event.OpDelete, Source: s.commit.Source, Schema: a.Schema, Table: a.Name,
				XID: s.commit.XID, CommitLSN: s.commit.CommitLSN, CommitTime: s.commit.CommitTime, Seq: a.Seq,
				Identity: event.IdentityFull, Columns: a.Columns, Key: a.Key, Row: a.Row, Refs: a.Refs})
	}
	commit := s.commit
	send(event.CommitSubject(commit.Source, p), event.CommitMsgID(commit.Source, commit.CommitLSN), &commit)
}

// Real deletes, published as events, applied by the real projector runtime:
// the snapshot is built from the archive rows the runtime wrote, and every
// row in it restores to the deleted row.
func TestThroughTheProjectorRuntime(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	url := testenv.NewDatabase(t)
	testenv.Exec(t, url, sourceDDL)
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	defer pool.Close()
	e := &env{ctx: ctx, pool: pool, url: url, schema: "archive_v1", lsn: new(atomic.Uint64)}
	e.lsn.Store(0x2B000000)

	n := testenv.NewNATS(t)
	_, js := n.Connect(t)
	const partitions = 2
	_, err = js.CreateStream(ctx, jetstream.StreamConfig{
		Name: event.StreamName("main"), Subjects: []string{event.StreamSubjects("main")}, Storage: jetstream.FileStorage,
		Metadata: map[string]string{"epitaph.partitions": strconv.Itoa(partitions), "epitaph.source": "main", "epitaph.wire_version": "1"},
	})
	require.NoError(t, err)

	svc, err := projection.New(projection.Config{
		TargetURL: url, NATSURL: n.URL, SourceName: "main", WorkerID: "w1", SnapshotRoots: orderRoots,
		LeaseTTL: 3 * time.Second, FetchWait: 100 * time.Millisecond,
	}, projection.WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil))), projection.WithRegistry(prometheus.NewRegistry()))
	require.NoError(t, err)
	require.NoError(t, svc.Start(ctx))
	defer svc.Stop()

	e.seedOrder(t, 1, 2)
	e.seedOrder(t, 2, 1)
	e.exec(t, `INSERT INTO audit (what) VALUES ('unrelated')`)
	s := e.begin(t)
	s.deleteOrder(t, 1)
	s.deleteOrder(t, 2)
	s.del(t, "public.audit", "true")
	require.NoError(t, s.tx.Commit(ctx))
	s.publish(t, js, partitions)

	// The commit is applied once the runtime has marked the transaction's roots.
	require.Eventually(t, func() bool {
		var marked int
		err := pool.QueryRow(ctx, `SELECT count(*) FROM archive_v1.rows WHERE correlation_id = $1 AND is_root IS NOT NULL`,
			s.correlationID()).Scan(&marked)
		return err == nil && marked == len(s.rows)
	}, time.Minute, 50*time.Millisecond)

	// What the runtime does when it applies the commit; idempotent if it
	// already did.
	require.NoError(t, snapshot.Migrate(ctx, pool, "archive_v1"))
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	_, err = snapshot.CreateJobs(ctx, tx, "archive_v1", &s.commit, orderRoots)
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))

	require.Eventually(t, func() bool {
		if _, err := snapshot.RunBatch(ctx, pool, snapshot.Config{Schema: "archive_v1"}); err != nil {
			return false
		}
		snaps := e.show(t, s.correlationID())
		return len(snaps) == 2 && snaps[`{"id":1}`].Status == snapshot.StatusComplete && snaps[`{"id":2}`].Status == snapshot.StatusComplete
	}, time.Minute, 50*time.Millisecond)

	snaps := e.show(t, s.correlationID())
	for id, lines := range map[string]int{`{"id":1}`: 2, `{"id":2}`: 1} {
		d := decodeDoc(t, snaps[id])
		require.Len(t, d.Children["public.lines"], lines, id)
		require.Len(t, d.Children["public.shipments"], 1, id)
		require.Equal(t, 1+lines+(lines+1)+1, d.Meta.EntityCount, id)
		require.Equal(t, 1, d.Meta.UnrelatedCount, id)
		require.Equal(t, len(s.rows), d.Meta.TransactionRows, id)
		var walk func(table string, key, row json.RawMessage, kids map[string][]docNode)
		walk = func(table string, key, row json.RawMessage, kids map[string][]docNode) {
			var orig string
			for _, a := range s.rows {
				if a.Table == table && compact(t, a.Key) == compact(t, key) {
					orig = a.Original
				}
			}
			var restored string
			require.NoError(t, pool.QueryRow(ctx, "SELECT jsonb_populate_record(NULL::"+table+", $1::jsonb)::text",
				string(row)).Scan(&restored))
			require.Equal(t, orig, restored, "%s %s restores to the deleted row", table, key)
			for _, ns := range kids {
				for _, k := range ns {
					walk(k.Table, k.Key, k.Row, k.Children)
				}
			}
		}
		walk(d.Root.Table, d.Root.Key, d.Root.Row, d.Children)
	}
}
