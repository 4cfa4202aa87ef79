package capture

import (
	"context"
	"io"
	"log/slog"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/internal/workload"
)

const endedOwnWalsender = `msg="ended this capture's own stale walsender"`

// TestCaptureEndsItsOwnStaleWalsender: the capture reaches the source
// through a proxy, with --source-tcp-timeout 3s, under a deleting
// workload, and the source has wal_sender_timeout 5min; its
// application_name is longer than the 63 bytes PostgreSQL keeps. Every path
// through the proxy dies silently. The capture notices, reconnects, finds
// the slot still held by its lost session's walsender (its own backend,
// with its application_name), ends it with pg_terminate_backend, says so
// once, and streams again within 15 s of noticing instead of after
// wal_sender_timeout. The old walsender is gone, and the stream holds
// every row the workload deleted exactly once, row by row and value by
// value, although the slot's confirmed position lags what was published
// (the lost session's last status updates never arrived).
func TestCaptureEndsItsOwnStaleWalsender(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("TCP_USER_TIMEOUT and the proxy's socket filters are Linux's")
	}
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	_, e := walSenderTimeoutEnv(t, "5min")
	require.Equal(t, "5min", queryString(t, e.db, `SHOW wal_sender_timeout`))
	seedWorkload(t, ctx, e)

	proxy, viaProxy := testenv.ProxiedURL(t, e.db)
	const tcpTimeout = 3 * time.Second
	var logs lockedBuffer
	cfg := e.config()
	cfg.SourceURL = viaProxy
	cfg.SourceTCPTimeout = tcpTimeout
	cfg.Tables = workload.Tables
	// Longer than the 63 bytes PostgreSQL keeps (a long host name).
	cfg.ApplicationName = "epitaph-capture:" + strings.Repeat("long-host-name.", 4) + e.slot + "-1"
	svc, err := New(cfg, WithLogger(slog.New(slog.NewTextHandler(io.MultiWriter(&logs, testLogWriter{t}), nil))))
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, svc.Stop(context.Background())) })
	require.NoError(t, svc.Start(ctx))
	walsender := e.walsenderPID(t, 0, 10*time.Second)
	require.True(t, proxy.Live(e.clientPort(t, walsender)), "the replication connection does not go through the proxy")
	require.Equal(t, cfg.ApplicationName[:63], queryString(t, e.db, `SELECT application_name FROM pg_stat_activity WHERE pid = $1`, walsender))

	runCtx, stopRun := context.WithCancel(ctx)
	defer stopRun()
	ran := runWorkload(runCtx, e.db, workload.Plan{Seed: 7, MaxOrdersPerTx: 4, Reinserts: 3, Pause: 20 * time.Millisecond})
	progress := streamProgress(t, e)
	progress("before the paths die")

	killed := proxy.BlackholeAllBut(t, 0)
	died := time.Now()
	require.GreaterOrEqual(t, killed, 1, "the replication connection at least")
	bound := statusInterval + 2*tcpTimeout + 2*time.Second
	for metricValue(t, svc.m.connected.WithLabelValues(linkSource)) != 0 {
		require.Less(t, time.Since(died), bound, "the source is still reported connected %s after every path to it died", bound)
		time.Sleep(5 * time.Millisecond)
	}
	noticed := time.Now()
	t.Logf("source reported lost %s after its paths died", noticed.Sub(died).Round(time.Millisecond))

	const againBound = 15 * time.Second
	for !svc.activeState.Load() || svc.links.ready() != nil {
		select {
		case <-svc.ss.Done():
			t.Fatalf("the capture stopped on an outage: %v", svc.Wait())
		default:
		}
		require.Less(t, time.Since(noticed), againBound, "not streaming again %s after the source was reported lost (wal_sender_timeout is 5min)", againBound)
		time.Sleep(10 * time.Millisecond)
	}
	t.Logf("streaming again %s after the source was reported lost", time.Since(noticed).Round(time.Millisecond))
	require.Equal(t, "0", queryString(t, e.db, `SELECT count(*)::text FROM pg_stat_activity WHERE pid = $1`, walsender),
		"the stale walsender is gone")
	again := e.walsenderPID(t, walsender, 10*time.Second)
	require.True(t, proxy.Live(e.clientPort(t, again)), "the new replication connection does not go through the proxy")
	require.Equal(t, 1, strings.Count(logs.String(), endedOwnWalsender), "logged once")
	require.Contains(t, logs.String(), endedOwnWalsender+" slot="+e.slot+" walsender_pid="+strconv.Itoa(walsender))
	require.NotContains(t, logs.String(), "cannot end this capture's own stale walsender")
	progress("after the reconnect")

	stopRun()
	out := <-ran
	require.NoError(t, out.err)
	t.Logf("workload: %d transactions, %d rows deleted, %d reinserts", out.res.Transactions, out.res.Deleted, out.res.Reinserted)
	requireWorkloadStream(t, ctx, e, out.res)
}

// TestStoredAppName: application_name is compared as PostgreSQL keeps
// it, its first 63 bytes, never cutting a character.
func TestStoredAppName(t *testing.T) {
	t.Parallel()
	short := "epitaph-capture:host-42"
	require.Equal(t, short, storedAppName(short))
	long := strings.Repeat("h", 70)
	require.Equal(t, long[:63], storedAppName(long))
	require.Equal(t, strings.Repeat("h", 63), storedAppName(strings.Repeat("h", 63)))
	// "é" is two bytes: at bytes 62-63 it is dropped whole.
	cut := strings.Repeat("h", 62) + "é" + "x"
	require.Equal(t, strings.Repeat("h", 62), storedAppName(cut))
}

// TestCaptureLeavesAForeignWalsender: after the capture's session is
// lost, another client streams the slot: a pg_recvlogical-like one with
// its own application_name, or one with the capture's very
// application_name (another process configured with the same name). The
// capture's new session waits for the slot as before and never ends that
// session; once the client lets go, the capture streams again and the
// stream holds every deleted row once.
func TestCaptureLeavesAForeignWalsender(t *testing.T) {
	t.Parallel()
	for _, name := range []string{"pg_recvlogical", ""} {
		what := name
		if what == "" {
			what = "the capture's application_name"
		}
		t.Run(what, func(t *testing.T) {
			t.Parallel()
			leavesAForeignWalsender(t, name)
		})
	}
}

// leavesAForeignWalsender is TestCaptureLeavesAForeignWalsender with a
// client named appName ("": the capture's application_name).
func leavesAForeignWalsender(t *testing.T, appName string) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	e := setup(t)
	e.exec(t, `CREATE TABLE items (id int PRIMARY KEY, v text); ALTER TABLE items REPLICA IDENTITY FULL;
		INSERT INTO items SELECT i, 'v' || i FROM generate_series(1, 30) i`)
	var logs lockedBuffer
	cfg := e.config()
	svc, err := New(cfg, WithLogger(slog.New(slog.NewTextHandler(io.MultiWriter(&logs, testLogWriter{t}), nil))))
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, svc.Stop(context.Background())) })
	require.NoError(t, svc.Start(ctx))
	e.exec(t, `DELETE FROM items WHERE id <= 10`)
	e.deletes(t, "main", 10)
	walsender := e.walsenderPID(t, 0, 10*time.Second)

	// The broker away keeps the capture from starting its next session
	// while the foreign client takes the slot.
	e.nats.Stop()
	testenv.Exec(t, e.db, `SELECT pg_terminate_backend($1)`, walsender)
	require.Eventually(t, func() bool {
		return queryString(t, e.db, `SELECT coalesce(max(active_pid), 0)::text FROM pg_replication_slots WHERE slot_name = $1`, e.slot) == "0"
	}, 10*time.Second, 10*time.Millisecond, "the capture's walsender let go of the slot")
	rcfg, err := pgconn.ParseConfig(e.db)
	require.NoError(t, err)
	rcfg.RuntimeParams["replication"] = "database"
	if appName == "" {
		appName = svc.cfg.ApplicationName
	}
	rcfg.RuntimeParams["application_name"] = appName
	foreign, err := pgconn.ConnectConfig(ctx, rcfg)
	require.NoError(t, err)
	defer func() { _ = foreign.Close(context.Background()) }()
	require.NoError(t, pglogrepl.StartReplication(ctx, foreign, e.slot, 0, pglogrepl.StartReplicationOptions{
		Mode:       pglogrepl.LogicalReplication,
		PluginArgs: []string{"proto_version '1'", "publication_names '" + e.slotPub() + "'"},
	}))
	fpid := strconv.Itoa(int(foreign.PID()))
	require.Equal(t, fpid, queryString(t, e.db, `SELECT active_pid::text FROM pg_replication_slots WHERE slot_name = $1`, e.slot))
	e.exec(t, `DELETE FROM items WHERE id > 10 AND id <= 20`)
	e.nats.Start()

	// The capture's next session connects and waits for the slot.
	require.Eventually(t, func() bool {
		return queryString(t, e.db, `SELECT count(*)::text FROM pg_stat_activity WHERE datname = current_database()
			AND backend_type = 'walsender' AND application_name = $1 AND pid NOT IN ($2, $3)`, svc.cfg.ApplicationName, walsender, foreign.PID()) == "1"
	}, 30*time.Second, 20*time.Millisecond, "the capture's next session connects")
	time.Sleep(5 * time.Second)
	require.Equal(t, fpid, queryString(t, e.db, `SELECT coalesce(max(active_pid), 0)::text FROM pg_replication_slots WHERE slot_name = $1`, e.slot),
		"the foreign client still streams the slot")
	require.Equal(t, "1", queryString(t, e.db, `SELECT count(*)::text FROM pg_stat_activity WHERE pid = $1`, foreign.PID()))
	require.False(t, svc.activeState.Load(), "the capture waits for the slot")
	require.NotContains(t, logs.String(), "own stale walsender")

	require.NoError(t, foreign.Close(ctx))
	requireStreamsAgain(t, svc)
	e.exec(t, `DELETE FROM items WHERE id > 20`)
	e.deletes(t, "main", 30)
	time.Sleep(time.Second) // a row stored twice would be there by now
	requireEachDeleteOnce(t, e, 30)
	require.NotContains(t, logs.String(), "own stale walsender")
}

// TestCaptureWaitsForItsStaleWalsenderWhenRefused: a capture role that
// may not run pg_terminate_backend (revoked from PUBLIC) cannot end its
// lost session's walsender. It says so once, naming wal_sender_timeout,
// waits for the source to end it (30 s here) as before, and streams on
// with every deleted row once.
func TestCaptureWaitsForItsStaleWalsenderWhenRefused(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("TCP_USER_TIMEOUT and the proxy's socket filters are Linux's")
	}
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	pg, e := walSenderTimeoutEnv(t, "30s")
	capRole := e.slot + "_capture"
	e.exec(t, `CREATE ROLE `+capRole+` LOGIN REPLICATION;
		GRANT CREATE ON DATABASE `+e.slot+` TO `+capRole+`;
		GRANT CREATE ON SCHEMA public TO `+capRole+`;
		REVOKE EXECUTE ON FUNCTION pg_terminate_backend FROM PUBLIC`)
	capURL := pg.UserURL(capRole, e.slot)
	testenv.Exec(t, capURL, `CREATE TABLE items (id int PRIMARY KEY, v text); ALTER TABLE items REPLICA IDENTITY FULL;
		INSERT INTO items SELECT i, 'v' || i FROM generate_series(1, 30) i`)

	proxy, viaProxy := testenv.ProxiedURL(t, capURL)
	var logs lockedBuffer
	cfg := e.config()
	cfg.SourceURL = viaProxy
	cfg.SourceTCPTimeout = 3 * time.Second
	cfg.HeartbeatInterval = time.Second // the replication connection sends soon
	svc, err := New(cfg, WithLogger(slog.New(slog.NewTextHandler(io.MultiWriter(&logs, testLogWriter{t}), nil))))
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, svc.Stop(context.Background())) })
	require.NoError(t, svc.Start(ctx))
	e.exec(t, `DELETE FROM items WHERE id <= 10`)
	e.deletes(t, "main", 10)
	walsender := e.walsenderPID(t, 0, 10*time.Second)

	require.GreaterOrEqual(t, proxy.BlackholeAllBut(t, 0), 1)
	e.exec(t, `DELETE FROM items WHERE id > 10 AND id <= 20`)
	require.Eventually(t, func() bool { return metricValue(t, svc.m.connected.WithLabelValues(linkSource)) == 0 },
		statusInterval+10*time.Second, 10*time.Millisecond, "the source reported lost")
	requireStreamsAgain(t, svc)
	require.Equal(t, "0", queryString(t, e.db, `SELECT count(*)::text FROM pg_stat_activity WHERE pid = $1`, walsender))
	e.exec(t, `DELETE FROM items WHERE id > 20`)
	e.deletes(t, "main", 30)
	time.Sleep(time.Second) // a row stored twice would be there by now
	requireEachDeleteOnce(t, e, 30)
	const refused = `msg="cannot end this capture's own stale walsender: the source keeps it until wal_sender_timeout ends it, and the new session waits for that"`
	require.Equal(t, 1, strings.Count(logs.String(), refused), "said once")
	require.Contains(t, logs.String(), refused+" slot="+e.slot+" walsender_pid="+strconv.Itoa(walsender))
	require.NotContains(t, logs.String(), endedOwnWalsender)
}

// requireEachDeleteOnce checks that the stream holds n deleted rows, each
// once.
func requireEachDeleteOnce(t *testing.T, e *env, n int) {
	t.Helper()
	keys := map[string]int{}
	for _, m := range e.messages(t, "main", 0) {
		if m.ev.Op == event.OpDelete {
			keys[string(m.ev.Key)+string(m.ev.Row)]++
		}
	}
	require.Len(t, keys, n, "every deleted row")
	for k, c := range keys {
		require.Equal(t, 1, c, "row %s stored once", k)
	}
}

type workloadRun struct {
	res workload.Result
	err error
}

// walSenderTimeoutEnv is an env on a PostgreSQL of the test's own whose
// wal_sender_timeout is timeout (how long the source keeps a lost
// session's walsender).
func walSenderTimeoutEnv(t *testing.T, timeout string) (*testenv.Postgres, *env) {
	t.Helper()
	pg := testenv.NewPostgres(t)
	require.NoError(t, pg.SetConfig("wal_sender_timeout = "+timeout))
	require.NoError(t, pg.Restart())
	e := &env{db: pg.NewDatabase(t), nats: testenv.NewNATS(t), dir: t.TempDir()}
	e.slot = dbName(t, e.db)
	_, e.js = e.nats.Connect(t)
	return pg, e
}

// seedWorkload creates the workload's tables in e's database and seeds
// them.
func seedWorkload(t *testing.T, ctx context.Context, e *env) {
	t.Helper()
	require.NoError(t, workload.Setup(ctx, e.db))
	_, err := workload.Seed(ctx, e.db, workload.SeedConfig{Customers: 400, OrdersPerCustomer: 10})
	require.NoError(t, err)
}

// runWorkload runs plan on db until ctx ends.
func runWorkload(ctx context.Context, db string, plan workload.Plan) <-chan workloadRun {
	ran := make(chan workloadRun, 1)
	go func() {
		res, err := workload.Run(ctx, db, plan)
		ran <- workloadRun{res, err}
	}()
	return ran
}

// streamProgress returns a check that the capture's stream grows by more
// than 100 messages within a minute.
func streamProgress(t *testing.T, e *env) func(what string) {
	published := func() uint64 {
		st, err := e.js.Stream(t.Context(), event.StreamName("main"))
		if err != nil {
			return 0
		}
		info, err := st.Info(t.Context())
		if err != nil {
			return 0
		}
		return info.State.Msgs
	}
	return func(what string) {
		t.Helper()
		before := published()
		require.Eventually(t, func() bool { return published() > before+100 }, 60*time.Second, 20*time.Millisecond,
			"%s: the stream did not grow", what)
	}
}

// requireWorkloadStream checks that the stream holds every row the
// workload res deleted exactly once, row by row and value by value.
func requireWorkloadStream(t *testing.T, ctx context.Context, e *env, res workload.Result) {
	t.Helper()
	expected, err := workload.Expected(ctx, e.db)
	require.NoError(t, err)
	require.EqualValues(t, res.Deleted, len(expected))
	var events []*event.Event
	for deadline := time.Now().Add(2 * time.Minute); ; {
		events, err = workload.StreamDeletes(ctx, e.nats.URL, "main")
		require.NoError(t, err)
		if len(events) >= len(expected) || time.Now().After(deadline) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	rep, err := workload.VerifyStream(ctx, e.db, expected, events)
	require.NoError(t, err)
	require.True(t, rep.OK(), rep.String())
	require.Len(t, events, len(expected))
	t.Logf("stream: %s", rep.String())
}
