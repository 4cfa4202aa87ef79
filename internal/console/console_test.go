package console_test

import (
	"context"
	"encoding/json"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/capture"
	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/internal/console"
	"github.com/epitaph-dev/epitaph/internal/httptoken"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/internal/workload"
	"github.com/epitaph-dev/epitaph/projection"
	"github.com/epitaph-dev/epitaph/projection/status"
)

func TestMain(m *testing.M) { testenv.MainNoLeaks(m) }

const token = "console-test-token-0123456789"

func testLogger() *slog.Logger {
	if os.Getenv("EPITAPH_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.DiscardHandler)
}

// env is a live pipeline: the shop workload's source, the real capture,
// JetStream, the real projector with the handler dispatcher, its target,
// and the console (with a token) on an httptest server.
type env struct {
	t       *testing.T
	src     string
	target  *pgxpool.Pool
	source  *pgx.Conn
	console *httptest.Server
}

func setup(t *testing.T) *env {
	t.Helper()
	ctx := context.Background()
	e := &env{t: t, src: testenv.NewDatabase(t)}
	require.NoError(t, workload.Setup(ctx, e.src))
	testenv.Exec(t, e.src, `CREATE TABLE public.notes (id bigint PRIMARY KEY, body text NOT NULL)`)
	_, err := workload.Seed(ctx, e.src, workload.SeedConfig{Customers: 30, OrdersPerCustomer: 2, LinesPerOrder: 2})
	require.NoError(t, err)
	u, err := url.Parse(e.src)
	require.NoError(t, err)
	n := testenv.NewNATS(t)
	capSvc, err := capture.New(capture.Config{
		SourceURL: e.src, NATSURL: n.URL, DataDir: t.TempDir(), SourceName: "main", Partitions: 2,
		SlotName: strings.TrimPrefix(u.Path, "/"), PublicationName: "console", HeartbeatInterval: 200 * time.Millisecond,
		BrokerSyncInterval: -1,
	}, capture.WithLogger(testLogger()), capture.WithRegistry(prometheus.NewRegistry()))
	require.NoError(t, err)
	require.NoError(t, capSvc.Start(ctx))
	t.Cleanup(func() { require.NoError(t, capSvc.Stop(context.Background())) })

	targetURL := testenv.NewDatabase(t)
	proj, err := projection.New(projection.Config{
		TargetURL: testenv.NoSearchPath(targetURL), NATSURL: n.URL, SourceName: "main", WorkerID: "w1",
		LeaseTTL: 3 * time.Second, FetchWait: 100 * time.Millisecond, StatusInterval: 300 * time.Millisecond,
		MaxBackoff: time.Second, SnapshotRoots: []string{"public.customers"},
	}, projection.WithLogger(testLogger()), projection.WithRegistry(prometheus.NewRegistry()))
	require.NoError(t, err)
	require.NoError(t, proj.Start(ctx))
	t.Cleanup(func() { require.NoError(t, proj.Stop(context.Background())) })
	disp, err := handler.NewDispatcher(proj.Pool(), handler.Config{Poll: 100 * time.Millisecond, Logger: testLogger()})
	require.NoError(t, err)
	require.NoError(t, disp.Start(ctx))
	t.Cleanup(func() { require.NoError(t, disp.Stop(context.Background())) })

	e.target, err = pgxpool.New(ctx, targetURL)
	require.NoError(t, err)
	t.Cleanup(e.target.Close)
	e.source, err = pgx.Connect(ctx, testenv.NoSearchPath(e.src))
	require.NoError(t, err)
	t.Cleanup(func() { _ = e.source.Close(context.Background()) })

	file := filepath.Join(t.TempDir(), "token")
	require.NoError(t, os.WriteFile(file, []byte(token+"\n"), 0o600))
	tok, err := httptoken.Load(file)
	require.NoError(t, err)
	mux := http.NewServeMux()
	console.Register(mux, console.Config{DB: e.target, Token: tok, Source: "main", SourceURL: testenv.NoSearchPath(e.src), Logger: testLogger()})
	e.console = httptest.NewServer(mux)
	t.Cleanup(e.console.Close)
	return e
}

// caughtUp waits until the archive is complete up to the source's
// current WAL position.
func (e *env) caughtUp() {
	e.t.Helper()
	var s string
	require.NoError(e.t, e.source.QueryRow(context.Background(), `SELECT pg_current_wal_lsn()::text`).Scan(&s))
	lsn, err := event.ParseLSN(s)
	require.NoError(e.t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	_, err = status.WaitComplete(ctx, e.target, "archive", lsn, 0)
	require.NoError(e.t, err, "the archive catches up with the source")
}

// texts maps id to row::text of a source query (id, row::text).
func (e *env) texts(sql string, args ...any) map[int64]string {
	e.t.Helper()
	rows, err := e.source.Query(context.Background(), sql, args...)
	require.NoError(e.t, err)
	out := map[int64]string{}
	for rows.Next() {
		var id int64
		var text string
		require.NoError(e.t, rows.Scan(&id, &text))
		out[id] = text
	}
	require.NoError(e.t, rows.Err())
	return out
}

func (e *env) count(sql string, args ...any) int {
	e.t.Helper()
	var n int
	require.NoError(e.t, e.target.QueryRow(context.Background(), sql, args...).Scan(&n))
	return n
}

// receiver is a webhook that fails while failing is set, and records the
// keys it accepted.
type receiver struct {
	failing  atomic.Bool
	mu       sync.Mutex
	accepted map[string]int
	failed   atomic.Int64
}

func (r *receiver) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	if r.failing.Load() {
		r.failed.Add(1)
		http.Error(w, "receiver down for the test", http.StatusInternalServerError)
		return
	}
	var body struct {
		Key json.RawMessage `json:"key"`
	}
	_ = json.NewDecoder(req.Body).Decode(&body)
	r.mu.Lock()
	r.accepted[string(body.Key)]++
	r.mu.Unlock()
}

func (r *receiver) keys() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.accepted)
}
