package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/bench"
	"github.com/epitaph-dev/epitaph/internal/cpuprofile"
	"github.com/epitaph-dev/epitaph/internal/workload"
)

// e2eProfile: a CPU profile of this process (the JetStream server and the
// bench) from the first DELETE to the last archived row.
var e2eProfile = flag.String("e2e-cpuprofile", "", "write a CPU profile of the bench process (the JetStream server) during the end-to-end phase to this file")

// e2ePersist is the end-to-end capture's EPITAPH_STREAM_PERSIST (empty:
// its default, "default" against this external server).
var e2ePersist = flag.String("e2e-stream-persist", "", "EPITAPH_STREAM_PERSIST of the end-to-end phase's capture (async, default; empty: the capture's default)")

// endToEnd: capture and projector run together from before the first
// DELETE; the source deletes N rows; the rate is N over the time from the
// first DELETE to the last archived row. Each stage's progress is read
// afterwards from the data's own timestamps (the source commit time in
// every event, the time JetStream stored each transaction's commit events,
// the commit timestamp of the target transaction that archived each row),
// so the bench's polling does not blur it; the CPU of each process is
// sampled while it runs.
func (e *env) endToEnd(ctx context.Context, rows, perTx int, captureRate, applyRate float64) error {
	r, err := e.startE2E(ctx, rows)
	defer r.close()
	if err != nil {
		return err
	}
	conn, err := pgx.Connect(ctx, r.src)
	if err != nil {
		return fmt.Errorf("connect source: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	walsender, err := bench.Count(ctx, r.src, "SELECT coalesce(active_pid, 0) FROM pg_replication_slots WHERE slot_name = $1", e2eSlot)
	if err != nil {
		return fmt.Errorf("walsender pid: %w", err)
	}
	pids := []namedPID{
		{"delete", int(conn.PgConn().PID())}, {"walsender", int(walsender)},
		{"capture", r.capt.Pid()}, {"projector", r.procs[0].Pid()}, {"jetstream+bench", os.Getpid()},
	}
	// Each sample scans /proc for Postgres's backends (~5 ms of this
	// process's CPU): once a second.
	smp := e.startSampler(pids, time.Second)
	stopProfile, err := startProfile(*e2eProfile)
	if err != nil {
		smp.stop()
		return err
	}
	if e.pgStats {
		if err := pgStatsReset(ctx, r.target); err != nil {
			smp.stop()
			stopProfile()
			return err
		}
	}
	capCPU0, projCPU0, all0 := e.cpu(r.capt.Pid()), e.cpu(r.procs[0].Pid()), e.cpu(os.Getpid())
	m := e2eTimes{start: time.Now()}
	m.deleteTook, err = bench.DeleteAllOrdersOn(ctx, conn, perTx)
	smp.take() // the end of the deleting phase
	if err == nil {
		m.streamAt, err = r.watch.WaitDeletes(ctx, r.n, 10*time.Minute, exitedErr(r.capt))
		if err != nil {
			err = bench.Stalled(ctx, r.capt, r.metrics, err)
		}
	}
	if err == nil {
		m.archiveAt, err = waitArchive(ctx, archiveWait{targetURL: r.target, natsURL: e.natsURL, source: e2eSource, n: r.n,
			procs: append([]*bench.Proc{r.capt}, r.procs...), timeout: 15 * time.Minute})
	}
	samples := smp.stop()
	stopProfile()
	if err != nil {
		return err
	}
	cpu := e2eCPU{capture: e.cpu(r.capt.Pid()).sub(capCPU0), projector: e.cpu(r.procs[0].Pid()).sub(projCPU0), all: e.cpu(os.Getpid()).sub(all0)}
	tl, err := stageTimeline(ctx, r.watch, r.target, e2eSource)
	if err != nil {
		return err
	}
	if !tl.streamLast.IsZero() {
		m.streamAt = tl.streamLast // when it was stored, not when the poll saw it
	}
	m.report(r.n, tl, cpu, samples)
	if e.pgStats {
		if err := pgStatsPrint(ctx, r.target, "e2e"); err != nil {
			return err
		}
	}
	if captureRate > 0 && applyRate > 0 {
		bench.Note("standalone capture %.0f rows/s vs projector apply %.0f rows/s", captureRate, applyRate)
	}
	return nil
}

const e2eSource, e2eSlot = "e2e", "epitaph_e2e"

// e2eRun is the end-to-end phase's databases and processes, up and
// waiting for the first DELETE.
type e2eRun struct {
	src, target, metrics string
	n                    int64
	watch                *bench.StreamWatch
	capt                 *bench.Proc
	procs                []*bench.Proc
}

func (r *e2eRun) close() {
	for _, p := range r.procs {
		p.Kill()
	}
	if r.capt != nil {
		r.capt.Kill()
	}
	if r.watch != nil {
		r.watch.Close()
	}
}

// startE2E seeds the source, starts the capture (until its slot exists)
// and the projectors (until they own partitions).
func (e *env) startE2E(ctx context.Context, rows int) (*e2eRun, error) {
	r := &e2eRun{}
	var err error
	if r.src, err = bench.CreateDatabase(ctx, e.pg, "e2e_source"); err != nil {
		return r, err
	}
	if r.target, err = bench.CreateDatabase(ctx, e.pg, "e2e_target"); err != nil {
		return r, err
	}
	if err := workload.Setup(ctx, r.src); err != nil {
		return r, err
	}
	counts, err := workload.Seed(ctx, r.src, bench.ShopFor(rows))
	if err != nil {
		return r, err
	}
	r.n = counts.Total() - counts.Customers
	if r.metrics, err = bench.LocalAddr(); err != nil {
		return r, err
	}
	cenv := bench.CaptureEnv(r.src, e.natsURL, "", filepath.Join(e.dir, "e2e-capture-data"), r.metrics, e2eSource, e2eSlot)
	if *e2ePersist != "" {
		cenv = append(cenv, "EPITAPH_STREAM_PERSIST="+*e2ePersist)
		bench.Note("end to end: the capture's stream persist mode is %s", *e2ePersist)
	}
	if r.watch, err = bench.WatchStream(e.natsURL, e2eSource); err != nil {
		return r, err
	}
	// A session of its own, as a service runs (--tail-nice applies).
	if r.capt, err = bench.StartSessionProc("capture-e2e", e.bins["capture"], cenv, e.dir); err != nil {
		return r, err
	}
	if err := waitStream(ctx, r.capt, r.watch, r.src, e2eSlot); err != nil {
		return r, err
	}
	if err := e.migrate(ctx, r.target, e2eSource); err != nil {
		return r, err
	}
	if r.procs, err = e.startProjectors(ctx, r.target, e2eSource); err != nil {
		return r, err
	}
	// The projector is up when it owns partitions (progress rows exist).
	err = workload.WaitFor(ctx, 2*time.Minute, 100*time.Millisecond, func(ctx context.Context) (bool, error) {
		for _, p := range r.procs {
			if err := exitedErr(p)(); err != nil {
				return false, err
			}
		}
		c, err := bench.Count(ctx, r.target, "SELECT count(*) FROM epitaph.progress WHERE owner IS NOT NULL")
		return c > 0, err
	})
	if err != nil {
		bench.Note("projector ownership not visible (%v); measuring anyway", err)
	}
	return r, nil
}

// startProfile starts a CPU profile of this process into path (none when
// empty); the returned func stops it.
func startProfile(path string) (stop func(), err error) {
	if path == "" {
		return func() {}, nil
	}
	stop, err = cpuprofile.Start(path)
	if err != nil {
		return nil, fmt.Errorf("e2e cpu profile: %w", err)
	}
	return stop, nil
}

// e2eTimes are the end-to-end phase's moments.
type e2eTimes struct {
	start               time.Time
	deleteTook          time.Duration
	streamAt, archiveAt time.Time
}

// e2eCPU is the CPU the phase's processes used.
type e2eCPU struct{ capture, projector, all cpuTimes }

// report prints the phase's figures: rates, stages, CPU per process and
// per row, the ceiling that CPU allows, and the bottleneck.
func (m e2eTimes) report(n int64, tl timeline, c e2eCPU, samples []cpuSample) {
	start, streamAt, archiveAt := m.start, m.streamAt, m.archiveAt
	total := archiveAt.Sub(start)
	deletedAt := start.Add(m.deleteTook)
	bench.Figure("projector.e2e_rows", float64(n), "rows")
	bench.Figure("projector.e2e_source_delete_rows_per_sec", float64(n)/m.deleteTook.Seconds(), "rows/s (the DELETEs themselves)")
	bench.Figure("projector.e2e_capture_published_rows_per_sec", float64(n)/streamAt.Sub(start).Seconds(), "rows/s (first DELETE to last row in the stream)")
	bench.Figure("projector.e2e_rows_per_sec", float64(n)/total.Seconds(), "rows/s (first DELETE to last archived row; target >= 32,000)")
	bench.Figure("projector.e2e_capture_tail_seconds", streamAt.Sub(deletedAt).Seconds(), "s (last DELETE to last row in the stream)")
	bench.Figure("projector.e2e_projector_tail_seconds", archiveAt.Sub(streamAt).Seconds(), "s (last row in the stream to last archived row)")
	tl.report(start, n)
	wall := total.Seconds()
	all := c.all
	bench.Figure("projector.e2e_cpu_seconds.postgres", all.postgres, "s (source and target: DELETEs, WAL decoding, archive writes)")
	bench.Figure("projector.e2e_cpu_seconds.capture", c.capture.proc, "s")
	bench.Figure("projector.e2e_cpu_seconds.projector", c.projector.proc, "s")
	bench.Figure("projector.e2e_cpu_seconds.bench_and_jetstream", all.proc, "s (this process: the JetStream server and the bench)")
	used := all.postgres + c.capture.proc + c.projector.proc + all.proc
	cpus := float64(runtime.NumCPU())
	// A share of the machine: 0.95 is 1.9 of 2 CPUs busy with the
	// pipeline's own processes (not 0.95 of one CPU).
	bench.Figure("projector.e2e_cpu_busy", used/(wall*cpus), fmt.Sprintf("share of the %d CPUs used by the pipeline over %.1f s (the rest: other load on the machine, idle)", runtime.NumCPU(), wall))
	bench.Figure("projector.e2e_cpus_busy", used/wall, fmt.Sprintf("CPUs of %d, on average, used by the pipeline's processes", runtime.NumCPU()))
	perRow := func(name string, secs float64, what string) {
		bench.Figure("projector.e2e_cpu_us_per_row."+name, secs/float64(n)*1e6, "µs of CPU per row ("+what+")")
	}
	perRow("total", used, "every process of the pipeline")
	perRow("postgres", all.postgres, "source and target")
	perRow("projector", c.projector.proc, "the projector process")
	perRow("capture", c.capture.proc, "the capture process")
	perRow("jetstream_bench", all.proc, "the JetStream server and the bench")
	// If every CPU did nothing but this pipeline at this cost per row.
	bench.Figure("projector.e2e_cpu_ceiling_rows_per_sec", cpus*float64(n)/used, fmt.Sprintf("rows/s (%d CPUs / the CPU per row measured: the rate with every CPU busy; target 32,000)", runtime.NumCPU()))
	reportSamples(samples, start, deletedAt, archiveAt)
	e2eBottleneck(start, deletedAt, streamAt, archiveAt, samples)
}

// e2eBottleneck names the stage that sets the pace: the one that finishes
// furthest behind the one feeding it, or the source when both follow it
// closely (the source then runs alone on one connection).
func e2eBottleneck(start, deletedAt, streamAt, archiveAt time.Time, samples []cpuSample) {
	stage := "source (the DELETEs themselves: one connection, one statement at a time)"
	tailCap, tailProj := streamAt.Sub(deletedAt), archiveAt.Sub(streamAt)
	switch {
	case tailProj > tailCap && tailProj > time.Second:
		stage = "projector (apply)"
	case tailCap > time.Second:
		stage = "capture (publish)"
	}
	del := windowCPU(samples, "delete", start, deletedAt)
	bench.Note("end-to-end bottleneck: %s; while deleting, the DELETE backend used %.2f of a CPU, the machine %.2f of %d",
		stage, del, windowMachine(samples, start, deletedAt), runtime.NumCPU())
}

// namedPID is a process the sampler watches.
type namedPID struct {
	name string
	pid  int
}

// cpuSample is the CPU seconds used so far by each watched process, by
// Postgres as a whole and by the machine (busy of total, in seconds of
// one CPU), at a time.
type cpuSample struct {
	at          time.Time
	proc        map[string]float64
	postgres    float64
	busy, total float64
}

type sampler struct {
	take  func() // one sample now
	stopc chan struct{}
	wg    sync.WaitGroup
	mu    sync.Mutex
	out   []cpuSample
}

// startSampler reads the CPU of pids, Postgres and the machine every
// interval until stop.
func (e *env) startSampler(pids []namedPID, interval time.Duration) *sampler {
	s := &sampler{stopc: make(chan struct{})}
	take := func() {
		c := cpuSample{at: time.Now(), proc: map[string]float64{}}
		for _, p := range pids {
			if p.pid > 0 {
				c.proc[p.name], _ = procCPU(p.pid)
			}
		}
		c.postgres = e.cpu(0).postgres
		busy, total, err := cpuBusy()
		if err == nil {
			// ticks of all CPUs -> seconds of one CPU (USER_HZ 100)
			c.busy, c.total = busy/100, total/100
		}
		s.mu.Lock()
		s.out = append(s.out, c)
		s.mu.Unlock()
	}
	s.take = take
	take()
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			select {
			case <-s.stopc:
				take()
				return
			case <-t.C:
				take()
			}
		}
	}()
	return s
}

func (s *sampler) stop() []cpuSample {
	close(s.stopc)
	s.wg.Wait()
	return s.out
}

// window is the first and last sample within [from, to].
func window(samples []cpuSample, from, to time.Time) (a, b cpuSample, ok bool) {
	i := slices.IndexFunc(samples, func(c cpuSample) bool { return !c.at.Before(from) })
	j := -1
	for k := len(samples) - 1; k >= 0; k-- {
		if !samples[k].at.After(to) {
			j = k
			break
		}
	}
	if i < 0 || j <= i {
		return a, b, false
	}
	return samples[i], samples[j], true
}

// windowCPU is the share of one CPU process name used over [from, to].
func windowCPU(samples []cpuSample, name string, from, to time.Time) float64 {
	a, b, ok := window(samples, from, to)
	if !ok {
		return 0
	}
	return (b.proc[name] - a.proc[name]) / b.at.Sub(a.at).Seconds()
}

// windowMachine is how many of the machine's CPUs were busy over [from, to].
func windowMachine(samples []cpuSample, from, to time.Time) float64 {
	a, b, ok := window(samples, from, to)
	if !ok || b.total <= a.total {
		return 0
	}
	return float64(runtime.NumCPU()) * (b.busy - a.busy) / (b.total - a.total)
}

// reportSamples prints, per phase (while deleting, after), each process's
// share of a CPU and the machine's busy CPUs, and a line per second.
func reportSamples(samples []cpuSample, start, deletedAt, end time.Time) {
	names := []string{"delete", "walsender", "capture", "projector", "jetstream+bench"}
	phase := func(label string, from, to time.Time) {
		a, b, ok := window(samples, from, to)
		if !ok {
			return
		}
		secs := b.at.Sub(a.at).Seconds()
		var parts []string
		own := 0.0
		for _, nm := range names {
			v := (b.proc[nm] - a.proc[nm]) / secs
			if nm == "delete" || nm == "walsender" {
				own += v
			}
			parts = append(parts, fmt.Sprintf("%s %.2f", nm, v))
		}
		parts = append(parts, fmt.Sprintf("other postgres %.2f", (b.postgres-a.postgres)/secs-own))
		bench.Note("e2e cpu %s (%.1f s): %s; machine %.2f of %d CPUs busy", label, secs, strings.Join(parts, ", "),
			windowMachine(samples, from, to), runtime.NumCPU())
		for _, nm := range names {
			bench.Figure("projector.e2e_cpu_share."+label+"."+strings.ReplaceAll(nm, "+", "_"), (b.proc[nm]-a.proc[nm])/secs, "of one CPU")
		}
		bench.Figure("projector.e2e_cpu_share."+label+".machine", windowMachine(samples, from, to), fmt.Sprintf("of %d CPUs (the whole machine, other load included)", runtime.NumCPU()))
	}
	phase("deleting", start, deletedAt)
	phase("after_deleting", deletedAt, end)
}

// txTimes are one source transaction's times through the stages.
type txTimes struct {
	rows      int64
	committed time.Time // source commit (the events' commit_time)
	stored    time.Time // the last of its commit events stored in the stream
	archived  time.Time // the last target commit that wrote its rows
}

// timeline is every transaction of the e2e stream by commit LSN.
type timeline struct {
	txs                       []txTimes
	streamFirst, streamLast   time.Time
	sourceFirst, sourceLast   time.Time
	archiveFirst, archiveLast time.Time
	missingStored             int
	rows                      int64 // archived
	applyTxs                  int64 // target transactions that wrote the archive rows
	// archive_v1.rows' write statistics (pg_stat_user_tables)
	inserted, updated, hotUpdated, deleted int64
}

// stageTimeline reads when each transaction was stored in the stream (its
// commit events) and archived (the commit timestamp of the rows' xmin:
// track_commit_timestamp is on).
func stageTimeline(ctx context.Context, watch *bench.StreamWatch, targetURL, source string) (timeline, error) {
	var tl timeline
	stored, err := commitsStored(ctx, watch, source)
	if err != nil {
		return tl, err
	}
	conn, err := pgx.Connect(ctx, targetURL)
	if err != nil {
		return tl, err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	rows, err := conn.Query(ctx, `SELECT commit_lsn::text, count(*), min(commit_time), max(pg_xact_commit_timestamp(xmin))
		FROM archive_v1.rows WHERE source = $1 GROUP BY commit_lsn ORDER BY commit_lsn`, source)
	if err != nil {
		return tl, fmt.Errorf("archive timeline: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var lsn string
		var t txTimes
		if err := rows.Scan(&lsn, &t.rows, &t.committed, &t.archived); err != nil {
			return tl, fmt.Errorf("archive timeline: %w", err)
		}
		t.stored = stored[lsn]
		tl.add(t)
		tl.rows += t.rows
	}
	if err := rows.Err(); err != nil {
		return tl, fmt.Errorf("archive timeline: %w", err)
	}
	// The rows' writes: a row written unverified or without its root flag
	// and set at its transaction's commit is written twice. The counters
	// reach the statistics once each backend flushes them (within ~1 s of
	// its last transaction): wait for the inserts to show.
	err = workload.WaitFor(ctx, 30*time.Second, 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		// Summed over the partitions (a partitioned table has no counters).
		err := conn.QueryRow(ctx, `SELECT COALESCE(sum(n_tup_ins), 0)::bigint, COALESCE(sum(n_tup_upd), 0)::bigint,
			COALESCE(sum(n_tup_hot_upd), 0)::bigint, COALESCE(sum(n_tup_del), 0)::bigint FROM pg_stat_user_tables
			WHERE relid IN (SELECT relid FROM pg_partition_tree('archive_v1.rows') WHERE isleaf)`).Scan(&tl.inserted, &tl.updated, &tl.hotUpdated, &tl.deleted)
		return tl.inserted >= tl.rows, err
	})
	if err != nil {
		bench.Note("archive write statistics: %v", err)
	}
	// The target transactions whose rows remain (a row rewritten later
	// counts for the later one).
	err = conn.QueryRow(ctx, `SELECT count(DISTINCT xmin::text) FROM archive_v1.rows WHERE source = $1`, source).Scan(&tl.applyTxs)
	if err != nil {
		return tl, fmt.Errorf("archive transactions: %w", err)
	}
	return tl, nil
}

func (tl *timeline) add(t txTimes) {
	first := func(a *time.Time, b time.Time) {
		if !b.IsZero() && (a.IsZero() || b.Before(*a)) {
			*a = b
		}
	}
	last := func(a *time.Time, b time.Time) {
		if b.After(*a) {
			*a = b
		}
	}
	first(&tl.sourceFirst, t.committed)
	last(&tl.sourceLast, t.committed)
	first(&tl.streamFirst, t.stored)
	last(&tl.streamLast, t.stored)
	first(&tl.archiveFirst, t.archived)
	last(&tl.archiveLast, t.archived)
	if t.stored.IsZero() {
		tl.missingStored++
	}
	tl.txs = append(tl.txs, t)
}

// commitsStored is, by commit LSN, when the last of a transaction's commit
// events (one per partition it touched) was stored in the stream.
func commitsStored(ctx context.Context, watch *bench.StreamWatch, source string) (map[string]time.Time, error) {
	stream, err := watch.JetStream().Stream(ctx, event.StreamName(source))
	if err != nil {
		return nil, fmt.Errorf("stream: %w", err)
	}
	cctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	cons, err := stream.OrderedConsumer(cctx, jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{event.SubjectPrefix + "." + source + ".*.commit"},
		DeliverPolicy:  jetstream.DeliverAllPolicy,
	})
	if err != nil {
		return nil, fmt.Errorf("ordered consumer: %w", err)
	}
	out := map[string]time.Time{}
	for {
		fctx, fcancel := context.WithTimeout(cctx, 5*time.Second)
		batch, err := cons.Fetch(1000, jetstream.FetchContext(fctx))
		if err != nil {
			fcancel()
			return nil, fmt.Errorf("fetch commit events: %w", err)
		}
		pending := uint64(1)
		got := 0
		for m := range batch.Messages() {
			got++
			md, err := m.Metadata()
			if err != nil {
				fcancel()
				return nil, fmt.Errorf("commit event metadata: %w", err)
			}
			pending = md.NumPending
			ev, err := event.Decode(m.Data())
			if err != nil {
				fcancel()
				return nil, fmt.Errorf("commit event %d: %w", md.Sequence.Stream, err)
			}
			k := ev.CommitLSN.String()
			if md.Timestamp.After(out[k]) {
				out[k] = md.Timestamp
			}
		}
		err = batch.Error()
		fcancel()
		if err != nil && !errors.Is(err, context.DeadlineExceeded) {
			return nil, fmt.Errorf("fetch commit events: %w", err)
		}
		if pending == 0 || got == 0 {
			return out, nil
		}
	}
}

// report prints each stage's first and last time (from start), its rate
// between them, how far each stage was behind the one feeding it per
// transaction (p50, p90, max), and the rows each stage had done at each
// second.
func (tl timeline) report(start time.Time, n int64) {
	if len(tl.txs) == 0 {
		bench.Note("e2e timeline: no archived transactions")
		return
	}
	rel := func(t time.Time) float64 { return t.Sub(start).Seconds() }
	stage := func(name string, a, b time.Time, what string) {
		bench.Figure("projector.e2e_stage."+name+"_first_seconds", rel(a), "s after the first DELETE ("+what+", the first transaction)")
		bench.Figure("projector.e2e_stage."+name+"_last_seconds", rel(b), "s after the first DELETE (the last transaction)")
		if b.After(a) {
			bench.Figure("projector.e2e_stage."+name+"_rows_per_sec", float64(n)/b.Sub(a).Seconds(), "rows/s between its first and last transaction")
		}
	}
	stage("source_commit", tl.sourceFirst, tl.sourceLast, "source commit times")
	stage("stream_stored", tl.streamFirst, tl.streamLast, "commit events stored in JetStream")
	stage("archived", tl.archiveFirst, tl.archiveLast, "target commits of the archive rows")
	var capLag, projLag []float64
	for _, t := range tl.txs {
		if t.stored.IsZero() {
			continue
		}
		capLag = append(capLag, t.stored.Sub(t.committed).Seconds())
		projLag = append(projLag, t.archived.Sub(t.stored).Seconds())
	}
	lag := func(name string, xs []float64, what string) {
		if len(xs) == 0 {
			return
		}
		s := slices.Clone(xs)
		slices.Sort(s)
		q := func(p float64) float64 { return s[min(len(s)-1, int(p*float64(len(s))))] }
		bench.Figure("projector.e2e_lag."+name+"_p50_seconds", q(0.5), "s per transaction, "+what)
		bench.Figure("projector.e2e_lag."+name+"_p90_seconds", q(0.9), "s")
		bench.Figure("projector.e2e_lag."+name+"_max_seconds", s[len(s)-1], "s")
		bench.Figure("projector.e2e_lag."+name+"_last_tx_seconds", xs[len(xs)-1], "s (the last transaction)")
	}
	if tl.applyTxs > 0 {
		bench.Figure("projector.e2e_apply_transactions", float64(tl.applyTxs), fmt.Sprintf("target transactions holding the archive rows (%.0f rows each; %d source transactions)", float64(n)/float64(tl.applyTxs), len(tl.txs)))
	}
	bench.Figure("projector.e2e_archive_rows_inserted", float64(tl.inserted), "row inserts into archive_v1.rows (pg_stat_user_tables)")
	bench.Figure("projector.e2e_archive_rows_updated", float64(tl.updated), fmt.Sprintf("row updates (%.2f per row; %d HOT; %d deletes): rows written twice", float64(tl.updated)/float64(n), tl.hotUpdated, tl.deleted))
	lag("capture", capLag, "source commit to its commit events stored")
	lag("projector", projLag, "stored to its rows archived")
	if tl.missingStored > 0 {
		bench.Note("e2e timeline: %d transactions without a commit event found in the stream", tl.missingStored)
	}
	// Rows done by each stage at each second.
	end := tl.archiveLast
	for _, t := range []time.Time{tl.streamLast, tl.sourceLast} {
		if t.After(end) {
			end = t
		}
	}
	for sec := 1.0; ; sec++ {
		at := start.Add(time.Duration(sec * float64(time.Second)))
		var c, s, a int64
		for _, t := range tl.txs {
			if !t.committed.After(at) {
				c += t.rows
			}
			if !t.stored.IsZero() && !t.stored.After(at) {
				s += t.rows
			}
			if !t.archived.After(at) {
				a += t.rows
			}
		}
		bench.Note("e2e at %4.0f s: committed %7d, in the stream %7d, archived %7d rows", sec, c, s, a)
		if at.After(end) {
			break
		}
	}
}
