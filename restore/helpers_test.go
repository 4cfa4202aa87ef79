package restore_test

import (
	"context"
	"log/slog"
	"net/url"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/capture"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/projection"
)

func TestMain(m *testing.M) { testenv.MainNoLeaks(m) }

// env is a live pipeline: a source database, the real capture, an
// in-process JetStream server, the real projector and its target (a
// separate database, as recommended).
type env struct {
	t      *testing.T
	src    string
	target *pgxpool.Pool
	source *pgx.Conn
}

func testLogger(t *testing.T) *slog.Logger {
	if os.Getenv("EPITAPH_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug})).With("test", t.Name())
	}
	return slog.New(slog.DiscardHandler)
}

// setup creates the source schema, then starts the capture and a
// projector (with snapshots of roots).
func setup(t *testing.T, schema string, roots ...string) *env {
	t.Helper()
	ctx := context.Background()
	e := &env{t: t, src: testenv.NewDatabase(t)}
	testenv.Exec(t, e.src, schema)
	u, err := url.Parse(e.src)
	require.NoError(t, err)
	n := testenv.NewNATS(t)
	capSvc, err := capture.New(capture.Config{
		SourceURL: e.src, NATSURL: n.URL, DataDir: t.TempDir(), SourceName: "main", Partitions: 2,
		SlotName: strings.TrimPrefix(u.Path, "/"), PublicationName: "restore", HeartbeatInterval: 200 * time.Millisecond,
		BrokerSyncInterval: -1,
	}, capture.WithLogger(testLogger(t)), capture.WithRegistry(prometheus.NewRegistry()))
	require.NoError(t, err)
	require.NoError(t, capSvc.Start(ctx))
	t.Cleanup(func() { require.NoError(t, capSvc.Stop(context.Background())) })

	targetURL := testenv.NewDatabase(t)
	proj, err := projection.New(projection.Config{
		TargetURL: testenv.NoSearchPath(targetURL), NATSURL: n.URL, SourceName: "main", WorkerID: "w1",
		LeaseTTL: 3 * time.Second, FetchWait: 100 * time.Millisecond, StatusInterval: 300 * time.Millisecond,
		MaxBackoff: time.Second, SnapshotRoots: roots,
	}, projection.WithLogger(testLogger(t)), projection.WithRegistry(prometheus.NewRegistry()))
	require.NoError(t, err)
	require.NoError(t, proj.Start(ctx))
	t.Cleanup(func() { require.NoError(t, proj.Stop(context.Background())) })

	e.target, err = pgxpool.New(ctx, targetURL)
	require.NoError(t, err)
	t.Cleanup(e.target.Close)
	e.source, err = pgx.Connect(ctx, testenv.NoSearchPath(e.src))
	require.NoError(t, err)
	t.Cleanup(func() { _ = e.source.Close(context.Background()) })
	return e
}

// exec runs SQL in the source.
func (e *env) exec(sql string, args ...any) { testenv.Exec(e.t, e.src, sql, args...) }

// deleteArchived runs sql (deletes) in one source transaction and waits
// until the archive holds want rows of it; it returns its correlation id.
func (e *env) deleteArchived(sql string, want int) string {
	e.t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, e.src)
	require.NoError(e.t, err)
	defer conn.Close(ctx)
	tx, err := conn.Begin(ctx)
	require.NoError(e.t, err)
	var xid int64
	require.NoError(e.t, tx.QueryRow(ctx, `SELECT txid_current()`).Scan(&xid))
	_, err = tx.Exec(ctx, sql)
	require.NoError(e.t, err)
	require.NoError(e.t, tx.Commit(ctx))
	var corr string
	require.Eventually(e.t, func() bool {
		var n int
		err := e.target.QueryRow(ctx, `SELECT count(*), COALESCE(min(correlation_id), '') FROM archive.rows WHERE xid = $1`, xid).Scan(&n, &corr)
		return err == nil && n == want
	}, 120*time.Second, 50*time.Millisecond, "%d rows of xid %d archived", want, xid)
	return corr
}

// texts returns row::text of every row of a query over the source.
func (e *env) texts(sql string, args ...any) []string {
	e.t.Helper()
	rows, err := e.source.Query(context.Background(), sql, args...)
	require.NoError(e.t, err)
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(e.t, err)
	return out
}

func (e *env) count(sql string, args ...any) int {
	e.t.Helper()
	var n int
	require.NoError(e.t, e.target.QueryRow(context.Background(), sql, args...).Scan(&n))
	return n
}
