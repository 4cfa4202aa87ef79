package capture

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/broker"
	"github.com/epitaph-dev/epitaph/internal/natsconn"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/internal/workload"
)

// TestOutageClassification: transient losses of the source or the broker
// are told apart from what a restart cannot fix by type and SQLSTATE.
func TestOutageClassification(t *testing.T) {
	t.Parallel()
	pgErr := func(code string) error {
		return &pgconn.PgError{Severity: "FATAL", Code: code, Message: "message " + code}
	}
	for _, c := range []struct {
		name string
		err  error
		to   string // "": not an outage
	}{
		{"admin shutdown", pgErr("57P01"), linkSource},
		{"crash shutdown", pgErr("57P02"), linkSource},
		{"starting up", pgErr("57P03"), linkSource},
		{"connection failure", pgErr("08006"), linkSource},
		{"too many connections", pgErr("53300"), linkSource},
		{"wrapped shutdown", errors.Join(errors.New("read slot"), pgErr("57P01")), linkSource},
		{"server ended replication", &serverEndedError{slot: "s"}, linkSource},
		{"slot still held by the previous walsender", &slotBusyError{slot: "s", pid: 7}, linkSource},
		{"connection closed", pgconn.ErrConnClosed, linkSource},
		{"connection refused", &pgconn.ConnectError{}, linkSource},
		{"NATS disconnected", nats.ErrDisconnected, linkBroker},
		{"NATS reconnecting", nats.ErrConnectionReconnecting, linkBroker},
		{"NATS buffer", nats.ErrReconnectBufExceeded, linkBroker},
		{"no responders", nats.ErrNoResponders, linkBroker},
		{"ack timeout", jetstream.ErrAsyncPublishTimeout, linkBroker},
		{"JetStream unavailable", &jetstream.APIError{Code: 503, ErrorCode: 10008}, linkBroker},
		{"stream refused to store", &jetstream.APIError{Code: 503, ErrorCode: 10077, Description: "maximum messages per subject exceeded"}, ""},
		{"broker down", errBrokerDown, linkBroker},
		{"request timeout", context.DeadlineExceeded, linkBroker},
		{"wrong password", pgErr("28P01"), ""},
		{"no login", pgErr("28000"), ""},
		{"no privilege", pgErr("42501"), ""},
		{"no database", pgErr("3D000"), ""},
		{"slot in use", pgErr("55006"), ""},
		{"connection reset", &net.OpError{Op: "read", Err: syscall.ECONNRESET}, linkSource},
		{"publish's connection reset", fmt.Errorf("publish delete x to y: %w", brokerIO(&net.OpError{Op: "write", Err: syscall.ECONNRESET})), linkBroker},
		{"publish refused, not marked", brokerIO(&jetstream.APIError{Code: 400, ErrorCode: 10077}), ""},
		{"config", configErr("replication slot %q is missing", "s"), ""},
		{"config wrapping a shutdown", &LeaseLostError{Err: pgErr("57P01")}, ""},
		{"limits", &LimitsError{Err: errors.New("x")}, ""},
		{"stream refused a message", &jetstream.APIError{Code: 400, ErrorCode: 10077}, ""},
		{"a bug", errors.New("change for relation 7 before its Relation message"), ""},
	} {
		to, ok := outage(c.err)
		require.Equal(t, c.to != "", ok, c.name)
		if ok {
			require.Equal(t, c.to, to, c.name)
		}
	}
	require.Nil(t, sourceLoginErr("postgres://u:secret@h/db", pgErr("57P01")))
	err := sourceLoginErr("postgres://u:secret@h/db", pgErr("28P01"))
	var ce *ConfigError
	require.ErrorAs(t, err, &ce)
	require.Contains(t, err.Error(), "a restart will not fix this")
	require.NotContains(t, err.Error(), "secret")
}

// probes samples a capture process's /livez and /readyz until stopped.
type probes struct {
	p    *capProc
	mu   sync.Mutex
	n    int
	dead int // /livez not 200
	// unready counts /readyz 503 answers since the last reset.
	unready int
	stop    context.CancelFunc
	done    chan struct{}
}

func sampleProbes(p *capProc) *probes {
	ctx, cancel := context.WithCancel(context.Background())
	pr := &probes{p: p, stop: cancel, done: make(chan struct{})}
	c := http.Client{Timeout: 2 * time.Second}
	code := func(path string) int {
		resp, err := c.Get(p.url(path))
		if err != nil {
			return 0
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	go func() {
		defer close(pr.done)
		for ctx.Err() == nil {
			live, ready := code("/livez"), code("/readyz")
			pr.mu.Lock()
			pr.n++
			if live != http.StatusOK {
				pr.dead++
			}
			if ready == http.StatusServiceUnavailable {
				pr.unready++
			}
			pr.mu.Unlock()
			time.Sleep(20 * time.Millisecond)
		}
	}()
	return pr
}

// takeUnready returns the /readyz 503 answers since the last call.
func (pr *probes) takeUnready() int {
	pr.mu.Lock()
	defer pr.mu.Unlock()
	n := pr.unready
	pr.unready = 0
	return n
}

func (pr *probes) end() (samples, dead int) {
	pr.stop()
	<-pr.done
	pr.mu.Lock()
	defer pr.mu.Unlock()
	return pr.n, pr.dead
}

// metric scrapes one sample of the capture's /metrics, named with its
// labels (`epitaph_capture_connected{to="source"}`).
func (p *capProc) metric(series string) (float64, bool) {
	c := http.Client{Timeout: 2 * time.Second}
	resp, err := c.Get(p.url("/metrics"))
	if err != nil {
		return 0, false
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if v, found := strings.CutPrefix(sc.Text(), series+" "); found {
			f, err := strconv.ParseFloat(v, 64)
			return f, err == nil
		}
	}
	return 0, false
}

// streamingAgain waits until the process streams with both links up and
// /readyz answers 200.
func streamingAgain(t *testing.T, p *capProc, timeout time.Duration, what string) {
	t.Helper()
	require.Eventually(t, func() bool {
		a, ok1 := p.metric("epitaph_capture_active")
		src, ok2 := p.metric(`epitaph_capture_connected{to="source"}`)
		brk, ok3 := p.metric(`epitaph_capture_connected{to="broker"}`)
		code, _ := httpGetCode(p.url("/readyz"))
		return ok1 && ok2 && ok3 && a == 1 && src == 1 && brk == 1 && code == http.StatusOK
	}, timeout, 50*time.Millisecond, "%s: the capture did not stream again within %s", what, timeout)
}

func httpGetCode(url string) (int, error) {
	c := http.Client{Timeout: 2 * time.Second}
	resp, err := c.Get(url)
	if err != nil {
		return 0, err
	}
	resp.Body.Close()
	return resp.StatusCode, nil
}

// TestCaptureProcessRidesOutOutages runs the capture binary against an
// external JetStream server under a deleting workload, and restarts the
// source PostgreSQL (pg_ctl restart -m fast, then -m immediate) and the
// JetStream server (shut down, started again on the same port and store).
// The process never exits: /livez answers 200 throughout, /readyz 503
// while a link is down and 200 once it streams again,
// epitaph_capture_connected says which link is down, each loss and return
// is one log line, and at the end the stream holds every deleted row
// exactly once, row by row and value by value.
func TestCaptureProcessRidesOutOutages(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs a capture process, restarts PostgreSQL and JetStream")
	}
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	pg := testenv.NewPostgres(t)
	db := pg.NewDatabase(t)
	js := testenv.NewNATS(t)
	require.NoError(t, workload.Setup(ctx, db))
	_, err := workload.Seed(ctx, db, workload.SeedConfig{Customers: 150, OrdersPerCustomer: 10})
	require.NoError(t, err)

	p := startCapProc(t, "capture-outages", buildCapture(t), map[string]string{
		"EPITAPH_SOURCE_URL":         db,
		"EPITAPH_NATS_URL":           js.URL,
		"EPITAPH_SLOT":               dbName(t, db),
		"EPITAPH_PUBLICATION":        dbName(t, db),
		"EPITAPH_TABLES":             strings.Join(workload.Tables, ","),
		"EPITAPH_PARTITIONS":         "4",
		"EPITAPH_HEARTBEAT_INTERVAL": "1s",
		// A fast shutdown of PostgreSQL waits until the capture confirmed
		// every WAL record sent to it; with the external server's default
		// trailing (2m) that would outlast pg_ctl's wait.
		"EPITAPH_BROKER_SYNC_INTERVAL": "2s",
	})
	streamingAgain(t, p, 60*time.Second, "start")
	pid := p.pid()
	pr := sampleProbes(p)

	type runOut struct {
		res workload.Result
		err error
	}
	runCtx, stopRun := context.WithCancel(ctx)
	ran := make(chan runOut, 1)
	go func() {
		res, err := workload.Run(runCtx, db, workload.Plan{Seed: 11, MaxOrdersPerTx: 6, BigTxRows: 1500, BigTxAt: 40, Reinserts: 4, Pause: 20 * time.Millisecond})
		ran <- runOut{res, err}
	}()

	nc, wjs := js.Connect(t)
	defer nc.Close()
	published := func() uint64 {
		st, err := wjs.Stream(ctx, event.StreamName("main"))
		if err != nil {
			return 0
		}
		info, err := st.Info(ctx)
		if err != nil {
			return 0
		}
		return info.State.Msgs
	}
	progress := func(what string) {
		t.Helper()
		before := published()
		require.Eventually(t, func() bool { return published() > before+200 }, 90*time.Second, 50*time.Millisecond,
			"%s: the stream did not grow", what)
		select {
		case out := <-ran:
			t.Fatalf("the workload ended before %s: %+v", what, out)
		default:
		}
	}

	for _, mode := range []string{"fast", "immediate"} {
		progress("restart -m " + mode)
		pr.takeUnready()
		losses := p.logCount("lost the connection to the source")
		at := time.Now()
		require.NoError(t, pg.RestartMode(mode))
		// The server can be back before the capture reads the end of its
		// connection: "streaming" then still describes the old session.
		require.Eventually(t, func() bool { return p.logCount("lost the connection to the source") > losses },
			90*time.Second, 20*time.Millisecond, "restart -m %s: the capture never noticed the loss", mode)
		streamingAgain(t, p, 90*time.Second, "restart -m "+mode)
		t.Logf("pg_ctl restart -m %s: streaming again after %s, %d messages in the stream", mode, time.Since(at).Round(time.Millisecond), published())
		require.Positive(t, pr.takeUnready(), "restart -m %s: /readyz was never 503", mode)
	}

	progress("the broker's restart")
	pr.takeUnready()
	at := time.Now()
	js.Stop()
	require.Eventually(t, func() bool {
		v, ok := p.metric(`epitaph_capture_connected{to="broker"}`)
		code, _ := httpGetCode(p.url("/readyz"))
		return ok && v == 0 && code == http.StatusServiceUnavailable
	}, 30*time.Second, 20*time.Millisecond, "the broker's loss shows on the gauge and /readyz")
	v, ok := p.metric(`epitaph_capture_connected{to="source"}`)
	require.True(t, ok)
	require.Equal(t, 1.0, v, "the source is still connected")
	js.Start()
	streamingAgain(t, p, 90*time.Second, "the broker's restart")
	t.Logf("broker restart: streaming again after %s", time.Since(at).Round(time.Millisecond))
	progress("the end")

	stopRun()
	out := <-ran
	require.NoError(t, out.err)
	t.Logf("workload: %d transactions, %d rows deleted, %d reinserts, %d retries", out.res.Transactions, out.res.Deleted, out.res.Reinserted, out.res.Retries)
	require.Greater(t, out.res.Deleted, int64(1500))

	expected, err := workload.Expected(ctx, db)
	require.NoError(t, err)
	require.EqualValues(t, out.res.Deleted, len(expected))
	var rep workload.Report
	var events []*event.Event
	deadline := time.Now().Add(2 * time.Minute)
	for {
		events, err = workload.StreamDeletes(ctx, js.URL, "main")
		require.NoError(t, err)
		if len(events) >= len(expected) || time.Now().After(deadline) {
			break
		}
		time.Sleep(500 * time.Millisecond)
	}
	rep, err = workload.VerifyStream(ctx, db, expected, events)
	require.NoError(t, err)
	require.True(t, rep.OK(), rep.String())
	require.Len(t, events, len(expected))
	t.Logf("stream: %s", rep.String())

	samples, dead := pr.end()
	require.Zero(t, dead, "/livez was not 200 in %d of %d samples", dead, samples)
	p.mu.Lock()
	self := p.selfExit
	p.mu.Unlock()
	require.Zero(t, self, "the capture process exited")
	require.Equal(t, pid, p.pid(), "one process throughout")

	logText, err := os.ReadFile(p.log)
	require.NoError(t, err)
	logs := string(logText)
	// One line per change of a link's state, never one per retry: losses
	// and returns alternate, each loss answered by a return. (A broker
	// restart can be two changes: the client reconnects, then the session
	// finds its in-flight publishes lost and restarts.)
	require.GreaterOrEqual(t, linkChanges(t, logs, "source"), 2, "a loss and a return per source restart")
	require.GreaterOrEqual(t, linkChanges(t, logs, "broker"), 1, "a loss and a return for the broker's restart")
	require.NotContains(t, logs, "capture stopped")
}

// linkChanges checks that the log's lines for link alternate "lost the
// connection to" and "reconnected to", starting with a loss and ending
// with a return, and returns the number of loss-return pairs.
func linkChanges(t *testing.T, logs, link string) int {
	t.Helper()
	lost, back := "lost the connection to the "+link, "reconnected to the "+link
	var seq []string
	for _, line := range strings.Split(logs, "\n") {
		switch {
		case strings.Contains(line, lost):
			seq = append(seq, "lost")
		case strings.Contains(line, back):
			seq = append(seq, "back")
		}
	}
	require.Zero(t, len(seq)%2, "%s: every loss has its return: %v", link, seq)
	for i, e := range seq {
		want := "lost"
		if i%2 == 1 {
			want = "back"
		}
		require.Equal(t, want, e, "%s: one line per change, not per retry: %v", link, seq)
	}
	return len(seq) / 2
}

// runCaptureOnce runs the capture binary with env until it exits by itself
// (failing the test past timeout) and returns its exit code and output.
func runCaptureOnce(t *testing.T, bin string, env map[string]string, timeout time.Duration) (int, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	ownDataDir(t, env)
	cmd := exec.CommandContext(ctx, bin)
	cmd.Env = captureEnv(env)
	out, err := cmd.CombinedOutput()
	require.NoError(t, ctx.Err(), "the capture did not exit within %s:\n%s", timeout, out)
	var ee *exec.ExitError
	if err != nil {
		require.ErrorAs(t, err, &ee)
		return ee.ExitCode(), string(out)
	}
	return 0, string(out)
}

// TestCaptureExitsOnAWrongPassword: a password the source refuses is not
// an outage. At start the capture exits non-zero at once with one line
// saying what to fix; and when the password changes while it streams, the
// capture, reconnecting after its connections were cut, exits the same
// way instead of retrying for ever.
func TestCaptureExitsOnAWrongPassword(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs a capture process")
	}
	t.Parallel()
	pg := testenv.NewPostgres(t)
	db := pg.NewDatabase(t)
	name := dbName(t, db)
	testenv.Exec(t, db, `CREATE ROLE epitaph_pw LOGIN REPLICATION SUPERUSER PASSWORD 'right-secret';
		CREATE TABLE items (id int PRIMARY KEY, pad text); ALTER TABLE items REPLICA IDENTITY FULL;
		INSERT INTO items SELECT i, 'row ' || i FROM generate_series(1, 100) i`)
	// Passwords are checked for this role only; everyone else is trusted.
	hba := pg.DataDir + "/pg_hba.conf"
	old, err := os.ReadFile(hba)
	require.NoError(t, err)
	rules := "host all epitaph_pw 127.0.0.1/32 scram-sha-256\nhost replication epitaph_pw 127.0.0.1/32 scram-sha-256\n"
	require.NoError(t, os.WriteFile(hba, append([]byte(rules), old...), 0o600))
	testenv.Exec(t, db, `SELECT pg_reload_conf()`)
	url := func(password string) string {
		return "postgres://epitaph_pw:" + password + "@" + pg.Host + ":" + strconv.Itoa(pg.Port) + "/" + name + "?sslmode=disable"
	}
	js := testenv.NewNATS(t)
	port, err := testenv.FreePort()
	require.NoError(t, err)
	capEnv := func(password string) map[string]string {
		return map[string]string{
			"EPITAPH_SOURCE_URL":   url(password),
			"EPITAPH_NATS_URL":     js.URL,
			"EPITAPH_SLOT":         name,
			"EPITAPH_PUBLICATION":  name,
			"EPITAPH_TABLES":       "items",
			"EPITAPH_PARTITIONS":   "2",
			"EPITAPH_SIGNING_KEY":  testSigningKey(t),
			"EPITAPH_METRICS_ADDR": "127.0.0.1:" + strconv.Itoa(port),
		}
	}
	bin := buildCapture(t)
	requireOneLine := func(out string) {
		t.Helper()
		var final []string
		for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
			if strings.HasPrefix(l, "capture: ") {
				final = append(final, l)
			}
		}
		require.Len(t, final, 1, "one line saying why:\n%s", out)
		require.Contains(t, final[0], "password authentication failed")
		require.Contains(t, final[0], "28P01")
		require.Contains(t, final[0], "a restart will not fix this")
		require.NotContains(t, out, "wrong-secret")
		require.NotContains(t, out, "reconnected")
	}

	start := time.Now()
	code, out := runCaptureOnce(t, bin, capEnv("wrong-secret"), 60*time.Second)
	t.Logf("wrong password at start: exit %d after %s:\n%s", code, time.Since(start).Round(time.Millisecond), out)
	require.NotZero(t, code)
	requireOneLine(out)
	require.NotContains(t, out, "lost the connection")

	// The right password: it streams; then the password changes and its
	// connections are cut.
	p := startCapProc(t, "capture-password", bin, capEnv("right-secret"))
	streamingAgain(t, p, 60*time.Second, "start")
	testenv.Exec(t, db, `DELETE FROM items WHERE id <= 10`)
	ms := (&env{js: mustJS(t, js)}).messages(t, "main", 11)
	require.Len(t, ms, 11)
	p.mu.Lock()
	cmd, exited := p.cmd, p.exited
	p.stopping = true // exits are expected now: no restart
	p.mu.Unlock()
	testenv.Exec(t, db, `ALTER ROLE epitaph_pw PASSWORD 'another-secret'`)
	testenv.Exec(t, db, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = 'epitaph_pw'`)
	select {
	case <-exited:
	case <-time.After(60 * time.Second):
		t.Fatal("the capture did not exit after its password changed")
	}
	require.NotZero(t, cmd.ProcessState.ExitCode())
	logText, err := os.ReadFile(p.log)
	require.NoError(t, err)
	out = string(logText)
	t.Logf("password changed while streaming:\n%s", out)
	require.Equal(t, 1, strings.Count(out, "lost the connection to the source"), "one line for the loss, none per retry")
	var final []string
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		if strings.HasPrefix(l, "capture: ") {
			final = append(final, l)
		}
	}
	require.Len(t, final, 1, "one line saying why")
	require.Contains(t, final[0], "28P01")
	require.Contains(t, final[0], "a restart will not fix this")
	require.NotContains(t, out, "right-secret")
	require.NotContains(t, out, "another-secret")
}

// mustJS connects to srv.
func mustJS(t *testing.T, srv *testenv.NATS) jetstream.JetStream {
	t.Helper()
	_, js := srv.Connect(t)
	return js
}

// TestEmbeddedBrokerServesThroughASourceOutage: with its embedded broker,
// the capture keeps the broker serving while the source is down, so a
// projector's connection to it never drops and it can read the stream;
// the deletes before and after the outage are each stored once.
func TestEmbeddedBrokerServesThroughASourceOutage(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs a capture process, stops PostgreSQL")
	}
	t.Parallel()
	ctx := context.Background()
	pg := testenv.NewPostgres(t)
	db := pg.NewDatabase(t)
	testenv.Exec(t, db, `CREATE TABLE items (id int PRIMARY KEY, pad text); ALTER TABLE items REPLICA IDENTITY FULL;
		INSERT INTO items SELECT i, 'row ' || i FROM generate_series(1, 400) i`)
	port, err := testenv.FreePort()
	require.NoError(t, err)
	listen := "127.0.0.1:" + strconv.Itoa(port)
	dataDir := t.TempDir()
	p := startCapProc(t, "capture-embedded-outage", buildCapture(t), map[string]string{
		"EPITAPH_SOURCE_URL":         db,
		"EPITAPH_DATA_DIR":           dataDir,
		"EPITAPH_NATS_LISTEN":        listen,
		"EPITAPH_SLOT":               dbName(t, db),
		"EPITAPH_PUBLICATION":        dbName(t, db),
		"EPITAPH_TABLES":             "items",
		"EPITAPH_PARTITIONS":         "2",
		"EPITAPH_HEARTBEAT_INTERVAL": "-1s",
	})
	streamingAgain(t, p, 60*time.Second, "start")
	pid := p.pid()
	testenv.Exec(t, db, `DELETE FROM items WHERE id <= 200`)

	// A projector's connection to the embedded broker.
	var disconnects int
	var mu sync.Mutex
	nc, err := nats.Connect("nats://"+listen, natsconn.UserCredentials(broker.ProjectorCreds(EmbeddedCredsDir(dataDir))),
		nats.DisconnectErrHandler(func(*nats.Conn, error) { mu.Lock(); disconnects++; mu.Unlock() }))
	require.NoError(t, err)
	defer nc.Close()
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	stored := func() uint64 {
		st, err := js.Stream(ctx, event.StreamName("main"))
		require.NoError(t, err)
		info, err := st.Info(ctx)
		require.NoError(t, err)
		return info.State.Msgs
	}
	require.Eventually(t, func() bool { return stored() == 200+1 }, 60*time.Second, 50*time.Millisecond)

	require.NoError(t, pg.Stop())
	require.Eventually(t, func() bool {
		code, _ := httpGetCode(p.url("/readyz"))
		v, ok := p.metric(`epitaph_capture_connected{to="source"}`)
		return code == http.StatusServiceUnavailable && ok && v == 0
	}, 30*time.Second, 20*time.Millisecond, "unready while the source is down")
	// Down for a few reconnect attempts, the broker serving throughout.
	for range 3 {
		code, err := httpGetCode(p.url("/livez"))
		require.NoError(t, err)
		require.Equal(t, http.StatusOK, code)
		if n := stored(); n != 200+1 {
			st, err := js.Stream(ctx, event.StreamName("main"))
			require.NoError(t, err)
			for seq := uint64(200 + 2); seq <= n; seq++ {
				if m, err := st.GetMsg(ctx, seq); err == nil {
					t.Logf("stored while the source is down: %d %s %v %s", seq, m.Subject, m.Header, m.Data)
				}
			}
			t.Fatalf("the stream holds %d messages while the source is down, want %d", n, 200+1)
		}
		time.Sleep(time.Second) // the outage lasts: nothing to poll for
	}
	require.NoError(t, pg.Start())
	streamingAgain(t, p, 60*time.Second, "the source's return")
	testenv.Exec(t, db, `DELETE FROM items WHERE id > 200`)

	e := &env{js: js}
	ms := e.messages(t, "main", 400+2)
	require.Len(t, ms, 400+2)
	requireOnce(t, ms, 400)
	mu.Lock()
	require.Zero(t, disconnects, "the projector's connection to the embedded broker dropped")
	mu.Unlock()
	p.mu.Lock()
	require.Zero(t, p.selfExit, "the capture process exited")
	p.mu.Unlock()
	require.Equal(t, pid, p.pid())
}

// TestCaptureWaitsForItsDependenciesAtStart: started while the source and
// the external broker are both down, the capture process waits for each
// in turn (one line each), serving /livez 200 and /readyz 503, and streams
// once they are up; it never exits.
func TestCaptureWaitsForItsDependenciesAtStart(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs a capture process, stops PostgreSQL")
	}
	t.Parallel()
	pg := testenv.NewPostgres(t)
	db := pg.NewDatabase(t)
	testenv.Exec(t, db, `CREATE TABLE items (id int PRIMARY KEY, pad text); ALTER TABLE items REPLICA IDENTITY FULL;
		INSERT INTO items SELECT i, 'row ' || i FROM generate_series(1, 100) i`)
	js := testenv.NewNATS(t)
	js.Stop()
	require.NoError(t, pg.Stop())
	p := startCapProc(t, "capture-waits", buildCapture(t), map[string]string{
		"EPITAPH_SOURCE_URL":         db,
		"EPITAPH_NATS_URL":           js.URL,
		"EPITAPH_SLOT":               dbName(t, db),
		"EPITAPH_PUBLICATION":        dbName(t, db),
		"EPITAPH_TABLES":             "items",
		"EPITAPH_PARTITIONS":         "2",
		"EPITAPH_HEARTBEAT_INTERVAL": "-1s",
	})
	pid := p.pid()
	logged := func(s string) bool {
		b, err := os.ReadFile(p.log)
		require.NoError(t, err)
		return strings.Contains(string(b), s)
	}
	waiting := func(what string) {
		t.Helper()
		require.Eventually(t, func() bool {
			live, _ := httpGetCode(p.url("/livez"))
			ready, _ := httpGetCode(p.url("/readyz"))
			return live == http.StatusOK && ready == http.StatusServiceUnavailable && logged("the "+what+" is unreachable: waiting for it")
		}, 60*time.Second, 50*time.Millisecond, "waiting for the %s", what)
	}
	waiting("source")
	require.NoError(t, pg.Start())
	waiting("broker")
	js.Start()
	streamingAgain(t, p, 60*time.Second, "start")
	testenv.Exec(t, db, `DELETE FROM items`)
	ms := (&env{js: mustJS(t, js)}).messages(t, "main", 100+1)
	require.Len(t, ms, 100+1)
	requireOnce(t, ms, 100)

	p.mu.Lock()
	require.Zero(t, p.selfExit, "the capture process exited")
	p.mu.Unlock()
	require.Equal(t, pid, p.pid())
	b, err := os.ReadFile(p.log)
	require.NoError(t, err)
	for _, what := range []string{"source", "broker"} {
		require.Equal(t, 1, strings.Count(string(b), "the "+what+" is unreachable"), "one line for the wait, none per retry")
		require.Equal(t, 1, strings.Count(string(b), "the "+what+" is reachable"))
	}
}
