package projection_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/broker"
	"github.com/epitaph-dev/epitaph/internal/natsconn"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/progress"
	"github.com/epitaph-dev/epitaph/projection"
	"github.com/epitaph-dev/epitaph/projection/version"
)

func TestMain(m *testing.M) { testenv.MainNoLeaks(m) }

const src = "main"

// env is one test's target database, JetStream and stream.
type env struct {
	t          *testing.T
	url        string
	nats       *testenv.NATS
	js         jetstream.JetStream
	partitions int
	lsn        atomic.Uint64
	// signer signs what the test publishes as the capture does (pubMsg,
	// publish, publishAll, heartbeat); a message published with e.js
	// directly is a foreign one.
	signer *testenv.Signer
	// pub is held while a whole transaction (or a heartbeat) is published:
	// like the capture, the test never interleaves another transaction's
	// messages, or a mark, into an open transaction of a partition (a
	// projector refuses those as not part of a verified transaction).
	pub sync.Mutex
}

func newEnv(t *testing.T, partitions int) *env {
	t.Helper()
	return newEnvWith(t, testenv.NewDatabase(t), partitions)
}

func newEnvWith(t *testing.T, url string, partitions int) *env {
	t.Helper()
	return newEnvOn(t, url, testenv.NewNATS(t), partitions)
}

// newEnvAuth is newEnv on an embedded broker that requires credentials
// (its keys in credsDir); the test's own connection is the capture's.
func newEnvAuth(t *testing.T, credsDir string, partitions int) *env {
	t.Helper()
	n := testenv.NewNATSWith(t, broker.Config{Auth: &broker.Auth{Dir: credsDir, Source: src}})
	n.Opts = []nats.Option{natsconn.UserCredentials(broker.CaptureCreds(credsDir))}
	return newEnvOn(t, testenv.NewDatabase(t), n, partitions)
}

func newEnvOn(t *testing.T, url string, n *testenv.NATS, partitions int) *env {
	t.Helper()
	e := &env{t: t, url: url, nats: n, partitions: partitions, signer: testenv.NewSigner()}
	_, e.js = e.nats.Connect(t)
	e.createStream()
	e.lsn.Store(0x1000000)
	return e
}

func (e *env) createStream() {
	e.t.Helper()
	_, err := e.js.CreateStream(context.Background(), jetstream.StreamConfig{
		Name:     event.StreamName(src),
		Subjects: []string{event.StreamSubjects(src)},
		Storage:  jetstream.FileStorage,
		Metadata: map[string]string{
			event.MetaPartitions:  strconv.Itoa(e.partitions),
			event.MetaSource:      src,
			event.MetaWireVersion: "1",
		},
	})
	require.NoError(e.t, err)
}

func testLogger(t *testing.T) *slog.Logger {
	if os.Getenv("EPITAPH_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug})).With("test", t.Name())
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

func (e *env) config(worker string) projection.Config {
	return projection.Config{
		TargetURL:       testenv.NoSearchPath(e.url), // a missing schema qualifier fails
		NATSURL:         e.nats.URL,
		SourceName:      src,
		WorkerID:        worker,
		LeaseTTL:        3 * time.Second,
		BalanceInterval: 300 * time.Millisecond,
		FetchWait:       100 * time.Millisecond,
		StatusInterval:  300 * time.Millisecond,
		MaxBackoff:      time.Second,
	}
}

func (e *env) start(cfg projection.Config) *projection.Service {
	e.t.Helper()
	s, err := projection.New(cfg, projection.WithLogger(testLogger(e.t)), projection.WithRegistry(prometheus.NewRegistry()))
	require.NoError(e.t, err)
	require.NoError(e.t, s.Start(context.Background()))
	e.t.Cleanup(func() { require.NoError(e.t, s.Stop(context.Background())) })
	return s
}

// row is one deleted row of a test transaction.
type row struct {
	schema, table string
	key, image    string
	refs          []event.Ref
	// columns are the event's column types; none: only id, a bigint key.
	columns []event.Column
}

// txn is a published source transaction.
type txn struct {
	lsn       event.LSN
	xid       int64
	partition int
	rows      []row
	time      time.Time
}

func (e *env) nextTx(rows ...row) *txn {
	lsn := event.LSN(e.lsn.Add(0x100))
	return &txn{lsn: lsn, xid: int64(lsn) / 16, partition: event.Partition(lsn, e.partitions), rows: rows,
		time: time.Date(2026, 11, 30, 9, 0, 0, 0, time.UTC).Add(time.Duration(lsn) * time.Microsecond)}
}

// publish publishes the transaction's rows and commit like the capture.
func (e *env) publish(tx *txn) {
	e.t.Helper()
	e.pub.Lock()
	defer e.pub.Unlock()
	for _, m := range e.messages(tx) {
		_, err := e.pubMsg(context.Background(), m)
		require.NoError(e.t, err)
	}
}

// pubMsg signs m as the capture would and publishes it.
func (e *env) pubMsg(ctx context.Context, m *nats.Msg) (*jetstream.PubAck, error) {
	e.signer.Sign(m)
	return e.js.PublishMsg(ctx, m)
}

func (e *env) messages(tx *txn) []*nats.Msg {
	e.t.Helper()
	var out []*nats.Msg
	tables := map[string]int{}
	for i, r := range tx.rows {
		cols := r.columns
		if cols == nil {
			cols = []event.Column{{Name: "id", Type: "bigint", PK: true}}
		}
		ev := &event.Event{Op: event.OpDelete, Source: src, Schema: r.schema, Table: r.table, XID: tx.xid,
			CommitLSN: tx.lsn, CommitTime: tx.time, Seq: i, Identity: event.IdentityFull, Columns: cols,
			Key: json.RawMessage(r.key), Row: json.RawMessage(r.image), Refs: r.refs}
		tables[r.schema+"."+r.table]++
		out = append(out, e.msg(event.DeleteSubject(src, tx.partition, r.schema, r.table), event.MsgID(src, tx.lsn, i), ev))
	}
	commit := &event.Event{Op: event.OpCommit, Source: src, XID: tx.xid, CommitLSN: tx.lsn, CommitTime: tx.time,
		Rows: len(tx.rows), Tables: tables}
	return append(out, e.msg(event.CommitSubject(src, tx.partition), event.CommitMsgID(src, tx.lsn), commit))
}

func (e *env) msg(subject, id string, ev *event.Event) *nats.Msg {
	e.t.Helper()
	b, err := event.Encode(ev)
	require.NoError(e.t, err)
	m := nats.NewMsg(subject)
	m.Data = b
	m.Header.Set(event.HeaderMsgID, id)
	m.Header.Set(event.HeaderVersion, "1")
	return m
}

// heartbeat publishes a heartbeat mark to every partition.
func (e *env) heartbeat() event.LSN {
	e.t.Helper()
	e.pub.Lock()
	defer e.pub.Unlock()
	lsn := event.LSN(e.lsn.Add(0x100))
	for p := 0; p < e.partitions; p++ {
		ev := &event.Event{Op: event.OpMark, Source: src, Partition: p, LSN: lsn, Kind: event.MarkHeartbeat, Time: time.Now()}
		_, err := e.pubMsg(context.Background(), e.msg(event.MarkSubject(src, p), event.MarkMsgID(src, lsn, p), ev))
		require.NoError(e.t, err)
	}
	return lsn
}

func (e *env) conn() *pgx.Conn {
	e.t.Helper()
	ctx := context.Background()
	c, err := pgx.Connect(ctx, e.url)
	require.NoError(e.t, err)
	e.t.Cleanup(func() { c.Close(context.Background()) })
	return c
}

func count(t *testing.T, c *pgx.Conn, sql string, args ...any) int {
	t.Helper()
	var n int
	err := c.QueryRow(context.Background(), sql, args...).Scan(&n)
	if err != nil {
		return -1
	}
	return n
}

// eventually polls cond until it holds or the deadline passes.
// eventually polls cond until it holds. timeout is what the condition needs
// on an idle machine; the deadline is three times that, because these are
// waits for correctness, not speed assertions, and CI shares two cores
// between two test binaries and their Postgres servers.
func eventually(t *testing.T, timeout time.Duration, cond func() bool, msgAndArgs ...any) {
	t.Helper()
	deadline := time.Now().Add(3 * timeout)
	for !cond() {
		if time.Now().After(deadline) {
			require.FailNow(t, "condition not met in time", msgAndArgs...)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func orderRows(orderID, lines int) []row {
	rows := []row{{schema: "public", table: "orders", key: fmt.Sprintf(`{"id":%d}`, orderID),
		image: fmt.Sprintf(`{"id":%d,"customer_id":7,"total":"12.50"}`, orderID),
		refs:  []event.Ref{{Columns: []string{"customer_id"}, Schema: "public", Table: "customers", RefColumns: []string{"id"}}}}}
	for i := 0; i < lines; i++ {
		id := orderID*1000 + i
		rows = append(rows, row{schema: "public", table: "order_lines", key: fmt.Sprintf(`{"id":%d}`, id),
			image: fmt.Sprintf(`{"id":%d,"order_id":%d,"qty":%d}`, id, orderID, i+1),
			refs:  []event.Ref{{Columns: []string{"order_id"}, Schema: "public", Table: "orders", RefColumns: []string{"id"}}}})
	}
	return rows
}

// metricSum adds up every series of a metric family in the service's
// registry.
func metricSum(t *testing.T, s *projection.Service, name string) float64 {
	t.Helper()
	mfs, err := s.Registry().Gather()
	require.NoError(t, err)
	sum := 0.0
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			switch {
			case m.Counter != nil:
				sum += m.Counter.GetValue()
			case m.Gauge != nil:
				sum += m.Gauge.GetValue()
			}
		}
	}
	return sum
}

// publishAll publishes many messages asynchronously in bounded windows.
func (e *env) publishAll(msgs []*nats.Msg) {
	e.t.Helper()
	for i, m := range msgs {
		e.signer.Sign(m)
		_, err := e.js.PublishMsgAsync(m)
		require.NoError(e.t, err)
		if i%1000 == 999 || i == len(msgs)-1 {
			select {
			case <-e.js.PublishAsyncComplete():
			case <-time.After(30 * time.Second):
				e.t.Fatal("publish did not complete")
			}
		}
	}
}

// refRow replaces the row image of the delete event in m by a reference to
// an object (as the capture does for a row too large for one message).
func refRow(t *testing.T, m *nats.Msg, ref *event.ObjectRef) {
	t.Helper()
	var ev event.Event
	require.NoError(t, json.Unmarshal(m.Data, &ev))
	ev.Row, ev.RowRef = nil, ref
	data, err := event.Encode(&ev)
	require.NoError(t, err)
	m.Data = data
}

// storeRow puts a row image under name into obs (the bucket
// epitaph_main_rows) and returns the reference an event carries for it.
func storeRow(t *testing.T, obs jetstream.ObjectStore, name string, row []byte) *event.ObjectRef {
	t.Helper()
	_, err := obs.PutBytes(context.Background(), name, row)
	require.NoError(t, err)
	sum := sha256.Sum256(row)
	return &event.ObjectRef{Bucket: event.RowBucket("main"), Name: name, Size: int64(len(row)), SHA256: hex.EncodeToString(sum[:])}
}

// consumerName is the durable consumer of partition p of archive version
// n for the test's target: the one recorded on its progress row, a name of
// its default consumer group with a random part.
func (e *env) consumerName(n, p int) string {
	e.t.Helper()
	return recordedConsumer(e.t, e.url, "", n, p)
}

// recordedConsumer is the consumer recorded on the progress row of
// partition p of archive version n in the target at url; it must be one
// of group (default: the target's default group) with a random part. A
// worker records it just after it takes the partition, so it waits up to
// 10 s for one.
func recordedConsumer(t *testing.T, url, group string, n, p int) string {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer conn.Close(ctx)
	if group == "" {
		group, err = version.DefaultGroup(ctx, conn)
		require.NoError(t, err)
	}
	var name *string
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		err := conn.QueryRow(ctx, `SELECT consumer FROM epitaph.progress WHERE projection = 'archive' AND version = $1 AND partition = $2`, n, p).Scan(&name)
		if errors.Is(err, pgx.ErrNoRows) {
			name = nil
		} else {
			require.NoError(t, err)
		}
		if name != nil || time.Now().After(deadline) {
			break
		}
	}
	require.NotNil(t, name, "no consumer recorded for archive-v%d-p%d within 10 s", n, p)
	k := progress.Key{Projection: "archive", Version: n, Partition: p}
	require.True(t, version.IsUnitConsumer(*name, k, group), "recorded consumer %q of group %s", *name, group)
	return *name
}
