package capture

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/broker"
	"github.com/epitaph-dev/epitaph/internal/natsconn"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/internal/workload"
)

// buildCapture builds cmd/capture into a temporary directory.
func buildCapture(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "epitaph-capture")
	cmd := exec.Command("go", "build", "-o", bin, "github.com/epitaph-dev/epitaph/cmd/capture")
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "go build: %s", out)
	return bin
}

// capProc is one capture process under a small supervisor: a process that
// exits by itself is restarted (as Kubernetes would); one the test kills
// stays down until the test revives it.
type capProc struct {
	t    *testing.T
	name string
	bin  string
	env  []string
	port int
	log  string
	// session: each process leads a session of its own (setsid), as a
	// service does.
	session bool

	mu       sync.Mutex
	cmd      *exec.Cmd
	exited   chan struct{} // closed when the current process has exited
	killed   bool
	stopping bool
	selfExit int // exits the test did not cause
	revive   chan struct{}
	gone     chan struct{}
}

func captureEnv(extra map[string]string) []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "EPITAPH_") {
			env = append(env, kv)
		}
	}
	for k, v := range extra {
		env = append(env, k+"="+v)
	}
	return env
}

// signingKeysDir holds the test signing keys, one per top-level test, for
// the whole test binary: a key kept in the first caller's t.TempDir would
// be removed when that subtest ends, under the other subtests of its test
// that share it. Removed by TestMain.
var signingKeysDir = sync.OnceValue(func() string {
	dir, err := os.MkdirTemp("", "epitaph-capture-keys-")
	if err != nil {
		panic(err)
	}
	return dir
})

// testSigningKey is the signing key file every capture of one top-level
// test shares (all its subtests too).
func testSigningKey(t *testing.T) string {
	root, _, _ := strings.Cut(t.Name(), "/")
	dir := filepath.Join(signingKeysDir(), root)
	require.NoError(t, os.MkdirAll(dir, 0o700))
	return filepath.Join(dir, "signing.key")
}

// ownDataDir gives a capture process a data dir of its own (the
// partition sequences' record, the signing key's public half) unless env
// names one: never the binary's default, relative to the working
// directory, which every test of the package shares.
func ownDataDir(t *testing.T, env map[string]string) {
	if env["EPITAPH_DATA_DIR"] == "" {
		env["EPITAPH_DATA_DIR"] = t.TempDir()
	}
}

func startCapProc(t *testing.T, name, bin string, env map[string]string) *capProc {
	t.Helper()
	return startCapProcWith(t, name, bin, env, false)
}

// startCapProcWith is startCapProc, with each process in a session of its
// own if session.
func startCapProcWith(t *testing.T, name, bin string, env map[string]string, session bool) *capProc {
	t.Helper()
	port, err := testenv.FreePort()
	require.NoError(t, err)
	env["EPITAPH_METRICS_ADDR"] = "127.0.0.1:" + strconv.Itoa(port)
	if env["EPITAPH_DATA_DIR"] == "" && env["EPITAPH_SIGNING_KEY"] == "" {
		// Every capture of one test signs with one key, as captures of
		// one source (an active one and its standbys) must.
		env["EPITAPH_SIGNING_KEY"] = testSigningKey(t)
	}
	ownDataDir(t, env)
	p := &capProc{t: t, name: name, bin: bin, env: captureEnv(env), port: port, session: session,
		log: filepath.Join(t.TempDir(), name+".log"), revive: make(chan struct{}), gone: make(chan struct{})}
	started := make(chan error, 1)
	go p.supervise(started)
	require.NoError(t, <-started)
	t.Cleanup(func() {
		p.mu.Lock()
		p.stopping = true
		cmd := p.cmd
		p.mu.Unlock()
		if cmd != nil && cmd.Process != nil {
			_ = cmd.Process.Kill()
		}
		select {
		case p.revive <- struct{}{}:
		default:
		}
		<-p.gone
		if t.Failed() {
			p.dumpLog()
		}
	})
	return p
}

func (p *capProc) launch() error {
	f, err := os.OpenFile(p.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer f.Close()
	cmd := exec.Command(p.bin)
	cmd.Env = p.env
	cmd.Stdout, cmd.Stderr = f, f
	if p.session {
		cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	}
	if err := cmd.Start(); err != nil {
		return err
	}
	p.mu.Lock()
	p.cmd, p.exited = cmd, make(chan struct{})
	p.mu.Unlock()
	return nil
}

func (p *capProc) supervise(started chan<- error) {
	defer close(p.gone)
	first := true
	for {
		err := p.launch()
		if first {
			started <- err
			first = false
		}
		if err != nil {
			return
		}
		p.mu.Lock()
		cmd, exited := p.cmd, p.exited
		p.mu.Unlock()
		werr := cmd.Wait()
		close(exited)
		p.mu.Lock()
		stopping, killed := p.stopping, p.killed
		if !stopping && !killed {
			p.selfExit++
		}
		p.mu.Unlock()
		if stopping {
			return
		}
		if killed {
			<-p.revive
			p.mu.Lock()
			p.killed, stopping = false, p.stopping
			p.mu.Unlock()
			if stopping {
				return
			}
			continue
		}
		p.t.Logf("%s (pid %d) exited by itself (%v): restarting it", p.name, cmd.Process.Pid, werr)
		time.Sleep(500 * time.Millisecond) // a supervisor's restart delay
	}
}

// kill SIGKILLs the current process and waits until it is gone.
func (p *capProc) kill() {
	p.mu.Lock()
	p.killed = true
	cmd, exited := p.cmd, p.exited
	p.mu.Unlock()
	require.NoError(p.t, cmd.Process.Signal(syscall.SIGKILL))
	<-exited
}

// start revives a killed process.
func (p *capProc) start() { p.revive <- struct{}{} }

func (p *capProc) pid() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cmd.Process.Pid
}

func (p *capProc) url(path string) string {
	return "http://127.0.0.1:" + strconv.Itoa(p.port) + path
}

// active scrapes epitaph_capture_active; ok is false when the process does
// not answer.
func (p *capProc) active() (v int, ok bool) {
	c := http.Client{Timeout: 2 * time.Second}
	resp, err := c.Get(p.url("/metrics"))
	if err != nil {
		return 0, false
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if s, found := strings.CutPrefix(sc.Text(), "epitaph_capture_active "); found {
			n, err := strconv.Atoi(s)
			return n, err == nil
		}
	}
	return 0, false
}

func (p *capProc) healthz() int {
	c := http.Client{Timeout: 2 * time.Second}
	resp, err := c.Get(p.url("/healthz"))
	if err != nil {
		return 0
	}
	resp.Body.Close()
	return resp.StatusCode
}

// logCount is how many times substr occurs in the process's log so far.
func (p *capProc) logCount(substr string) int {
	b, _ := os.ReadFile(p.log)
	return strings.Count(string(b), substr)
}

func (p *capProc) dumpLog() {
	b, _ := os.ReadFile(p.log)
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > 60 {
		lines = lines[len(lines)-60:]
	}
	p.t.Logf("---- %s log (last %d lines) ----\n%s", p.name, len(lines), strings.Join(lines, "\n"))
}

// slotHolderApp is the application_name of the session streaming the slot,
// or "" when the slot is inactive.
func slotHolderApp(t *testing.T, db, slot string) string {
	return queryString(t, db, `SELECT coalesce((SELECT a.application_name FROM pg_replication_slots s
		JOIN pg_stat_activity a ON a.pid = s.active_pid WHERE s.slot_name = $1), '')`, slot)
}

// whoStreams waits until exactly one of the two processes reports
// active=1 and the other answers with 0, and returns their indexes.
func whoStreams(t *testing.T, procs []*capProc, timeout time.Duration) (active, standby int) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		a, okA := procs[0].active()
		b, okB := procs[1].active()
		switch {
		case okA && okB && a == 1 && b == 0:
			return 0, 1
		case okA && okB && a == 0 && b == 1:
			return 1, 0
		}
		if time.Now().After(deadline) {
			t.Fatalf("no single streaming capture within %s (a: %d %v, b: %d %v)", timeout, a, okA, b, okB)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestStandbyTakeoverAfterSIGKILL runs two capture processes with
// --standby on one slot against an external JetStream, under a delete
// workload. The streaming one is SIGKILLed three times; each time the other
// takes over within the bound, the killed one comes back as the standby,
// and at the end the stream holds every deleted row exactly once.
func TestStandbyTakeoverAfterSIGKILL(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs capture processes")
	}
	t.Parallel()
	const takeoverBound = 30 * time.Second
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	db := testenv.NewDatabase(t)
	slot := dbName(t, db)
	nats := testenv.NewNATS(t)
	require.NoError(t, workload.Setup(ctx, db))
	_, err := workload.Seed(ctx, db, workload.SeedConfig{Customers: 150, OrdersPerCustomer: 10})
	require.NoError(t, err)

	bin := buildCapture(t)
	env := func() map[string]string {
		return map[string]string{
			"EPITAPH_SOURCE_URL":         db,
			"EPITAPH_NATS_URL":           nats.URL,
			"EPITAPH_SLOT":               slot,
			"EPITAPH_PUBLICATION":        slot,
			"EPITAPH_TABLES":             strings.Join(workload.Tables, ","),
			"EPITAPH_PARTITIONS":         "4",
			"EPITAPH_STANDBY":            "true",
			"EPITAPH_HEARTBEAT_INTERVAL": "1s",
		}
	}
	procs := []*capProc{startCapProc(t, "capture-a", bin, env())}
	// a streams before b starts, so the publication and slot exist.
	require.Eventually(t, func() bool { v, ok := procs[0].active(); return ok && v == 1 }, 60*time.Second, 100*time.Millisecond)
	procs = append(procs, startCapProc(t, "capture-b", bin, env()))

	// Never two streaming at once, sampled throughout.
	var (
		sampleMu   sync.Mutex
		bothActive int
		samples    int
	)
	sampleCtx, stopSampling := context.WithCancel(ctx)
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		for sampleCtx.Err() == nil {
			a, _ := procs[0].active()
			b, _ := procs[1].active()
			sampleMu.Lock()
			samples++
			if a == 1 && b == 1 {
				bothActive++
			}
			sampleMu.Unlock()
			time.Sleep(50 * time.Millisecond)
		}
	}()

	act, sb := whoStreams(t, procs, 60*time.Second)
	require.Equal(t, http.StatusOK, procs[sb].healthz(), "a waiting standby is healthy")
	var st Status
	code, body := httpGet(t, procs[sb].url("/status"))
	require.Equal(t, http.StatusOK, code)
	require.NoError(t, json.Unmarshal([]byte(body), &st))
	require.Equal(t, RoleStandby, st.Role)
	require.False(t, st.Active)
	require.Eventually(t, func() bool {
		_, body := httpGet(t, procs[sb].url("/status"))
		st = Status{}
		return json.Unmarshal([]byte(body), &st) == nil && st.Standby != nil && st.Standby.Holder != nil &&
			strings.HasSuffix(st.Standby.Holder.ApplicationName, "-"+strconv.Itoa(procs[act].pid()))
	}, 10*time.Second, 100*time.Millisecond, "the standby names the holder of the lease")

	// The delete workload runs throughout.
	runCtx, stopRun := context.WithCancel(ctx)
	type runOut struct {
		res workload.Result
		err error
	}
	ran := make(chan runOut, 1)
	go func() {
		res, err := workload.Run(runCtx, db, workload.Plan{Seed: 7, MaxOrdersPerTx: 6, BigTxRows: 1500, BigTxAt: 60, Reinserts: 6, Pause: 20 * time.Millisecond})
		ran <- runOut{res, err}
	}()

	_, js := nats.Connect(t)
	stream, err := js.Stream(ctx, event.StreamName("main"))
	require.NoError(t, err)
	published := func() uint64 {
		info, err := stream.Info(ctx)
		require.NoError(t, err)
		return info.State.Msgs
	}
	for kill := 1; kill <= 3; kill++ {
		// Let the active capture publish some of the workload first.
		before := published()
		require.Eventually(t, func() bool { return published() > before+200 }, 60*time.Second, 50*time.Millisecond)
		select {
		case out := <-ran:
			t.Fatalf("the workload ended before kill %d: %+v", kill, out)
		default:
		}
		victim := procs[act]
		victimPID := victim.pid()
		require.True(t, strings.HasSuffix(slotHolderApp(t, db, slot), "-"+strconv.Itoa(victimPID)),
			"the streaming process holds the slot: %q, pid %d", slotHolderApp(t, db, slot), victimPID)
		killedAt := time.Now()
		victim.kill()
		require.Eventually(t, func() bool { v, ok := procs[sb].active(); return ok && v == 1 }, takeoverBound, 20*time.Millisecond,
			"kill %d: the standby did not take over within %s", kill, takeoverBound)
		took := time.Since(killedAt)
		t.Logf("kill %d: %s SIGKILLed (pid %d) with %d messages in the stream; %s took over in %s",
			kill, victim.name, victimPID, published(), procs[sb].name, took.Round(time.Millisecond))
		require.Contains(t, slotHolderApp(t, db, slot), "-"+strconv.Itoa(procs[sb].pid()))
		victim.start()
		act, sb = whoStreams(t, procs, 60*time.Second)
		require.Equal(t, victim, procs[sb], "the killed capture came back as the standby")
		require.Equal(t, http.StatusOK, procs[sb].healthz())
	}
	stopRun()
	out := <-ran
	require.NoError(t, out.err)
	require.Greater(t, out.res.Deleted, int64(1500), "the workload deleted rows during the kills")
	t.Logf("workload: %d transactions, %d rows deleted, %d reinserts", out.res.Transactions, out.res.Deleted, out.res.Reinserted)

	expected, err := workload.Expected(ctx, db)
	require.NoError(t, err)
	require.EqualValues(t, out.res.Deleted, len(expected))
	var rep workload.Report
	deadline := time.Now().Add(2 * time.Minute)
	for {
		events, err := workload.StreamDeletes(ctx, nats.URL, "main")
		require.NoError(t, err)
		if len(events) >= len(expected) || time.Now().After(deadline) {
			rep, err = workload.VerifyStream(ctx, db, expected, events)
			require.NoError(t, err)
			break
		}
		time.Sleep(500 * time.Millisecond)
	}
	require.True(t, rep.OK(), rep.String())
	t.Logf("stream: %s", rep.String())

	stopSampling()
	<-sampled
	sampleMu.Lock()
	defer sampleMu.Unlock()
	require.Zero(t, bothActive, "two captures reported epitaph_capture_active=1 at once (%d samples)", samples)
	for _, p := range procs {
		p.mu.Lock()
		t.Logf("%s exited by itself %d times", p.name, p.selfExit)
		p.mu.Unlock()
	}
}

// procStatusBytes reads a "kB" field of /proc/<pid>/status (VmHWM, VmRSS).
func procStatusBytes(pid int, field string) (int64, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return 0, err
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, field+":"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			return kb << 10, err
		}
	}
	return 0, fmt.Errorf("%s not in /proc/%d/status", field, pid)
}

// PeakRSSBound is the stated bound on the capture process's peak resident
// memory (VmHWM) while it publishes a 1,000,000-row DELETE transaction to
// an external JetStream server. The README states the same number.
const PeakRSSBound = 128 << 20

// EmbeddedPeakRSSBound is the bound with the embedded JetStream server,
// whose message caches and dedupe window live in the capture's process.
// The bench's peak target. The window holds every message id of the last
// --duplicate-window (~136 bytes each), and up to three windows' worth
// until the server compacts its list of them, so it grows with the rate:
// with a 1 s window the process peaked at 97-117 MiB on a loaded machine
// (11,000-14,000 rows/s) but at 139-222 MiB on a quiet one (74,000-97,000
// rows/s), 40-50 MB of ids live and GOGC 150 letting the heap grow to 2.5
// times that. With the default now JetStream's minimum, 100ms
// (DefaultDuplicateWindow), the ids are ~7 MB at 82,000 rows/s and the
// rest of the live heap (~20 MB: the file store's 8 MB block buffers, the
// in-flight messages) does not depend on the rate or the transaction's
// size: 87.6 MiB at 82,000 rows/s against 191.5 MiB with 1 s, same
// machine, back to back. With the old 2m window it peaked at 229 MiB even
// with GOMEMLIMIT=200MiB.
const EmbeddedPeakRSSBound = 150 << 20

// deployedMemoryLimit is the GOMEMLIMIT deploy/kubernetes/capture.yaml
// gives the capture: the test runs it as deployed.
func deployedMemoryLimit(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "deploy", "kubernetes", "capture.yaml"))
	require.NoError(t, err)
	_, rest, found := strings.Cut(string(b), "- name: GOMEMLIMIT")
	require.True(t, found, "capture.yaml sets GOMEMLIMIT")
	v, _, _ := strings.Cut(strings.TrimSpace(rest), "\n")
	v, ok := strings.CutPrefix(strings.TrimSpace(v), "value:")
	require.True(t, ok, "GOMEMLIMIT's value follows its name in capture.yaml")
	return strings.Trim(strings.TrimSpace(v), `"`)
}

// TestPeakRSSOneMillionRowDelete runs the capture binary while one
// transaction deletes 1,001,000 rows by cascade (1,000 orders of 1,000
// lines) and asserts its peak RSS stays under PeakRSSBound: rows are
// streamed out with a bounded window, never a whole transaction held.
func TestPeakRSSOneMillionRowDelete(t *testing.T) {
	if testing.Short() {
		t.Skip("a 1,000,000-row transaction")
	}
	t.Parallel()
	peakRSSOneMillionRowDelete(t, false)
}

// TestPeakRSSOneMillionRowDeleteEmbedded is the same transaction through
// the capture's embedded JetStream server: the process holds the server's
// stream caches too, and stays under EmbeddedPeakRSSBound.
func TestPeakRSSOneMillionRowDeleteEmbedded(t *testing.T) {
	if testing.Short() {
		t.Skip("a 1,000,000-row transaction")
	}
	t.Parallel()
	peakRSSOneMillionRowDelete(t, true)
}

func peakRSSOneMillionRowDelete(t *testing.T, embedded bool) {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	db := testenv.NewDatabase(t)
	require.NoError(t, workload.Setup(ctx, db))
	counts, err := workload.Seed(ctx, db, workload.SeedConfig{Customers: 1, OrdersPerCustomer: 1000, LinesPerOrder: 1000,
		ShipmentsPerOrder: -1, ItemsPerShipment: -1, NoLedger: true})
	require.NoError(t, err)
	n := counts.Orders + counts.OrderLines
	require.EqualValues(t, 1_001_000, n)

	env := map[string]string{
		"EPITAPH_SOURCE_URL":         db,
		"EPITAPH_SLOT":               dbName(t, db),
		"EPITAPH_PUBLICATION":        dbName(t, db),
		"EPITAPH_TABLES":             strings.Join(workload.Tables, ","),
		"EPITAPH_HEARTBEAT_INTERVAL": "-1s",
	}
	bound := int64(PeakRSSBound)
	var srv *testenv.NATS
	if embedded {
		port, err := testenv.FreePort()
		require.NoError(t, err)
		listen := "127.0.0.1:" + strconv.Itoa(port)
		dataDir := t.TempDir()
		env["EPITAPH_DATA_DIR"], env["EPITAPH_NATS_LISTEN"] = dataDir, listen
		creds := natsconn.UserCredentials(broker.CaptureCreds(EmbeddedCredsDir(dataDir)))
		srv = &testenv.NATS{URL: "nats://" + listen, Opts: []nats.Option{creds}}
		bound = EmbeddedPeakRSSBound
		env["GOMEMLIMIT"] = deployedMemoryLimit(t) // as deployed
	} else {
		srv = testenv.NewNATS(t)
		env["EPITAPH_NATS_URL"] = srv.URL
	}
	p := startCapProc(t, "capture-bigtx", buildCapture(t), env)
	require.Eventually(t, func() bool { v, ok := p.active(); return ok && v == 1 }, 60*time.Second, 100*time.Millisecond)
	nc, js := srv.Connect(t)
	defer nc.Close()
	stream, err := js.Stream(ctx, event.StreamName("main"))
	require.NoError(t, err)
	idle, err := procStatusBytes(p.pid(), "VmHWM")
	require.NoError(t, err)

	start := time.Now()
	testenv.Exec(t, db, `DELETE FROM public.orders`)
	deleted := time.Since(start)
	for {
		info, err := stream.Info(ctx)
		require.NoError(t, err)
		if info.State.Msgs >= uint64(n)+1 {
			break
		}
		p.mu.Lock()
		self := p.selfExit
		p.mu.Unlock()
		require.Zero(t, self, "the capture exited")
		require.NoError(t, ctx.Err(), "stream holds %d of %d messages", info.State.Msgs, n+1)
		time.Sleep(500 * time.Millisecond)
	}
	took := time.Since(start)
	peak, err := procStatusBytes(p.pid(), "VmHWM")
	require.NoError(t, err)
	t.Logf("%d rows in one transaction (embedded broker: %v, GOMEMLIMIT %q): DELETE %s, in the stream after %s (%.0f rows/s); capture VmHWM idle %.1f MiB, peak %.1f MiB (bound %d MiB)",
		n, embedded, env["GOMEMLIMIT"], deleted.Round(time.Millisecond), took.Round(time.Millisecond), float64(n)/took.Seconds(),
		float64(idle)/(1<<20), float64(peak)/(1<<20), bound>>20)
	require.Less(t, peak, bound)
}

// TestEmbeddedBrokerLosesAcknowledgedTail: the capture with its embedded
// broker (persist mode async) is SIGKILLed right after its messages were
// acknowledged, and its stream then loses an acknowledged tail, as after a
// crash that tore the last writes (the last message block is cut short and
// the stream's index removed, so the server recovers from the blocks). The
// confirmed LSN trailed the acknowledgements, so the restarted capture gets
// the lost rows from the slot again: the stream ends with every row exactly
// once.
func TestEmbeddedBrokerLosesAcknowledgedTail(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs a capture process")
	}
	t.Parallel()
	ctx := context.Background()
	db := testenv.NewDatabase(t)
	testenv.Exec(t, db, `CREATE TABLE items (id int PRIMARY KEY, pad text); ALTER TABLE items REPLICA IDENTITY FULL;
		INSERT INTO items SELECT i, repeat('p', 300) FROM generate_series(1, 5000) i`)
	port, err := testenv.FreePort()
	require.NoError(t, err)
	listen := "127.0.0.1:" + strconv.Itoa(port)
	dataDir := t.TempDir()
	p := startCapProc(t, "capture-embedded", buildCapture(t), map[string]string{
		"EPITAPH_SOURCE_URL":         db,
		"EPITAPH_DATA_DIR":           dataDir,
		"EPITAPH_NATS_LISTEN":        listen,
		"EPITAPH_SLOT":               dbName(t, db),
		"EPITAPH_PUBLICATION":        dbName(t, db),
		"EPITAPH_TABLES":             "items",
		"EPITAPH_PARTITIONS":         "2",
		"EPITAPH_HEARTBEAT_INTERVAL": "-1s",
	})
	require.Eventually(t, func() bool { v, ok := p.active(); return ok && v == 1 }, 60*time.Second, 100*time.Millisecond)
	const rows, txs = 5000, 5
	for i := range txs {
		testenv.Exec(t, db, `DELETE FROM items WHERE id > $1 AND id <= $2`, i*rows/txs, (i+1)*rows/txs)
	}
	creds := natsconn.UserCredentials(broker.CaptureCreds(EmbeddedCredsDir(dataDir)))
	e := &env{nats: &testenv.NATS{URL: "nats://" + listen, Opts: []nats.Option{creds}}}
	nc, js := e.nats.Connect(t)
	e.js = js
	require.Len(t, e.messages(t, "main", rows+txs), rows+txs)
	nc.Close()
	p.kill()

	// The crash tore the tail: cut the last block and drop the index.
	blocks, err := filepath.Glob(filepath.Join(dataDir, "jetstream", "jetstream", "*", "streams", "EPITAPH_MAIN", "msgs", "*.blk"))
	require.NoError(t, err)
	require.NotEmpty(t, blocks, "message blocks under %s", dataDir)
	last := blocks[len(blocks)-1]
	st, err := os.Stat(last)
	require.NoError(t, err)
	require.NoError(t, os.Truncate(last, st.Size()*6/10))
	if err := os.Remove(filepath.Join(filepath.Dir(last), "index.db")); !errors.Is(err, os.ErrNotExist) {
		require.NoError(t, err)
	}

	// What the broker holds after the crash: fewer messages than it acknowledged.
	b, err := broker.Start(broker.Config{StoreDir: filepath.Join(dataDir, "jetstream"), Listen: "127.0.0.1:0",
		Auth: &broker.Auth{Dir: EmbeddedCredsDir(dataDir), Source: "main"}})
	require.NoError(t, err)
	probe := &env{nats: &testenv.NATS{URL: b.ClientURL(), Opts: []nats.Option{creds}}}
	pnc, pjs := probe.nats.Connect(t)
	stream, err := pjs.Stream(ctx, event.StreamName("main"))
	require.NoError(t, err)
	info, err := stream.Info(ctx)
	require.NoError(t, err)
	kept := info.State.Msgs
	pnc.Close()
	b.Shutdown()
	t.Logf("the stream kept %d of %d acknowledged messages", kept, rows+txs)
	require.Less(t, kept, uint64(rows+txs), "the tail was lost")

	p.start()
	require.Eventually(t, func() bool { v, ok := p.active(); return ok && v == 1 }, 60*time.Second, 100*time.Millisecond)
	nc, js = e.nats.Connect(t)
	defer nc.Close()
	e.js = js
	ms := e.messages(t, "main", rows+txs)
	require.Len(t, ms, rows+txs)
	requireOnce(t, ms, rows)
}
