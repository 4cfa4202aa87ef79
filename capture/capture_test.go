package capture

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

func TestMain(m *testing.M) { testenv.MainNoLeaks(untouchedDefaultDataDir{m}) }

// defaultDataDir is the capture binary's --data-dir default, relative to
// the working directory: for a test, this package's source directory,
// which every test shares.
const defaultDataDir = "epitaph-data"

// untouchedDefaultDataDir runs the tests and fails the binary when any of
// them wrote to defaultDataDir (a capture started without a data dir of
// its own): tests write only to temporary directories, and captures of
// different tests sharing one would share their partition sequence
// records.
type untouchedDefaultDataDir struct{ m *testing.M }

func (u untouchedDefaultDataDir) Run() int {
	before := dirState(defaultDataDir)
	code := u.m.Run()
	_ = os.RemoveAll(signingKeysDir())
	after := dirState(defaultDataDir)
	var written []string
	for name, st := range after {
		if before[name] != st {
			written = append(written, name)
		}
	}
	if len(written) > 0 {
		slices.Sort(written)
		wd, _ := os.Getwd()
		fmt.Fprintf(os.Stderr, "capture tests wrote %s in %s: start every capture with a data dir of the test's (t.TempDir)\n",
			strings.Join(written, ", "), filepath.Join(wd, defaultDataDir))
		return 1
	}
	return code
}

// dirState is each file of dir by name, with its size and modification
// time; nil when dir does not exist.
func dirState(dir string) map[string]string {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil
	}
	st := map[string]string{}
	for _, e := range entries {
		if info, err := e.Info(); err == nil {
			st[e.Name()] = fmt.Sprint(info.Size(), info.ModTime().UnixNano())
		}
	}
	return st
}

// env is one test's source database and JetStream server.
type env struct {
	db   string
	slot string // slots are per server: one per test database
	nats *testenv.NATS
	js   jetstream.JetStream
	dir  string // data dir: the signing key
}

func setup(t *testing.T) *env {
	t.Helper()
	e := &env{db: testenv.NewDatabase(t), nats: testenv.NewNATS(t), dir: t.TempDir()}
	e.slot = dbName(t, e.db)
	_, e.js = e.nats.Connect(t)
	return e
}

type testLogWriter struct{ t *testing.T }

func (w testLogWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

func testLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(testLogWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

func (e *env) config() Config {
	return Config{
		SourceURL:          e.db,
		DataDir:            e.dir, // the signing key
		SlotName:           e.slot,
		NATSURL:            e.nats.URL,
		Partitions:         4,
		HeartbeatInterval:  -1,
		BrokerSyncInterval: -1,
	}
}

// newService builds a service and stops it when the test ends.
func newService(t *testing.T, cfg Config) *Service {
	t.Helper()
	svc, err := New(cfg, WithLogger(testLogger(t)))
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, svc.Stop(context.Background())) })
	return svc
}

// start starts a capture with cfg (modified by mod) and stops it when the
// test ends.
func (e *env) start(t *testing.T, mod func(*Config)) *Service {
	t.Helper()
	cfg := e.config()
	if mod != nil {
		mod(&cfg)
	}
	svc := newService(t, cfg)
	require.NoError(t, svc.Start(context.Background()))
	return svc
}

// startErr starts a capture that must fail, returning its error.
func (e *env) startErr(t *testing.T, mod func(*Config)) error {
	t.Helper()
	cfg := e.config()
	if mod != nil {
		mod(&cfg)
	}
	svc := newService(t, cfg)
	err := svc.Start(context.Background())
	require.Error(t, err)
	require.NotContains(t, err.Error(), "\n", "errors are one line")
	return err
}

func (e *env) exec(t *testing.T, sql string, args ...any) { testenv.Exec(t, e.db, sql, args...) }

// msg is one stored message.
type msg struct {
	seq     uint64
	subject string
	msgID   string
	pos     string
	ev      *event.Event
}

// messages waits until the stream holds at least n messages of source src
// and returns all of them, in stream order.
func (e *env) messages(t *testing.T, src string, n int) []msg {
	t.Helper()
	ctx := context.Background()
	deadline := time.Now().Add(60 * time.Second)
	var last uint64
	for {
		st, err := e.js.Stream(ctx, event.StreamName(src))
		if err == nil {
			info, err := st.Info(ctx)
			require.NoError(t, err)
			if info.State.Msgs >= uint64(n) {
				last = info.State.LastSeq
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("stream has %d messages, want %d", info.State.Msgs, n)
			}
		} else if time.Now().After(deadline) {
			t.Fatalf("stream %s: %v", event.StreamName(src), err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	st, err := e.js.Stream(ctx, event.StreamName(src))
	require.NoError(t, err)
	var out []msg
	for _, m := range storedMsgs(t, st, 1, last) {
		ev, err := event.Decode(m.Data)
		require.NoError(t, err, "message %d: %s", m.Sequence, m.Data)
		require.Equal(t, "1", m.Header.Get(event.HeaderVersion))
		out = append(out, msg{seq: m.Sequence, subject: m.Subject, msgID: m.Header.Get(event.HeaderMsgID), pos: m.Header.Get(HeaderPosition), ev: ev})
	}
	return out
}

// storedMsgs reads the stream's messages first..last in order, through an
// ordered consumer (one request per message took most of a 40,000-row
// test's time on a loaded machine).
func storedMsgs(t *testing.T, st jetstream.Stream, first, last uint64) []*jetstream.RawStreamMsg {
	t.Helper()
	if first == 0 || last < first {
		return nil
	}
	ctx := context.Background()
	c, err := st.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{
		DeliverPolicy: jetstream.DeliverByStartSequencePolicy,
		OptStartSeq:   first,
	})
	require.NoError(t, err)
	var out []*jetstream.RawStreamMsg
	next := first
	for next <= last {
		fctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		batch, err := c.Fetch(1000, jetstream.FetchContext(fctx))
		require.NoError(t, err)
		got := 0
		for m := range batch.Messages() {
			got++
			md, err := m.Metadata()
			require.NoError(t, err)
			if md.Sequence.Stream > last {
				next = last + 1
				continue
			}
			out = append(out, &jetstream.RawStreamMsg{Subject: m.Subject(), Sequence: md.Sequence.Stream,
				Header: m.Headers(), Data: m.Data(), Time: md.Timestamp})
			next = md.Sequence.Stream + 1
			if next > last {
				break // a batch that is not full waits out its expiry
			}
		}
		err = batch.Error()
		cancel()
		if got == 0 {
			// Nothing more to read: the rest of first..last is not stored
			// (deleted messages); a failed fetch says why.
			require.NoError(t, err)
			break
		}
	}
	return out
}

// waitRows polls until the stream holds n delete events of source src
// and returns them.
func (e *env) deletes(t *testing.T, src string, n int) []msg {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		all := e.messages(t, src, 0)
		var out []msg
		for _, m := range all {
			if m.ev.Op == event.OpDelete {
				out = append(out, m)
			}
		}
		if len(out) >= n {
			return out
		}
		if time.Now().After(deadline) {
			t.Fatalf("stream has %d delete events, want %d", len(out), n)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func ops(ms []msg) []string {
	var out []string
	for _, m := range ms {
		s := string(m.ev.Op)
		if m.ev.Table != "" {
			s += " " + m.ev.QualifiedTable()
		}
		out = append(out, s)
	}
	return out
}

func queryString(t *testing.T, url, sql string, args ...any) string {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer conn.Close(ctx)
	var s string
	require.NoError(t, conn.QueryRow(ctx, sql, args...).Scan(&s))
	return s
}

func TestDeleteIsPublished(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE customers (id bigint PRIMARY KEY, name text);
		CREATE TABLE orders (id bigint PRIMARY KEY, customer_id bigint REFERENCES customers, total numeric(12,2));
		ALTER TABLE orders REPLICA IDENTITY FULL;
		ALTER TABLE customers REPLICA IDENTITY FULL;
		INSERT INTO customers VALUES (1, 'ann');
		INSERT INTO orders VALUES (42, 1, 12.50)`)
	svc := e.start(t, nil)
	e.exec(t, `DELETE FROM orders WHERE id = 42`)
	ms := e.messages(t, "main", 2)
	require.Equal(t, []string{"delete public.orders", "commit"}, ops(ms))
	d := ms[0].ev
	require.Equal(t, event.IdentityFull, d.Identity)
	require.JSONEq(t, `{"id":42}`, string(d.Key))
	require.JSONEq(t, `{"id":42,"customer_id":1,"total":"12.50"}`, string(d.Row))
	require.Equal(t, []event.Column{{Name: "id", Type: "bigint", PK: true}, {Name: "customer_id", Type: "bigint"}, {Name: "total", Type: "numeric(12,2)"}}, d.Columns)
	require.Equal(t, []event.Ref{{Columns: []string{"customer_id"}, Schema: "public", Table: "customers", RefColumns: []string{"id"}}}, d.Refs)
	require.Equal(t, event.MsgID("main", d.CommitLSN, 0), event.UntaggedMsgID(ms[0].msgID))
	require.Regexp(t, `^main/[0-9A-F]+/[0-9A-F]+/0/t[0-9a-f]{16}$`, ms[0].msgID, "a row's id carries the keyed tag")
	p := event.Partition(d.CommitLSN, 4)
	require.Equal(t, event.DeleteSubject("main", p, "public", "orders"), ms[0].subject)
	c := ms[1].ev
	require.Equal(t, d.CommitLSN, c.CommitLSN)
	require.Equal(t, 1, c.Rows)
	require.Equal(t, map[string]int{"public.orders": 1}, c.Tables)
	require.Equal(t, event.CommitSubject("main", p), ms[1].subject)
	require.Equal(t, fmt.Sprintf("%s#1", d.CommitLSN), ms[1].pos)

	// The slot is confirmed past the transaction once it is acknowledged.
	require.Eventually(t, func() bool {
		l, err := event.ParseLSN(queryString(t, e.db, `SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1`, e.slot))
		return err == nil && l > d.CommitLSN
	}, 30*time.Second, 50*time.Millisecond)
	st := svc.CurrentStatus()
	require.True(t, st.Active)
	require.Equal(t, []string{"public.customers", "public.orders"}, st.PublicationTables)
	require.NoError(t, svc.Stop(context.Background()))
	require.NoError(t, svc.Wait())
	_ = json.Valid
}

func queryRow(t *testing.T, url, sql string, args []any, dest ...any) error {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer conn.Close(ctx)
	return conn.QueryRow(ctx, sql, args...).Scan(dest...)
}
