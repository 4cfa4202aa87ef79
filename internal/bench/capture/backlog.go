package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"

	"github.com/epitaph-dev/epitaph/internal/bench"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/internal/workload"
)

// The capture's targets, printed beside the figures they judge.
const (
	targetEmbedded = 0.9 // capture (embedded broker) / pg_recvlogical
	targetExternal = 0.8 // capture (external JetStream, persist mode default) / pg_recvlogical
)

// Capture modes of the backlog drains.
const (
	modeEmbedded        = "embedded"         // the capture's embedded broker (persist mode async)
	modeExternal        = "external"         // a nats-server process of its own, file storage, persist mode default
	modeEmbeddedDefault = "embedded_default" // the embedded broker with persist mode default (-embedded-default)
)

// backlogBench drains the same backlog -runs times: each run with
// pg_recvlogical before and after (the faster is that run's limit) and
// with each capture mode, every capture on a slot and stream of its own
// made before the deletes.
type backlogBench struct {
	pg          *testenv.Postgres
	captureBin  string
	natsBin     string
	dir         string
	url         string
	rows, perTx int
	runs        int
	modes       []string
	profileDir  string
	extraEnv    []string            // added to every capture's environment
	variants    map[string][]string // environment of each variant mode ("<mode>.<name>")

	n       int64 // deleted rows in the backlog
	endLSN  string
	slots   map[string]*captureSlot // by mode and run
	results []runResult
}

// captureSlot is one capture's configuration: its slot, stream and (for
// the external mode) server.
type captureSlot struct {
	mode, slot string
	run        int
	env        []string
	metrics    string
	listen     string // the broker's address
	dataDir    string // the capture's data dir (the embedded broker's store in it)
	storeDir   string // the external server's store
	watchOpts  []nats.Option
	profile    string // the capture's CPU profile ("" = none)
}

// drainResult is one drain's figures.
type drainResult struct {
	total, startup, drain time.Duration // process start to last row; to first row; first to last
	cpu, serverCPU, pgCPU float64       // CPU seconds: the capture process, the external server, the walsender
	peakRSS, serverRSS    int64
	faults, serverFaults  int64 // minor page faults: the capture process, the external server
}

type runResult struct {
	limit float64 // rows/s of the faster pg_recvlogical run
	by    map[string]drainResult
}

func (b *backlogBench) key(mode string, run int) string { return mode + "#" + strconv.Itoa(run) }

func backlog(ctx context.Context, b *backlogBench) error {
	url, err := bench.CreateDatabase(ctx, b.pg, "backlog")
	if err != nil {
		return err
	}
	b.url = url
	if err := workload.Setup(ctx, url); err != nil {
		return err
	}
	seed := bench.ShopFor(b.rows)
	counts, err := workload.Seed(ctx, url, seed)
	if err != nil {
		return err
	}
	b.n = int64(counts.Total() - counts.Customers) // deleting every order leaves only customers
	bench.Note("seeded %d rows; the backlog will be %d deleted rows in transactions of %d orders (%d rows), drained %d time(s) by pg_recvlogical (twice a run) and by the capture modes %v",
		counts.Total(), b.n, b.perTx, b.perTx*seed.RowsPerOrder(), b.runs, b.modes)
	if err := b.prepareSlots(ctx); err != nil {
		return err
	}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	took, err := bench.DeleteAllOrders(ctx, url, b.perTx)
	if err != nil {
		return err
	}
	bench.Figure("capture.backlog_rows", float64(b.n), "rows")
	bench.Figure("capture.source_delete_rows_per_sec", float64(b.n)/took.Seconds(), "rows/s")
	if err := conn.QueryRow(ctx, "SELECT pg_current_wal_lsn()::text").Scan(&b.endLSN); err != nil {
		return err
	}
	// One more WAL record past the end, so pg_recvlogical sees a position
	// beyond --endpos and stops.
	if _, err := conn.Exec(ctx, "SELECT pg_logical_emit_message(false, 'bench.end', '')"); err != nil {
		return err
	}
	var retained int64
	if err := conn.QueryRow(ctx, "SELECT pg_current_wal_lsn() - restart_lsn FROM pg_replication_slots WHERE slot_name = 'bench_recvlogical_1_1'").Scan(&retained); err != nil {
		return err
	}
	bench.Figure("capture.backlog_wal_bytes", float64(retained), "bytes")
	for run := 1; run <= b.runs; run++ {
		if err := b.run(ctx, run); err != nil {
			return err
		}
	}
	b.summary()
	return nil
}

// prepareSlots starts every capture once, so that it makes its slot,
// publication and stream, and stops it; then makes pg_recvlogical's slots,
// all at the same point.
func (b *backlogBench) prepareSlots(ctx context.Context) error {
	b.slots = map[string]*captureSlot{}
	for run := 1; run <= b.runs; run++ {
		for _, mode := range b.modes {
			cs, err := b.newSlot(mode, run)
			if err != nil {
				return err
			}
			b.slots[b.key(mode, run)] = cs
			if err := b.startAndStop(ctx, cs); err != nil {
				return err
			}
		}
	}
	conn, err := pgx.Connect(ctx, b.url)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	for run := 1; run <= b.runs; run++ {
		for i := 1; i <= 2; i++ {
			if _, err := conn.Exec(ctx, "SELECT pg_create_logical_replication_slot($1, 'pgoutput')", recvSlot(run, i)); err != nil {
				return fmt.Errorf("create slot for pg_recvlogical: %w", err)
			}
		}
	}
	return nil
}

func recvSlot(run, i int) string { return fmt.Sprintf("bench_recvlogical_%d_%d", run, i) }

func (b *backlogBench) newSlot(mode string, run int) (*captureSlot, error) {
	listen, err := bench.LocalAddr()
	if err != nil {
		return nil, err
	}
	metrics, err := bench.LocalAddr()
	if err != nil {
		return nil, err
	}
	name := fmt.Sprintf("%s_%d", strings.ReplaceAll(mode, ".", "_"), run) // a slot name: no dots
	dataDir := filepath.Join(b.dir, "backlog-"+name)
	cs := &captureSlot{mode: mode, run: run, slot: "epitaph_" + name, metrics: metrics, listen: listen, dataDir: dataDir}
	natsURL := ""
	switch baseMode(mode) {
	case modeExternal:
		natsURL = "nats://" + listen
		cs.storeDir = filepath.Join(b.dir, "backlog-"+name+"-nats-server")
	default:
		cs.watchOpts = []nats.Option{bench.EmbeddedCreds(dataDir)}
	}
	cs.env = bench.CaptureEnv(b.url, natsURL, listen, dataDir, metrics, "main", cs.slot)
	cs.env = append(cs.env, b.extraEnv...)
	cs.env = append(cs.env, b.variants[mode]...)
	if baseMode(mode) == modeEmbeddedDefault {
		cs.env = append(cs.env, "EPITAPH_STREAM_PERSIST=default")
	}
	if b.profileDir != "" {
		cs.profile = filepath.Join(b.profileDir, "capture-"+name+".pprof")
	}
	return cs, nil
}

// startServer starts the external mode's nats-server (JetStream, file
// storage in its store dir) and waits until it accepts connections.
// profilePort > 0 serves net/http/pprof there.
func (b *backlogBench) startServer(cs *captureSlot, profilePort int) (*bench.Proc, error) {
	host, port, err := net.SplitHostPort(cs.listen)
	if err != nil {
		return nil, fmt.Errorf("server address %q: %w", cs.listen, err)
	}
	args := []string{"-js", "-sd", cs.storeDir, "-a", host, "-p", port, "-n", "bench-" + cs.slot}
	if profilePort > 0 {
		args = append(args, "--profile", strconv.Itoa(profilePort))
	}
	p, err := bench.StartProc("nats-server-"+cs.slot, b.natsBin, nil, b.dir, args...)
	if err != nil {
		return nil, err
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		c, err := net.DialTimeout("tcp", cs.listen, time.Second)
		if err == nil {
			c.Close()
			return p, nil
		}
		if done, perr := p.Exited(); done {
			return nil, fmt.Errorf("nats-server exited (%v):\n%s", perr, p.LogTail(2000))
		}
		if time.Now().After(deadline) {
			p.Kill()
			return nil, fmt.Errorf("nats-server not listening on %s after 30s: %w", cs.listen, err)
		}
		time.Sleep(20 * time.Millisecond) // polling the port with a deadline
	}
}

// startAndStop runs the capture until it has made its stream and slot,
// then stops it gracefully (and its external server).
func (b *backlogBench) startAndStop(ctx context.Context, cs *captureSlot) error {
	if baseMode(cs.mode) == modeExternal {
		srv, err := b.startServer(cs, 0)
		if err != nil {
			return err
		}
		defer func() {
			if err := srv.Stop(30 * time.Second); err != nil {
				bench.Note("nats-server stop: %v", err)
			}
		}()
	}
	watch, err := bench.WatchStream("nats://"+cs.listen, "main", cs.watchOpts...)
	if err != nil {
		return err
	}
	defer watch.Close()
	bin, env := b.binFor(cs.env)
	p, err := bench.StartProc("capture-"+cs.slot, bin, env, b.dir)
	if err != nil {
		return err
	}
	if err := bench.WaitCaptureReady(ctx, watch, b.url, cs.slot, 2*time.Minute, exited(p)); err != nil {
		p.Kill()
		return fmt.Errorf("capture did not create its stream: %w", err)
	}
	if err := p.Stop(30 * time.Second); err != nil {
		bench.Note("capture stop: %v", err)
	}
	return nil
}

// run is one round: pg_recvlogical, every capture mode, pg_recvlogical
// again.
func (b *backlogBench) run(ctx context.Context, run int) error {
	res := runResult{by: map[string]drainResult{}}
	first, err := b.recvlogical(ctx, run, 1)
	if err != nil {
		return err
	}
	var estimate time.Duration // for the server's profile: the last drain's length
	for _, mode := range b.modes {
		d, err := b.drain(ctx, b.slots[b.key(mode, run)], estimate)
		if err != nil {
			return err
		}
		estimate = d.total
		res.by[mode] = d
	}
	second, err := b.recvlogical(ctx, run, 2)
	if err != nil {
		return err
	}
	res.limit = max(first, second)
	p := fmt.Sprintf("capture.run%d.", run)
	bench.Figure(p+"pg_recvlogical_rows_per_sec", res.limit, "rows/s (the faster of its two runs: the limit)")
	bench.Figure(p+"load_average_1m", bench.Load1(), fmt.Sprintf("(at the run's end, on %d CPUs)", runtime.NumCPU()))
	for _, mode := range b.modes {
		d := res.by[mode]
		total := float64(b.n) / d.total.Seconds()
		bench.Figure(p+"ratio_"+mode+"_to_pg_recvlogical", total/res.limit, fmt.Sprintf("x (%.0f / %.0f rows/s, start-up included; target >= %.2f)", total, res.limit, target(mode)))
		bench.Figure(p+"ratio_"+mode+"_drain_to_pg_recvlogical", float64(b.n)/d.drain.Seconds()/res.limit, "x (first to last row, start-up excluded)")
	}
	b.results = append(b.results, res)
	return nil
}

// baseMode is the capture mode of a mode or variant ("external.dw10s":
// external).
func baseMode(mode string) string {
	base, _, _ := strings.Cut(mode, ".")
	return base
}

func target(mode string) float64 {
	if baseMode(mode) == modeEmbedded {
		return targetEmbedded
	}
	return targetExternal
}

// recvlogical drains a slot of the run with pg_recvlogical (pgoutput, the
// capture's publication) into a file until the end LSN and returns its
// rate.
func (b *backlogBench) recvlogical(ctx context.Context, run, i int) (float64, error) {
	slot := recvSlot(run, i)
	out := filepath.Join(b.dir, slot+".out")
	pub := b.slots[b.key(b.modes[0], run)].slot // every capture's publication has the same tables
	cmd := exec.CommandContext(ctx, filepath.Join(b.pg.BinDir, "pg_recvlogical"),
		"-d", b.url, "-S", slot, "--start", "-E", b.endLSN, "--no-loop",
		"-o", "proto_version=1", "-o", "publication_names="+pub, "-f", out)
	ws, err := bench.SampleWalsender(ctx, b.url, slot)
	if err != nil {
		return 0, err
	}
	start := time.Now()
	if out, err := cmd.CombinedOutput(); err != nil {
		ws()
		return 0, fmt.Errorf("pg_recvlogical: %w\n%s", err, out)
	}
	took := time.Since(start)
	walsender := ws()
	_ = os.Remove(out)
	p := fmt.Sprintf("capture.run%d.pg_recvlogical_%d_", run, i)
	rate := float64(b.n) / took.Seconds()
	bench.Figure(p+"rows_per_sec", rate, fmt.Sprintf("rows/s (%.2f s)", took.Seconds()))
	cpu := cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime()
	bench.Figure(p+"cpu_us_per_row", cpu.Seconds()*1e6/float64(b.n), fmt.Sprintf("µs (pg_recvlogical process, %.2f CPU-s)", cpu.Seconds()))
	bench.Figure(p+"walsender_cpu_us_per_row", walsender*1e6/float64(b.n), fmt.Sprintf("µs (the walsender decoding for it, %.2f CPU-s)", walsender))
	return rate, nil
}

// drain runs the capture until its stream holds every row and prints the
// drain's figures under capture.run<N>.<mode>_*.
func (b *backlogBench) drain(ctx context.Context, cs *captureSlot, estimate time.Duration) (d drainResult, err error) {
	defer discard(cs) // deferred first: runs after the processes are gone
	var srv *bench.Proc
	var profile chan error
	if baseMode(cs.mode) == modeExternal {
		port := 0
		if b.profileDir != "" && estimate > 0 {
			if port, err = freePort(); err != nil {
				return d, err
			}
		}
		if srv, err = b.startServer(cs, port); err != nil {
			return d, err
		}
		defer srv.Kill()
		if port > 0 {
			profile = make(chan error, 1)
			secs := int(estimate.Seconds()) + 2
			go func() {
				profile <- fetchProfile(ctx, port, secs, filepath.Join(b.profileDir, "nats-server-"+cs.slot+".pprof"))
			}()
		}
	}
	watch, err := bench.WatchStream("nats://"+cs.listen, "main", cs.watchOpts...)
	if err != nil {
		return d, err
	}
	defer watch.Close()
	srv0, srvFaults0 := procCPU(srv), procFaults(srv)
	ws, err := bench.SampleWalsender(ctx, b.url, cs.slot)
	if err != nil {
		return d, err
	}
	defer ws()
	env := cs.env
	if cs.profile != "" {
		env = append(slices.Clip(env), "EPITAPH_CPU_PROFILE="+cs.profile)
	}
	bin, env := b.binFor(env)
	p, err := bench.StartProc("capture-"+cs.slot, bin, env, b.dir)
	if err != nil {
		return d, err
	}
	defer p.Kill()
	first := time.Time{}
	alive := func() error {
		if done, err := p.Exited(); done {
			return fmt.Errorf("capture exited (%v):\n%s", err, p.LogTail(2000))
		}
		if first.IsZero() {
			if c, err := watch.Deletes(ctx); err == nil && c > 0 {
				first = time.Now()
			}
		}
		return nil
	}
	end, err := watch.WaitDeletes(ctx, b.n, 10*time.Minute, alive)
	if err != nil {
		return d, bench.Stalled(ctx, p, cs.metrics, err)
	}
	if first.IsZero() {
		first = end // the first poll saw every row
	}
	// The stream's own timestamps, where it has them: the polls above only
	// notice the first and last rows (a poll every 25 ms, and a watch of
	// the embedded server connects up to 200 ms after the server is up).
	if f, l, err := watch.DeleteTimes(ctx); err == nil {
		first, end = f, l
	} else {
		bench.Note("stream timestamps of %s: %v (polled times used)", cs.slot, err)
	}
	d.total, d.startup, d.drain = end.Sub(p.Started()), first.Sub(p.Started()), end.Sub(first)
	if m, err := bench.Scrape(ctx, cs.metrics); err == nil {
		// A backlog is drained in catch-up mode, on every CPU (cpumode.go).
		bench.Note("%s at the end of its drain: %v CPUs, catching up %v, %v CPU mode switches", cs.slot,
			m["epitaph_capture_cpus"], m["epitaph_capture_catching_up"], m["epitaph_capture_cpu_mode_switches_total"])
	}
	d.cpu = procCPU(p)
	d.serverCPU = procCPU(srv) - srv0
	d.faults, d.serverFaults = procFaults(p), procFaults(srv)-srvFaults0
	d.pgCPU = ws()
	d.peakRSS, _ = p.PeakRSS()
	if srv != nil {
		d.serverRSS, _ = srv.PeakRSS()
	}
	if err := p.Stop(30 * time.Second); err != nil {
		bench.Note("capture stop: %v", err)
	}
	if profile != nil {
		if err := <-profile; err != nil {
			bench.Note("nats-server profile: %v", err)
		}
	}
	b.print(cs, d)
	return d, nil
}

// discard removes a drained capture's stream files (its data dir, with the
// embedded broker's store, and the external server's store), as
// recvlogical removes pg_recvlogical's output file: nothing reads them
// again. Kept, every drain's ~300 MB stays in the page cache and each
// later drain writes into memory the kernel has not used before, which on
// this VM costs up to five times as much per byte as memory it has used
// (the host backs a guest page on its first touch: docs/benchmarks.md,
// "Twelfth session"), and each run of the bench came out slower than the
// one before it.
func discard(cs *captureSlot) {
	for _, dir := range []string{cs.dataDir, cs.storeDir} {
		if dir == "" {
			continue
		}
		if err := os.RemoveAll(dir); err != nil {
			bench.Note("remove %s: %v", dir, err)
		}
	}
}

func (b *backlogBench) print(cs *captureSlot, d drainResult) {
	p := fmt.Sprintf("capture.run%d.%s_", cs.run, cs.mode)
	n := float64(b.n)
	bench.Figure(p+"rows_per_sec", n/d.total.Seconds(), fmt.Sprintf("rows/s (process start to last row in the stream, %.2f s)", d.total.Seconds()))
	bench.Figure(p+"startup_seconds", d.startup.Seconds(), fmt.Sprintf("s (process start to the first row in the stream, %d ms; stored times)", d.startup.Milliseconds()))
	bench.Figure(p+"drain_rows_per_sec", n/d.drain.Seconds(), fmt.Sprintf("rows/s (first to last row, %.2f s)", d.drain.Seconds()))
	what := "capture process"
	if baseMode(cs.mode) != modeExternal {
		what = "capture process with its embedded server"
	}
	bench.Figure(p+"cpu_us_per_row", d.cpu*1e6/n, fmt.Sprintf("µs (%s, %.2f CPU-s)", what, d.cpu))
	bench.Figure(p+"faults_per_row", float64(d.faults)/n, fmt.Sprintf("minor page faults (%s, %d: memory it touched first)", what, d.faults))
	if baseMode(cs.mode) == modeExternal {
		bench.Figure(p+"server_cpu_us_per_row", d.serverCPU*1e6/n, fmt.Sprintf("µs (the nats-server process, %.2f CPU-s)", d.serverCPU))
		bench.Figure(p+"server_faults_per_row", float64(d.serverFaults)/n, fmt.Sprintf("minor page faults (the nats-server process, %d)", d.serverFaults))
		bench.Figure(p+"server_peak_rss_mib", float64(d.serverRSS)/(1<<20), "MiB")
	}
	bench.Figure(p+"walsender_cpu_us_per_row", d.pgCPU*1e6/n, fmt.Sprintf("µs (the walsender decoding for it, %.2f CPU-s)", d.pgCPU))
	bench.Figure(p+"peak_rss_mib", float64(d.peakRSS)/(1<<20), "MiB")
}

// summary prints the min and median over the runs of every ratio and CPU
// cost, beside the targets.
func (b *backlogBench) summary() {
	limits := make([]float64, 0, len(b.results))
	for _, r := range b.results {
		limits = append(limits, r.limit)
	}
	lo, med := minMedian(limits)
	bench.Figure("capture.pg_recvlogical_rows_per_sec.min", lo, "rows/s")
	bench.Figure("capture.pg_recvlogical_rows_per_sec.median", med, "rows/s")
	for _, mode := range b.modes {
		var ratio, drain, cpu, srv, ceiling []float64
		for _, r := range b.results {
			d := r.by[mode]
			ceiling = append(ceiling, ceilingRate(float64(b.n), d)/r.limit)
			ratio = append(ratio, float64(b.n)/d.total.Seconds()/r.limit)
			drain = append(drain, float64(b.n)/d.drain.Seconds()/r.limit)
			cpu = append(cpu, d.cpu*1e6/float64(b.n))
			srv = append(srv, d.serverCPU*1e6/float64(b.n))
		}
		lo, med := minMedian(ratio)
		t := target(mode)
		bench.Figure("capture.ratio_"+mode+"_to_pg_recvlogical.min", lo, fmt.Sprintf("x (over %d runs; target >= %.2f: %s)", len(ratio), t, met(lo >= t)))
		bench.Figure("capture.ratio_"+mode+"_to_pg_recvlogical.median", med, fmt.Sprintf("x (target >= %.2f: %s)", t, met(med >= t)))
		lo, med = minMedian(drain)
		bench.Figure("capture.ratio_"+mode+"_drain_to_pg_recvlogical.min", lo, "x (start-up excluded)")
		bench.Figure("capture.ratio_"+mode+"_drain_to_pg_recvlogical.median", med, "x (start-up excluded)")
		_, med = minMedian(cpu)
		bench.Figure("capture."+mode+"_cpu_us_per_row.median", med, "µs (the capture process)")
		if baseMode(mode) == modeExternal {
			_, med = minMedian(srv)
			bench.Figure("capture."+mode+"_server_cpu_us_per_row.median", med, "µs (the nats-server process)")
		}
		lo, med = minMedian(ceiling)
		bench.Figure("capture.ratio_"+mode+"_ceiling_on_these_cores.median", med, fmt.Sprintf(
			"x (min %.2f; the most the CPU the drain's processes spent per row allows on %d CPUs: min(CPUs / (walsender + capture + server CPU per row), 1 / walsender CPU per row) / pg_recvlogical; target >= %.2f %s here)",
			lo, runtime.NumCPU(), t, reachable(med >= t)))
	}
}

// ceilingRate is the fastest the drain d of n rows could run on this
// machine's CPUs with the CPU its processes spent: all of them busy all the
// time on the rows, and the walsender (one process, one thread) never
// waiting. A ratio above it needs less CPU per row, not better overlap.
func ceilingRate(n float64, d drainResult) float64 {
	total := (d.cpu + d.serverCPU + d.pgCPU) / n
	if total <= 0 {
		return 0
	}
	rate := float64(runtime.NumCPU()) / total
	if d.pgCPU > 0 {
		rate = min(rate, n/d.pgCPU)
	}
	return rate
}

func reachable(ok bool) string {
	if ok {
		return "reachable"
	}
	return "NOT reachable"
}

func met(ok bool) string {
	if ok {
		return "met"
	}
	return "NOT met"
}

func minMedian(v []float64) (lo, med float64) {
	if len(v) == 0 {
		return 0, 0
	}
	s := slices.Clone(v)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[0], s[len(s)/2]
	}
	return s[0], (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// procFaults is p's minor page faults (0 for no process).
func procFaults(p *bench.Proc) int64 {
	if p == nil {
		return 0
	}
	n, err := p.MinorFaults()
	if err != nil {
		bench.Note("page faults: %v", err)
	}
	return n
}

// procCPU is p's CPU seconds (0 for no process).
func procCPU(p *bench.Proc) float64 {
	if p == nil {
		return 0
	}
	c, _ := p.CPU()
	return c
}

func freePort() (int, error) {
	addr, err := bench.LocalAddr()
	if err != nil {
		return 0, err
	}
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		return 0, fmt.Errorf("free port: %w", err)
	}
	return strconv.Atoi(port)
}

// fetchProfile saves a CPU profile of secs seconds from a nats-server's
// pprof port.
func fetchProfile(ctx context.Context, port, secs int, path string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, fmt.Sprintf("http://127.0.0.1:%d/debug/pprof/profile?seconds=%d", port, secs), nil)
	if err != nil {
		return err
	}
	// The server may not listen yet: retry for a few seconds.
	var resp *http.Response
	for i := 0; ; i++ {
		if resp, err = http.DefaultClient.Do(req); err == nil || i == 50 {
			break
		}
		time.Sleep(20 * time.Millisecond) // polling the port with a bound
	}
	if err != nil {
		return fmt.Errorf("fetch profile: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("fetch profile: %s", resp.Status)
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, resp.Body); err != nil {
		f.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	return f.Close()
}

// binFor is the capture binary a drain runs and the environment it gets: a
// variant's BIN=PATH (e.g. -variant embedded.old:BIN=/tmp/capture-old)
// drains with another build of the capture in the same run; the rest run
// the binary the bench built.
func (b *backlogBench) binFor(env []string) (string, []string) {
	for i, kv := range env {
		if bin, ok := strings.CutPrefix(kv, "BIN="); ok {
			return bin, append(slices.Clip(env[:i]), env[i+1:]...)
		}
	}
	return b.captureBin, env
}
