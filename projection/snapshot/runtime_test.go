package snapshot_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"github.com/epitaph-dev/epitaph/quarantine"
	"io"
	"log/slog"
	"strconv"
	"sync"
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

// signers sign what these tests publish, one per stream connection.
var signers sync.Map // jetstream.JetStream -> *testenv.Signer

func signerFor(js jetstream.JetStream) *testenv.Signer {
	s, _ := signers.LoadOrStore(js, testenv.NewSigner())
	return s.(*testenv.Signer)
}

// publish sends the given deletes of the source transaction (all when
// none are given), then its commit, to JetStream as the capture does
// (subjects, message ids, headers); withCommit false sends rows only.
func (s *sourceTx) publish(t *testing.T, js jetstream.JetStream, partitions int, withCommit bool, rows ...*archived) {
	s.publishRef(t, js, partitions, withCommit, nil, nil, rows...)
}

// publishRef is publish with the row of refRow sent as an object
// reference (as the capture does for a large row).
func (s *sourceTx) publishRef(t *testing.T, js jetstream.JetStream, partitions int, withCommit bool, refRow *archived, ref *event.ObjectRef, rows ...*archived) {
	t.Helper()
	p := event.Partition(s.commit.CommitLSN, partitions)
	send := func(subject, id string, ev *event.Event) {
		b, err := event.Encode(ev)
		require.NoError(t, err)
		m := nats.NewMsg(subject)
		m.Data = b
		m.Header.Set(event.HeaderMsgID, id)
		m.Header.Set(event.HeaderVersion, strconv.Itoa(event.Version))
		signerFor(js).Sign(m) // as the capture does: the projector verifies
		_, err = js.PublishMsg(s.e.ctx, m)
		require.NoError(t, err)
	}
	if len(rows) == 0 {
		rows = s.rows
	}
	for _, a := range rows {
		ev := &event.Event{Op: event.OpDelete, Source: s.commit.Source, Schema: a.Schema, Table: a.Name,
			XID: s.commit.XID, CommitLSN: s.commit.CommitLSN, CommitTime: s.commit.CommitTime, Seq: a.Seq,
			Identity: event.IdentityFull, Columns: a.Columns, Key: a.Key, Row: a.Row, Refs: a.Refs}
		if a == refRow {
			ev.Row, ev.RowRef = nil, ref
		}
		send(event.DeleteSubject(s.commit.Source, p, a.Schema, a.Name), event.MsgID(s.commit.Source, s.commit.CommitLSN, a.Seq), ev)
	}
	if !withCommit {
		return
	}
	commit := s.commit
	send(event.CommitSubject(commit.Source, p), event.CommitMsgID(commit.Source, commit.CommitLSN), &commit)
}

// Real deletes, published as events, applied by the real projector runtime,
// which creates the jobs and runs the batcher: a transaction missing one
// event (quarantined: its large row's object was missing) stays pending
// (retried, no partial document); when the event arrives after the commit
// (replayed) the job is invalidated and rebuilt complete; every row in the documents restores to the deleted row.
func TestThroughTheProjectorRuntime(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	url := testenv.NewDatabase(t)
	testenv.Exec(t, url, sourceDDL)
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	defer pool.Close()
	e := &env{ctx: ctx, pool: pool, src: pool, url: url, schema: "archive_v1", lsn: new(atomic.Uint64)}
	e.lsn.Store(0x2B000000)

	n := testenv.NewNATS(t)
	_, js := n.Connect(t)
	const partitions = 2
	_, err = js.CreateStream(ctx, jetstream.StreamConfig{
		Name: event.StreamName("main"), Subjects: []string{event.StreamSubjects("main")}, Storage: jetstream.FileStorage,
		Metadata: map[string]string{event.MetaPartitions: strconv.Itoa(partitions), event.MetaSource: "main", event.MetaWireVersion: "1"},
	})
	require.NoError(t, err)

	reg := prometheus.NewRegistry()
	svc, err := projection.New(projection.Config{
		TargetURL: testenv.NoSearchPath(url), NATSURL: n.URL, SourceName: "main", WorkerID: "w1", SnapshotRoots: orderRoots,
		LeaseTTL: 3 * time.Second, FetchWait: 100 * time.Millisecond,
	}, projection.WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil))), projection.WithRegistry(reg))
	require.NoError(t, err)
	require.NoError(t, svc.Start(ctx))
	defer func() { require.NoError(t, svc.Stop(context.Background())) }()

	e.seedOrder(t, 1, 2)
	e.seedOrder(t, 2, 1)
	e.exec(t, `INSERT INTO audit (what) VALUES ('unrelated')`)
	s := e.begin(t)
	s.deleteOrder(t, 1)
	s.deleteOrder(t, 2)
	s.del(t, "public.audit", "true")
	require.NoError(t, s.tx.Commit(ctx))
	// A note of order 1 is held back: its row is in the object store (as
	// a large row is) and the object is missing when the projector reads
	// it, so the event is quarantined and the verified transaction is one
	// row short at its commit. (Every event, including this one, comes
	// before the commit, as the signing capture publishes them.)
	late := s.rows[0]
	require.Equal(t, "public.line_notes", late.Table)
	obs, err := js.CreateObjectStore(ctx, jetstream.ObjectStoreConfig{Bucket: event.RowBucket("main")})
	require.NoError(t, err)
	sum := sha256.Sum256(late.Row)
	ref := &event.ObjectRef{Bucket: event.RowBucket("main"), Name: "late-note", Size: int64(len(late.Row)), SHA256: hex.EncodeToString(sum[:])}
	s.publishRef(t, js, partitions, true, late, ref)

	snaps := func() map[string]snapshot.Snapshot {
		list, err := snapshot.Show(ctx, pool, "archive", s.correlationID())
		if err != nil {
			return nil
		}
		out := map[string]snapshot.Snapshot{}
		for _, x := range list {
			out[compact(t, x.RootKey)] = x
		}
		return out
	}
	// The runtime made both jobs at the commit; its batcher tried them and
	// found the group short.
	require.Eventually(t, func() bool {
		m := snaps()
		return len(m) == 2 && m[`{"id":1}`].RetryCount >= 1
	}, time.Minute, 50*time.Millisecond)
	short := snaps()[`{"id":1}`]
	require.Equal(t, snapshot.StatusPending, short.Status)
	require.Nil(t, short.Payload)
	require.Contains(t, short.FailureReason, "public.line_notes has 4 of 5 rows", "the group is the whole transaction")

	// The held-back event arrives after the commit: its object is stored
	// and the quarantined event replayed.
	_, err = obs.PutBytes(ctx, "late-note", late.Row)
	require.NoError(t, err)
	res, err := quarantine.Replay(ctx, pool, quarantine.Selection{Filter: quarantine.Filter{Projection: "archive", Category: quarantine.CategoryMissingPayload}},
		projection.ReplayFunc(projection.ReplayConfig{JetStream: js, SnapshotRoots: orderRoots}))
	require.NoError(t, err)
	require.Len(t, res.Replayed, 1)
	require.Eventually(t, func() bool {
		m := snaps()
		return len(m) == 2 && m[`{"id":1}`].Status == snapshot.StatusComplete && m[`{"id":2}`].Status == snapshot.StatusComplete
	}, time.Minute, 50*time.Millisecond)

	got := snaps()
	for id, lines := range map[string]int{`{"id":1}`: 2, `{"id":2}`: 1} {
		d := decodeDoc(t, got[id])
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
	// The worker's registry carries the snapshot metrics.
	require.Eventually(t, func() bool {
		return gauge(t, reg, "epitaph_projector_snapshot_jobs", "status", "complete", "projection", "archive", "version", "1") == 2
	}, time.Minute, 100*time.Millisecond)
}

// The runtime assembles a transaction whose rows and commit are in one
// page inside the apply transaction: its documents are complete the moment
// its commit is visible (completed_at is the rows' archived_at). A
// transaction spanning pages is assembled from the archive by the apply
// transaction that applies its commit: complete the moment its commit is
// visible too, written once (never a pending job). A batch rebuilding
// either document from the archive writes the same payload and fingerprint.
func TestInPageAndSpanningThroughTheRuntime(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	url := testenv.NewDatabase(t)
	testenv.Exec(t, url, sourceDDL)
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	defer pool.Close()
	e := &env{ctx: ctx, pool: pool, src: pool, url: url, schema: "archive_v1", lsn: new(atomic.Uint64)}
	e.lsn.Store(0x3C000000)

	n := testenv.NewNATS(t)
	_, js := n.Connect(t)
	const partitions = 1
	_, err = js.CreateStream(ctx, jetstream.StreamConfig{
		Name: event.StreamName("main"), Subjects: []string{event.StreamSubjects("main")}, Storage: jetstream.FileStorage,
		Metadata: map[string]string{event.MetaPartitions: strconv.Itoa(partitions), event.MetaSource: "main", event.MetaWireVersion: "1"},
	})
	require.NoError(t, err)

	e.seedOrder(t, 1, 1) // 5 rows + commit: one page of 10
	e.seedOrder(t, 2, 4) // 11 rows + commit: three pages
	small := e.begin(t)
	small.deleteOrder(t, 1)
	require.NoError(t, small.tx.Commit(ctx))
	big := e.begin(t)
	big.deleteOrder(t, 2)
	require.NoError(t, big.tx.Commit(ctx))
	small.publish(t, js, partitions, true)
	big.publish(t, js, partitions, true)

	svc, err := projection.New(projection.Config{
		TargetURL: url, NATSURL: n.URL, SourceName: "main", WorkerID: "w1", SnapshotRoots: orderRoots,
		LeaseTTL: 3 * time.Second, FetchWait: 100 * time.Millisecond, BatchSize: 10,
	}, projection.WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil))))
	require.NoError(t, err)
	require.NoError(t, svc.Start(ctx))
	defer func() { require.NoError(t, svc.Stop(context.Background())) }()

	type job struct {
		status                                       string
		payload, fingerprint                         string
		created, completed, archivedMin, archivedMax time.Time
	}
	get := func(s *sourceTx) (job, bool) {
		var j job
		var payload, fp *string
		var completed *time.Time
		err := pool.QueryRow(ctx, `SELECT s.status, s.payload::text, s.fingerprint, s.created_at, s.completed_at,
			       (SELECT min(archived_at) FROM archive_v1.rows r WHERE r.correlation_id = s.correlation_id),
			       (SELECT max(archived_at) FROM archive_v1.rows r WHERE r.correlation_id = s.correlation_id)
			  FROM archive_v1.snapshots s WHERE s.correlation_id = $1`, s.correlationID()).
			Scan(&j.status, &payload, &fp, &j.created, &completed, &j.archivedMin, &j.archivedMax)
		if err != nil {
			return j, false
		}
		if payload != nil {
			j.payload, j.fingerprint = *payload, *fp
		}
		if completed != nil {
			j.completed = *completed
		}
		return j, true
	}
	var inPage, spanning job
	require.Eventually(t, func() bool {
		var ok1, ok2 bool
		inPage, ok1 = get(small)
		spanning, ok2 = get(big)
		return ok1 && ok2 && spanning.status == snapshot.StatusComplete
	}, time.Minute, 50*time.Millisecond)

	require.Equal(t, snapshot.StatusComplete, inPage.status)
	require.True(t, inPage.completed.Equal(inPage.created), "assembled by the transaction that made the job")
	require.True(t, inPage.completed.Equal(inPage.archivedMax), "and archived the rows")
	require.True(t, spanning.archivedMax.After(spanning.archivedMin), "the spanning transaction's rows were archived by several pages")
	require.True(t, spanning.completed.Equal(spanning.created), "assembled by the transaction that made the job")
	require.False(t, spanning.completed.Before(spanning.archivedMax), "the one that applied its commit")
	require.Equal(t, len(big.rows), decodeDoc(t, e.show(t, big.correlationID())[`{"id":2}`]).Meta.EntityCount)
	require.Equal(t, len(small.rows), decodeDoc(t, e.show(t, small.correlationID())[`{"id":1}`]).Meta.EntityCount)

	// Rebuilt by a batch from the archive: the same documents.
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	_, err = snapshot.Invalidate(ctx, tx, "archive_v1", []string{small.correlationID(), big.correlationID()})
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	_, err = snapshot.RunBatch(ctx, pool, snapshot.Config{Schema: "archive_v1"})
	require.NoError(t, err)
	for _, c := range []struct {
		tx    *sourceTx
		first job
	}{{small, inPage}, {big, spanning}} {
		var rebuilt job
		require.Eventually(t, func() bool {
			var ok bool
			rebuilt, ok = get(c.tx)
			return ok && rebuilt.status == snapshot.StatusComplete
		}, time.Minute, 50*time.Millisecond)
		require.True(t, rebuilt.completed.After(rebuilt.created), "rebuilt by a batch")
		require.Equal(t, c.first.payload, rebuilt.payload)
		require.Equal(t, c.first.fingerprint, rebuilt.fingerprint)
	}
}
