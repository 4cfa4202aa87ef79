// Command projector is `make bench-projector`. On one throwaway Postgres and
// an embedded JetStream server it measures:
//
//  1. raw: COPY of N archive rows into a staging table plus one
//     INSERT .. SELECT into a table shaped like archive_v1.rows (same
//     indexes): the write limit of the target here;
//  2. apply: the projector binary applying a stream of the same N delete
//     events from scratch, until archive.rows holds N rows;
//  3. snapshots: the apply again with public.orders as snapshot root, on
//     the same stream (transactions of -orders-per-tx orders, 701 events:
//     a partition that is behind applies up to two pages cut at a commit,
//     so they are assembled in the apply transaction), on a stream of
//     -snapshot-orders-per-tx orders per transaction (the same, many more
//     commits), and on the same stream with 400-event pages (every
//     transaction spans pages: the batcher assembles them), each as
//     -snapshot-pairs interleaved pairs of applies with and without
//     snapshots in the same page size (the order alternating from pair to
//     pair): each pair's rate ratio, their median and min, the CPU the
//     documents added (projector and Postgres, per document), how long
//     after the last archived row the last document is
//     complete, and per document the time from its commit being applied
//     to complete (by commit timestamps: the apply transaction that
//     applied the commit, the transaction that wrote the document; p50,
//     p99, max); -snapshot-cases picks the cases;
//  4. end to end: capture and projector running together while the source
//     deletes N rows, from the first DELETE to the last archived row, with
//     the bottleneck named.
//
// Output lines are "BENCH <name> <value> <unit>" and "NOTE <text>".
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/bench"
	"github.com/epitaph-dev/epitaph/internal/broker"
	"github.com/epitaph-dev/epitaph/internal/cpuprofile"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/internal/workload"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection"
	"github.com/epitaph-dev/epitaph/projection/version"
)

type env struct {
	pg      *testenv.Postgres
	dir     string
	bins    map[string]string
	natsURL string
	workers int

	inProcess  bool
	cpuProfile string
	suffix     string // of figure names: the round
	// snapshotRoots, when set, is EPITAPH_SNAPSHOT_ROOTS of the projectors.
	snapshotRoots string
	// pageSize, when set, is EPITAPH_BATCH_SIZE of the projectors.
	pageSize int
	// afterArchive, when set, runs once the archive holds every row, with
	// the projectors still running.
	afterArchive func(ctx context.Context, targetURL string, end time.Time) error
	// beforeStart, when set, runs after the migration, before the
	// projectors start (handlers.go adds the row handlers).
	beforeStart func(ctx context.Context, targetURL string) error
	// procs and metricsAddrs: the projectors of the running apply and
	// their metrics listeners (for afterArchive).
	procs        []*bench.Proc
	metricsAddrs []string
	// handlerParallelism, when set, is EPITAPH_HANDLER_PARALLELISM.
	handlerParallelism int
	// handlerBatch is the handlers round's webhook --batch-size (0 or 1:
	// one POST per delivery).
	handlerBatch int
	// handlersProfile, when set, is the path prefix of the handlers
	// rounds' projector CPU profiles (-handlers-cpuprofile).
	handlersProfile string
	// revalidate: the row handlers revalidate against sourceURL, the
	// projectors' EPITAPH_SOURCE_URL (revalidate.go).
	revalidate bool
	sourceURL  string
	// pgStats: pg_stat_statements is loaded (-pgstats); the snapshot phase
	// and the handlers round print their statements too.
	pgStats bool
	// snapPairs is -snapshot-pairs; lastCPU the CPU seconds of the last
	// apply (projector process, Postgres), for the snapshot phase.
	snapPairs int
	lastCPU   cpuTimes
	// lastBusy: how many of the machine's CPUs were busy (every process)
	// during the last apply, from /proc/stat over the same window as
	// lastCPU (0 in-process).
	lastBusy float64
}

// figure prints a figure of the current round.
func (e *env) figure(name string, value float64, unit string) {
	bench.Figure(name+e.suffix, value, unit)
}

func main() {
	if os.Getenv(floorEnv) != "" {
		// A child of the handlers phase: the webhook floor's client.
		os.Exit(floorClient())
	}
	rows := flag.Int("rows", 300_000, "delete events (at least)")
	perTx := flag.Int("orders-per-tx", 100, "orders per cascading delete transaction (7 rows each)")
	workers := flag.Int("workers", 1, "projector workers")
	keep := flag.Bool("keep", false, "keep the temporary directory (logs, stores)")
	batch := flag.Int("batch", 500, "rows per raw COPY + INSERT..SELECT transaction (the projector's page size)")
	rounds := flag.Int("rounds", 3, "rounds of raw + apply (each into fresh databases); the medians are reported")
	skipE2E := flag.Bool("skip-e2e", false, "measure raw and apply only")
	onlyE2E := flag.Bool("only-e2e", false, "measure the end-to-end phase only (no backlog stream, rounds, snapshots or worker curve)")
	inProcess := flag.Bool("in-process", false, "run the projector inside the bench (one worker) instead of the binary")
	compareBin := flag.String("compare-bin", "", "also apply with this projector binary in every round (after the main one), to compare builds on the same rows and load")
	projectorBin := flag.String("projector-bin", "", "use this projector binary instead of building ./cmd/projector (e.g. an older build to compare)")
	pgStats := flag.Bool("pgstats", false, "load pg_stat_statements and print the statements that took the most time during apply and raw")
	cpuProfile := flag.String("cpuprofile", "", "write a CPU profile of the in-process apply to this file (implies -in-process)")
	skipSnapshots := flag.Bool("skip-snapshots", false, "skip the snapshot phase")
	snapPerTx := flag.Int("snapshot-orders-per-tx", 10, "orders per transaction of the snapshot phase's second stream (transactions that fit in a page)")
	snapPairs := flag.Int("snapshot-pairs", 3, "with/without apply pairs per snapshot case, interleaved (each pair's ratio, the median and the min are printed)")
	snapCases := flag.String("snapshot-cases", "bench,snap,spanning", "the snapshot phase's cases to run (comma-separated): bench (the main stream), snap (the -snapshot-orders-per-tx stream), spanning (the main stream in 400-event pages: every transaction spans pages, assembled from the archive)")
	handlers := flag.Bool("handlers", false, "also run the row handlers phase (make bench-handlers): a webhook handler on every table")
	handlersProfile := flag.String("handlers-cpuprofile", "", "path prefix: the handlers rounds' projectors write CPU profiles (projector run --cpu-profile) to <prefix>.handlers.p<N>[.revalidate...].<i>.prof")
	handlerPar := flag.String("handler-parallelism", "4,16", "the row handlers phase runs once per value (comma-separated)")
	handlerBatch := flag.String("handler-batch", "1", "the row handlers phase runs once per webhook batch size (comma-separated; --batch-size of the handlers)")
	curve := flag.String("worker-curve", "1,2,4", "apply the same stream with this many projector processes each (comma-separated; empty skips): the scaling figures")
	flag.Parse()
	o := opts{rows: *rows, perTx: *perTx, workers: *workers, keep: *keep, batch: *batch, skipE2E: *skipE2E, onlyE2E: *onlyE2E,
		skipSnapshots: *skipSnapshots, snapPerTx: *snapPerTx, snapPairs: max(1, *snapPairs), snapCases: map[string]bool{}, handlers: *handlers, handlerPar: *handlerPar, handlerBatch: *handlerBatch,
		inProcess: *inProcess || *cpuProfile != "", cpuProfile: *cpuProfile, pgStats: *pgStats, projectorBin: *projectorBin, compareBin: *compareBin, rounds: max(1, *rounds)}
	for _, c := range strings.Split(*snapCases, ",") {
		switch c = strings.TrimSpace(c); c {
		case "bench", "snap", "spanning":
			o.snapCases[c] = true
		case "":
		default:
			log.Fatalf("bench-projector: -snapshot-cases %q: want bench, snap or spanning", *snapCases)
		}
	}
	for _, w := range strings.Split(*curve, ",") {
		if w = strings.TrimSpace(w); w == "" {
			continue
		}
		k, err := strconv.Atoi(w)
		if err != nil || k < 1 {
			log.Fatalf("bench-projector: -worker-curve %q: want positive worker counts", *curve)
		}
		o.curve = append(o.curve, k)
	}
	o.handlersProfile = *handlersProfile
	if err := run(o); err != nil {
		log.Fatalf("bench-projector: %v", err)
	}
}

type opts struct {
	rows, perTx, workers, batch int
	snapPerTx, snapPairs        int
	snapCases                   map[string]bool
	skipSnapshots               bool
	handlers                    bool
	handlerPar                  string
	handlerBatch                string
	rounds                      int
	keep, skipE2E, inProcess    bool
	onlyE2E                     bool
	pgStats                     bool
	cpuProfile, projectorBin    string
	compareBin                  string
	curve                       []int
	handlersProfile             string
}

func run(o opts) (err error) {
	rows, perTx, workers, keep := o.rows, o.perTx, o.workers, o.keep
	ctx := context.Background()
	bench.LoadNote("at start")
	defer bench.LoadNote("at end")
	dir, err := bench.TempDir("epitaph-bench-projector-")
	if err != nil {
		return err
	}
	defer func() {
		if keep || err != nil {
			bench.Note("work dir kept: %s", dir)
			return
		}
		os.RemoveAll(dir)
	}()
	bins, err := bench.Build(ctx, dir, "capture", "projector")
	if err != nil {
		return err
	}
	if o.projectorBin != "" {
		bins["projector"] = o.projectorBin
	}
	pg, err := testenv.StartPostgres()
	if err != nil {
		return err
	}
	defer func() {
		_ = pg.Stop()
		_ = os.RemoveAll(filepath.Dir(pg.DataDir))
	}()
	// Commit timestamps: a document's delay is from the commit of the
	// apply transaction that applied its group's commit to the commit of
	// the transaction that wrote it complete.
	conf := []string{"track_commit_timestamp = on"}
	if o.pgStats {
		conf = append(conf, "shared_preload_libraries = 'pg_stat_statements'", "pg_stat_statements.track = all")
	}
	if err := pg.SetConfig(conf...); err != nil {
		return err
	}
	if err := pg.Restart(); err != nil {
		return err
	}
	listen, err := bench.LocalAddr()
	if err != nil {
		return err
	}
	srv, err := broker.Start(broker.Config{StoreDir: filepath.Join(dir, "jetstream"), Listen: listen})
	if err != nil {
		return err
	}
	defer srv.Shutdown()
	e := &env{pg: pg, dir: dir, bins: bins, natsURL: "nats://" + listen, workers: workers,
		inProcess: o.inProcess, cpuProfile: o.cpuProfile, pgStats: o.pgStats, snapPairs: o.snapPairs, handlersProfile: o.handlersProfile}
	bench.Note("postgres %s, jetstream %s, %d projector worker(s)", pg.BinDir, e.natsURL, workers)
	if o.onlyE2E {
		return e.endToEnd(ctx, rows, perTx, 0, 0)
	}

	// The stream: a backlog of N deletes drained by the capture.
	n, captureRate, err := e.buildStream(ctx, "bench", rows, perTx)
	if err != nil {
		return err
	}
	events, err := workload.StreamDeletes(ctx, e.natsURL, "bench")
	if err != nil {
		return err
	}
	if int64(len(events)) < n {
		return fmt.Errorf("read %d delete events from the stream, want %d", len(events), n)
	}
	orders := rootRows(events)
	// The snapshot phase's second stream: small transactions.
	var snapN int64
	if !o.skipSnapshots && o.snapCases["snap"] {
		if snapN, _, err = e.buildStream(ctx, "snap", rows, o.snapPerTx); err != nil {
			return err
		}
	}
	// Rounds of 1. raw writes and 2. apply of the same rows, each into a
	// fresh database; on a shared machine the median is the figure.
	res := &roundResults{snaps: map[string][]float64{}}
	for r := 1; r <= o.rounds; r++ {
		if err := e.round(ctx, o, r, backlog{events: events, n: n, snapN: snapN, orders: orders}, res); err != nil {
			return err
		}
	}
	applyRate := e.reportRounds(o, res)
	if err := e.workerCurve(ctx, o.curve, n); err != nil {
		return err
	}
	if o.skipE2E {
		return nil
	}
	// 4. end to end.
	return e.endToEnd(ctx, rows, perTx, captureRate, applyRate)
}

// roundResults gathers the figures of run's rounds.
type roundResults struct {
	raws, applies, ratios, compares []float64
	snaps                           map[string][]float64 // "name|unit" -> one figure a round
}

// backlog is what a round applies: the n events of stream "bench"
// (orders of them snapshot roots) and the snapN deletes of stream "snap".
type backlog struct {
	events           []*event.Event
	n, snapN, orders int64
}

// round is run's round r: raw writes and apply of the n backlog events,
// the snapshot phases, and the -compare-bin apply.
func (e *env) round(ctx context.Context, o opts, r int, in backlog, res *roundResults) error {
	if o.rounds > 1 {
		e.suffix = fmt.Sprintf(".round%d", r)
	}
	rawURL, err := bench.CreateDatabase(ctx, e.pg, fmt.Sprintf("raw_%d", r))
	if err != nil {
		return err
	}
	targetURL, err := bench.CreateDatabase(ctx, e.pg, fmt.Sprintf("target_%d", r))
	if err != nil {
		return err
	}
	if o.pgStats {
		if err := pgStatsReset(ctx, rawURL); err != nil {
			return err
		}
	}
	rawRate, err := e.raw(ctx, rawURL, in.events, o.batch)
	if err != nil {
		return err
	}
	if o.pgStats {
		if err := pgStatsPrint(ctx, rawURL, "raw"); err != nil {
			return err
		}
		if err := pgStatsReset(ctx, targetURL); err != nil {
			return err
		}
	}
	// A finished phase's database is dropped: its autovacuum and its
	// pages in shared buffers would be charged to the next phase.
	if err := dropDatabase(ctx, e.pg, rawURL); err != nil {
		return err
	}
	applyRate, err := e.apply(ctx, targetURL, "bench", in.n)
	if err != nil {
		return err
	}
	plain := plainApply{rate: applyRate, cpu: e.lastCPU, secs: float64(in.n) / applyRate, busy: e.lastBusy}
	if o.pgStats {
		if err := pgStatsPrint(ctx, targetURL, "apply"); err != nil {
			return err
		}
	}
	if err := dropDatabase(ctx, e.pg, targetURL); err != nil {
		return err
	}
	e.figure("projector.ratio_apply_to_raw", applyRate/rawRate, "x (target >= 0.70)")
	res.raws, res.applies, res.ratios = append(res.raws, rawRate), append(res.applies, applyRate), append(res.ratios, applyRate/rawRate)
	if !o.skipSnapshots {
		if err := e.snapshotRounds(ctx, o, r, in, res.snaps); err != nil {
			return err
		}
	}
	if o.handlers {
		if err := e.handlersRounds(ctx, o, r, in, plain, res); err != nil {
			return err
		}
	}
	if o.compareBin != "" {
		// The same round with another projector build.
		url, err := bench.CreateDatabase(ctx, e.pg, fmt.Sprintf("target_b_%d", r))
		if err != nil {
			return err
		}
		own := e.bins["projector"]
		e.bins["projector"], e.suffix = o.compareBin, e.suffix+".compare"
		rate, err := e.apply(ctx, url, "bench", in.n)
		e.bins["projector"], e.suffix = own, strings.TrimSuffix(e.suffix, ".compare")
		if err != nil {
			return err
		}
		if err := dropDatabase(ctx, e.pg, url); err != nil {
			return err
		}
		e.figure("projector.ratio_apply_to_raw.compare", rate/rawRate, "x (the -compare-bin build)")
		res.compares = append(res.compares, rate/rawRate)
	}
	return nil
}

// handlersRounds is round r's row handlers phase, once per
// -handler-parallelism value and -handler-batch size; the revalidation
// round runs beside the unbatched one.
func (e *env) handlersRounds(ctx context.Context, o opts, r int, in backlog, plain plainApply, res *roundResults) error {
	pars, err := positives("-handler-parallelism", o.handlerPar)
	if err != nil {
		return err
	}
	batches, err := positives("-handler-batch", o.handlerBatch)
	if err != nil {
		return err
	}
	for _, p := range pars {
		for _, b := range batches {
			e.handlerBatch = b
			c := handlersCase{round: r, parallelism: p, source: "bench", n: in.n, tables: eventTables(in.events), plain: plain}
			rate, err := e.handlersRound(ctx, c, res.snaps)
			e.handlerBatch = 0
			if err != nil {
				return err
			}
			if b > 1 {
				continue
			}
			if err := e.revalidationRound(ctx, c, rate, res.snaps); err != nil {
				return err
			}
		}
	}
	return nil
}

// positives parses a comma-separated list of positive integers.
func positives(flagName, list string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(list, ",") {
		v, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || v < 1 {
			return nil, fmt.Errorf("%s %q: want positive numbers", flagName, list)
		}
		out = append(out, v)
	}
	return out, nil
}

// reportRounds prints the medians of the rounds; it returns the apply rate.
func (e *env) reportRounds(o opts, res *roundResults) float64 {
	if len(res.compares) > 0 {
		bench.Figure("projector.ratio_apply_to_raw.compare", bench.Median(res.compares), fmt.Sprintf("x (median; the -compare-bin build; min %.2f, max %.2f)", slices.Min(res.compares), slices.Max(res.compares)))
	}
	e.suffix = ""
	applyRate := bench.Median(res.applies)
	if o.rounds > 1 {
		e.figure("projector.raw_rows_per_sec", bench.Median(res.raws), fmt.Sprintf("rows/s (median of %d rounds)", o.rounds))
		e.figure("projector.apply_rows_per_sec", applyRate, fmt.Sprintf("rows/s (median of %d rounds)", o.rounds))
		bench.Figure("projector.ratio_apply_to_raw", bench.Median(res.ratios), fmt.Sprintf("x (median of the rounds' ratios; min %.2f, max %.2f; target >= 0.70)", slices.Min(res.ratios), slices.Max(res.ratios)))
	}
	for _, k := range slices.Sorted(maps.Keys(res.snaps)) {
		xs := res.snaps[k]
		name, unit, _ := strings.Cut(k, "|")
		bench.Figure(name, bench.Median(xs), fmt.Sprintf("%s (median of %d rounds; min %.2f, max %.2f)", unit, len(xs), slices.Min(xs), slices.Max(xs)))
	}
	return applyRate
}

// buildStream seeds a source, lets the capture create its slot, deletes
// every order (perTx per transaction), then drains the backlog into the
// stream of source.
func (e *env) buildStream(ctx context.Context, source string, rows, perTx int) (int64, float64, error) {
	db, data, figures := "source", "capture-data", "projector."
	if source != "bench" {
		db, data, figures = "source_"+source, "capture-data-"+source, "projector."+source+"_"
	}
	url, err := bench.CreateDatabase(ctx, e.pg, db)
	if err != nil {
		return 0, 0, err
	}
	if err := workload.Setup(ctx, url); err != nil {
		return 0, 0, err
	}
	counts, err := workload.Seed(ctx, url, bench.ShopFor(rows))
	if err != nil {
		return 0, 0, err
	}
	n := counts.Total() - counts.Customers
	metrics, err := bench.LocalAddr()
	if err != nil {
		return 0, 0, err
	}
	cenv := bench.CaptureEnv(url, e.natsURL, "", filepath.Join(e.dir, data), metrics, source, "epitaph_"+source)
	watch, err := bench.WatchStream(e.natsURL, source)
	if err != nil {
		return 0, 0, err
	}
	defer watch.Close()
	p, err := bench.StartProc("capture-"+source, e.bins["capture"], cenv, e.dir)
	if err != nil {
		return 0, 0, err
	}
	if err := waitStream(ctx, p, watch, url, "epitaph_"+source); err != nil {
		p.Kill()
		return 0, 0, err
	}
	if err := p.Stop(30 * time.Second); err != nil {
		bench.Note("capture stop: %v", err)
	}
	if _, err := bench.DeleteAllOrders(ctx, url, perTx); err != nil {
		return 0, 0, err
	}
	p, err = bench.StartProc("capture-"+source, e.bins["capture"], cenv, e.dir)
	if err != nil {
		return 0, 0, err
	}
	defer p.Kill()
	end, err := watch.WaitDeletes(ctx, n, 5*time.Minute, exitedErr(p))
	if err != nil {
		return 0, 0, bench.Stalled(ctx, p, metrics, err)
	}
	rate := float64(n) / end.Sub(p.Started()).Seconds()
	// The capture's heartbeat once the source is quiet carries every
	// partition past the last commit: the archive's horizon, which
	// batching webhook handlers deliver up to, reaches the end.
	if last, err := watch.LastSeq(ctx); err != nil {
		return 0, 0, err
	} else if err := watch.WaitMarksAfter(ctx, last, 30*time.Second); err != nil {
		return 0, 0, fmt.Errorf("the heartbeat after the last commit: %w", err)
	}
	bench.Figure(figures+"stream_delete_events", float64(n), fmt.Sprintf("events (%d orders per transaction)", perTx))
	bench.Figure(figures+"capture_backlog_rows_per_sec", rate, "rows/s (capture draining the backlog into the stream)")
	if err := p.Stop(30 * time.Second); err != nil {
		bench.Note("capture stop: %v", err)
	}
	return n, rate, nil
}

// waitStream waits until the capture has created the stream and its
// replication slot on the source: deletes made before the slot exists are
// not in the WAL it reads (the capture creates the stream first, so the
// stream alone is not enough).
func waitStream(ctx context.Context, p *bench.Proc, watch *bench.StreamWatch, sourceURL, slot string) error {
	return workload.WaitFor(ctx, 2*time.Minute, 50*time.Millisecond, func(ctx context.Context) (bool, error) {
		if err := exitedErr(p)(); err != nil {
			return false, err
		}
		if !watch.StreamExists(ctx) {
			return false, nil
		}
		c, err := bench.Count(ctx, sourceURL, "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1", slot)
		return c > 0, err
	})
}

func exitedErr(p *bench.Proc) func() error {
	return func() error {
		if done, err := p.Exited(); done {
			return fmt.Errorf("%s exited (%v):\n%s", p.Name, err, p.LogTail(3000))
		}
		return nil
	}
}

func (e *env) startProjectors(ctx context.Context, targetURL, source string) ([]*bench.Proc, error) {
	var procs []*bench.Proc
	e.metricsAddrs = nil
	for i := 0; i < e.workers; i++ {
		metrics, err := bench.LocalAddr()
		if err != nil {
			return procs, err
		}
		e.metricsAddrs = append(e.metricsAddrs, metrics)
		penv := bench.ProjectorEnv(targetURL, e.natsURL, metrics, source, "bench-"+strconv.Itoa(i))
		if e.snapshotRoots != "" {
			penv = append(penv, "EPITAPH_SNAPSHOT_ROOTS="+e.snapshotRoots)
		}
		if e.pageSize > 0 {
			penv = append(penv, "EPITAPH_BATCH_SIZE="+strconv.Itoa(e.pageSize))
		}
		if e.handlerParallelism > 0 {
			penv = append(penv, "EPITAPH_HANDLER_PARALLELISM="+strconv.Itoa(e.handlerParallelism))
			if e.handlersProfile != "" {
				reval := ""
				if e.revalidate {
					reval = ".revalidate"
				}
				penv = append(penv, fmt.Sprintf("EPITAPH_CPU_PROFILE=%s%s%s.%d.prof", e.handlersProfile, e.suffix, reval, i))
			}
		}
		if e.sourceURL != "" {
			penv = append(penv, "EPITAPH_SOURCE_URL="+e.sourceURL) // the last one counts
		}
		p, err := bench.StartProc("projector-"+source+"-"+strconv.Itoa(i), e.bins["projector"], penv, e.dir, "run")
		if err != nil {
			return procs, err
		}
		procs = append(procs, p)
	}
	return procs, nil
}

func (e *env) migrate(ctx context.Context, targetURL, source string) error {
	p, err := bench.StartProc("projector-migrate", e.bins["projector"], bench.ProjectorEnv(targetURL, e.natsURL, "", source, "migrate"), e.dir, "migrate")
	if err != nil {
		return err
	}
	<-p.Done()
	if _, err := p.Exited(); err != nil {
		return fmt.Errorf("projector migrate: %v\n%s", err, p.LogTail(2000))
	}
	return nil
}

// archiveWait is what waitArchive waits for: the n rows of source in the
// archive of targetURL (their last rows read from the stream at natsURL),
// for at most timeout, failing when one of procs exits.
type archiveWait struct {
	targetURL, natsURL, source string
	n                          int64
	procs                      []*bench.Proc
	timeout                    time.Duration
}

// waitArchive waits until archive.rows holds the n rows of source and
// returns when it first did. Polling count(*) on a growing table would load
// the very server being measured, so it polls the last row of every
// partition's last transaction (a partition is applied in order: when its
// last row is archived, so are the rows before it), a few primary-key
// lookups, and then confirms with one count(*); on a shortfall it falls
// back to polling the count.
func waitArchive(ctx context.Context, w archiveWait) (time.Time, error) {
	_, at, err := waitArchiveFirst(ctx, w)
	return at, err
}

// waitArchiveFirst is waitArchive that also returns when the first row of
// source was seen in the archive.
func waitArchiveFirst(ctx context.Context, w archiveWait) (first, last time.Time, err error) {
	alive := func() error {
		for _, p := range w.procs {
			if err := exitedErr(p)(); err != nil {
				return err
			}
		}
		return nil
	}
	lsns, seqs, err := lastRows(ctx, w.natsURL, w.source)
	if err != nil {
		return time.Time{}, time.Time{}, err
	}
	conn, err := pgx.Connect(ctx, w.targetURL)
	if err != nil {
		return time.Time{}, time.Time{}, err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var at time.Time
	err = workload.WaitFor(ctx, w.timeout, 20*time.Millisecond, func(ctx context.Context) (bool, error) {
		if err := alive(); err != nil {
			return false, err
		}
		if first.IsZero() {
			var seen bool
			err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM archive.rows WHERE source = $1)`, w.source).Scan(&seen)
			if err != nil && !isUndefinedTable(err) {
				return false, err
			}
			if !seen {
				return false, nil
			}
			first = time.Now()
		}
		// One primary-key lookup per partition, pipelined.
		b := &pgx.Batch{}
		for i := range lsns {
			b.Queue(`SELECT EXISTS (SELECT 1 FROM archive.rows WHERE source = $1 AND commit_lsn = $2::pg_lsn AND seq = $3)`,
				w.source, lsns[i], seqs[i])
		}
		res := conn.SendBatch(ctx, b)
		have := 0
		for range lsns {
			var ok bool
			if err := res.QueryRow().Scan(&ok); err != nil {
				_ = res.Close()
				if isUndefinedTable(err) {
					return false, nil // the projector has not created it yet
				}
				return false, err
			}
			if ok {
				have++
			}
		}
		if err := res.Close(); err != nil {
			return false, err
		}
		at = time.Now()
		return have == len(lsns), nil
	})
	if err != nil {
		return time.Time{}, time.Time{}, fmt.Errorf("waiting for the last rows of each partition: %w", err)
	}
	count := func(ctx context.Context) (int64, error) {
		return bench.Count(ctx, w.targetURL, "SELECT count(*) FROM archive.rows WHERE source = $1", w.source)
	}
	c, err := count(ctx)
	if err != nil {
		return time.Time{}, time.Time{}, err
	}
	if c >= w.n {
		return first, at, nil
	}
	bench.Note("archive had %d of %d rows when each partition's last row was in; polling the count", c, w.n)
	err = workload.WaitFor(ctx, w.timeout, 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		if err := alive(); err != nil {
			return false, err
		}
		c, err = count(ctx)
		at = time.Now()
		return c >= w.n, err
	})
	if err != nil {
		return time.Time{}, time.Time{}, fmt.Errorf("archive has %d of %d rows: %w", c, w.n, err)
	}
	return first, at, nil
}

func isUndefinedTable(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "42P01"
}

// lastRows is, for every partition of source's stream with a commit, the
// identity (commit LSN, seq) of the last row of its last transaction.
func lastRows(ctx context.Context, natsURL, source string) ([]string, []int32, error) {
	watch, err := bench.WatchStream(natsURL, source)
	if err != nil {
		return nil, nil, err
	}
	defer watch.Close()
	stream, err := watch.JetStream().Stream(ctx, event.StreamName(source))
	if err != nil {
		return nil, nil, fmt.Errorf("stream: %w", err)
	}
	parts, err := strconv.Atoi(stream.CachedInfo().Config.Metadata[event.MetaPartitions])
	if err != nil {
		return nil, nil, fmt.Errorf("stream metadata epitaph.partitions: %w", err)
	}
	var lsns []string
	var seqs []int32
	for p := 0; p < parts; p++ {
		raw, err := stream.GetLastMsgForSubject(ctx, event.CommitSubject(source, p))
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		if err != nil {
			return nil, nil, fmt.Errorf("last commit of partition %d: %w", p, err)
		}
		ev, err := event.Decode(raw.Data)
		if err != nil {
			return nil, nil, fmt.Errorf("last commit of partition %d: %w", p, err)
		}
		if ev.Rows > 0 {
			lsns = append(lsns, ev.CommitLSN.String())
			seqs = append(seqs, int32(ev.Rows-1))
		}
	}
	return lsns, seqs, nil
}

func (e *env) apply(ctx context.Context, targetURL, source string, n int64) (float64, error) {
	if err := e.migrate(ctx, targetURL, source); err != nil {
		return 0, err
	}
	if e.beforeStart != nil {
		if err := e.beforeStart(ctx, targetURL); err != nil {
			return 0, err
		}
	}
	if e.inProcess {
		return e.applyInProcess(ctx, targetURL, source, n)
	}
	procs, err := e.startProjectors(ctx, targetURL, source)
	defer func() {
		for _, p := range procs {
			p.Kill()
		}
	}()
	if err != nil {
		return 0, err
	}
	e.procs = procs
	start := procs[0].Started()
	cpu0 := e.cpu(procs[0].Pid())
	busy0, total0, err := cpuBusy()
	if err != nil {
		return 0, err
	}
	first, end, err := waitArchiveFirst(ctx, archiveWait{targetURL: targetURL, natsURL: e.natsURL, source: source, n: n, procs: procs, timeout: 15 * time.Minute})
	if err != nil {
		return 0, err
	}
	cpu := e.cpu(procs[0].Pid()).sub(cpu0)
	busy1, total1, err := cpuBusy()
	if err != nil {
		return 0, err
	}
	rate := e.applyFigures(n, start, first, end, cpu)
	e.lastBusy = float64(runtime.NumCPU()) * (busy1 - busy0) / max(total1-total0, 1)
	if e.afterArchive != nil {
		if err := e.afterArchive(ctx, targetURL, end); err != nil {
			return 0, err
		}
	}
	for _, p := range procs {
		if rss, err := p.PeakRSS(); err == nil {
			e.figure("projector.apply_peak_rss_mib."+p.Name, float64(rss)/(1<<20), "MiB")
		}
		if err := p.Stop(30 * time.Second); err != nil {
			bench.Note("projector stop: %v", err)
		}
	}
	return rate, nil
}

func (e *env) applyFigures(n int64, start, first, end time.Time, cpu cpuTimes) float64 {
	took := end.Sub(start).Seconds()
	rate := float64(n) / took
	e.figure("projector.apply_seconds", took, "s (from projector start to archive count = N)")
	e.figure("projector.apply_startup_seconds", first.Sub(start).Seconds(), "s (from projector start to the first archived row)")
	e.figure("projector.apply_rows_per_sec", rate, "rows/s (from projector start)")
	e.figure("projector.apply_rows_per_sec_after_first_row", float64(n)/end.Sub(first).Seconds(), "rows/s")
	e.figure("projector.apply_postgres_cpu_seconds", cpu.postgres, "s")
	e.figure("projector.apply_projector_cpu_seconds", cpu.proc, "s (projector process; in-process: projector + JetStream server)")
	e.lastCPU = cpu
	return rate
}

// applyInProcess runs the projector service inside the bench (with the
// JetStream server), so that -cpuprofile sees where its time goes.
func (e *env) applyInProcess(ctx context.Context, targetURL, source string, n int64) (float64, error) {
	var roots []string
	if e.snapshotRoots != "" {
		roots = strings.Split(e.snapshotRoots, ",")
	}
	svc, err := projection.New(projection.Config{
		TargetURL: targetURL, NATSURL: e.natsURL, SourceName: source, WorkerID: "bench-inprocess", SnapshotRoots: roots,
		BatchSize: e.pageSize,
	}, projection.WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil))))
	if err != nil {
		return 0, err
	}
	if e.cpuProfile != "" {
		stop, err := cpuprofile.Start(e.cpuProfile)
		if err != nil {
			return 0, err
		}
		defer stop()
	}
	cpu0 := e.cpu(os.Getpid())
	start := time.Now()
	if err := svc.Start(ctx); err != nil {
		return 0, err
	}
	defer func() { _ = svc.Stop(context.Background()) }() // a soft stop; the figures are taken
	first, end, err := waitArchiveFirst(ctx, archiveWait{targetURL: targetURL, natsURL: e.natsURL, source: source, n: n, timeout: 15 * time.Minute})
	if err != nil {
		return 0, err
	}
	rate := e.applyFigures(n, start, first, end, e.cpu(os.Getpid()).sub(cpu0))
	e.lastBusy = 0
	if e.afterArchive != nil {
		if err := e.afterArchive(ctx, targetURL, end); err != nil {
			return 0, err
		}
	}
	return rate, nil
}

// snapshotRounds runs round r's snapshot cases (o.snapCases), each with
// its own applies without snapshots (snapshotRound): the round's main
// apply is not reused as the "without".
func (e *env) snapshotRounds(ctx context.Context, o opts, r int, in backlog, snaps map[string][]float64) error {
	if o.snapCases["bench"] {
		if err := e.snapshotRound(ctx, snapshotCase{round: r, source: "bench", label: "bench", n: in.n, orders: in.orders}, snaps); err != nil {
			return err
		}
	}
	if o.snapCases["snap"] {
		if err := e.snapshotRound(ctx, snapshotCase{round: r, source: "snap", label: "snap", n: in.snapN, orders: in.orders}, snaps); err != nil {
			return err
		}
	}
	if o.snapCases["spanning"] {
		if err := e.snapshotRound(ctx, snapshotCase{round: r, source: "bench", label: "spanning", pageSize: spanningPage, n: in.n, orders: in.orders}, snaps); err != nil {
			return err
		}
	}
	return nil
}

// spanningPage is the page size of the snapshot phase's spanning case:
// below the default, pages are not grouped and cut at commits, so every
// 701-event transaction spans pages.
const spanningPage = 400

// rootRows counts the delete events of public.orders, the snapshot root:
// one document each.
func rootRows(events []*event.Event) int64 {
	var n int64
	for _, ev := range events {
		if ev.Schema == "public" && ev.Table == "orders" {
			n++
		}
	}
	return n
}

type documentFigures struct {
	lastAge                      time.Duration
	maxDelay, p99Delay, p50Delay float64
	maxFromStart                 float64
	inPage                       float64
	// batches is how many batcher batches completed documents (a batch
	// stamps its documents with one completed_at), perBatch their mean.
	batches  int64
	perBatch float64
}

// waitDocuments waits until archive.snapshots holds want complete
// documents and says how long after the last archived row the last one
// was complete, and how long each document took from its commit being
// applied (the job's created_at) to complete.
func waitDocuments(ctx context.Context, targetURL string, want int64) (documentFigures, error) {
	var f documentFigures
	conn, err := pgx.Connect(ctx, targetURL)
	if err != nil {
		return f, err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var complete, failed int64
	err = workload.WaitFor(ctx, 10*time.Minute, 50*time.Millisecond, func(ctx context.Context) (bool, error) {
		err := conn.QueryRow(ctx, `SELECT count(*) FILTER (WHERE status = 'complete'), count(*) FILTER (WHERE status = 'failed')
			FROM archive.snapshots`).Scan(&complete, &failed)
		if err != nil {
			return false, err
		}
		if failed > 0 {
			return false, fmt.Errorf("%d snapshot documents failed", failed)
		}
		return complete >= want, nil
	})
	if err != nil {
		return f, fmt.Errorf("snapshots: %d of %d documents complete: %w", complete, want, err)
	}
	// When the last row was archived, how long the last document still
	// took (by the servers' clocks, not this poll's).
	var age float64
	err = conn.QueryRow(ctx, `SELECT greatest(0, extract(epoch FROM (SELECT max(completed_at) FROM archive.snapshots)
		- (SELECT max(archived_at) FROM archive.rows)))::float8`).Scan(&age)
	if err != nil {
		return f, err
	}
	f.lastAge = time.Duration(age * float64(time.Second))
	// By commit timestamps (track_commit_timestamp): a group's commit was
	// applied by the last transaction that wrote its archive rows (the
	// verification at the commit rewrites the earlier pages' rows), its
	// document written complete by the last one that wrote the job.
	err = conn.QueryRow(ctx, `WITH applied AS MATERIALIZED (
		SELECT source, commit_lsn, max(pg_xact_commit_timestamp(xmin)) AS at FROM archive_v1.rows GROUP BY source, commit_lsn)
		SELECT coalesce(max(d), -1), coalesce(percentile_cont(0.99) WITHIN GROUP (ORDER BY d), -1),
		       coalesce(percentile_cont(0.5) WITHIN GROUP (ORDER BY d), -1), max(from_start), avg(in_page)
		FROM (SELECT greatest(0, extract(epoch FROM pg_xact_commit_timestamp(s.xmin) - a.at))::float8 AS d,
		             extract(epoch FROM s.completed_at - s.created_at)::float8 AS from_start,
		             (s.completed_at = s.created_at)::int::float8 AS in_page
		      FROM archive_v1.snapshots s JOIN applied a USING (source, commit_lsn)) s`).
		Scan(&f.maxDelay, &f.p99Delay, &f.p50Delay, &f.maxFromStart, &f.inPage)
	if err != nil {
		return f, err
	}
	err = conn.QueryRow(ctx, `SELECT count(*), coalesce(avg(n), 0)::float8
		FROM (SELECT count(*) AS n FROM archive.snapshots WHERE completed_at <> created_at GROUP BY completed_at) b`).Scan(&f.batches, &f.perBatch)
	return f, err
}

// cpuTimes are CPU seconds used: by a process (user+system, with its
// reaped children) and by the Postgres server (postmaster, its reaped
// children and the live backends); bench: this process's own (the
// embedded JetStream server, the handlers round's webhook server).
type cpuTimes struct{ proc, postgres, bench float64 }

func (a cpuTimes) sub(b cpuTimes) cpuTimes {
	return cpuTimes{a.proc - b.proc, a.postgres - b.postgres, a.bench - b.bench}
}

func (e *env) cpu(pid int) cpuTimes {
	var t cpuTimes
	t.bench, _ = procCPU(os.Getpid())
	if pid > 0 {
		t.proc, _ = procCPU(pid)
	}
	b, err := os.ReadFile(filepath.Join(e.pg.DataDir, "postmaster.pid"))
	if err != nil {
		return t
	}
	pm, err := strconv.Atoi(strings.TrimSpace(strings.SplitN(string(b), "\n", 2)[0]))
	if err != nil {
		return t
	}
	t.postgres, _ = procCPU(pm)
	dirs, _ := os.ReadDir("/proc")
	for _, d := range dirs {
		child, err := strconv.Atoi(d.Name())
		if err != nil {
			continue
		}
		if ppid, _ := procPPID(child); ppid == pm {
			c, _ := procCPU(child)
			t.postgres += c
		}
	}
	return t
}

func procStat(pid int) ([]string, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return nil, err
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return nil, fmt.Errorf("bad /proc/%d/stat", pid)
	}
	return strings.Fields(s[i+1:]), nil // fields from 3 (state) on
}

// procCPU is utime+stime+cutime+cstime in seconds (clock ticks of 1/100 s).
func procCPU(pid int) (float64, error) {
	f, err := procStat(pid)
	if err != nil || len(f) < 15 {
		return 0, err
	}
	var ticks int64
	for _, x := range f[11:15] {
		v, _ := strconv.ParseInt(x, 10, 64)
		ticks += v
	}
	return float64(ticks) / 100, nil
}

func procPPID(pid int) (int, error) {
	f, err := procStat(pid)
	if err != nil || len(f) < 2 {
		return 0, err
	}
	return strconv.Atoi(f[1])
}

// raw writes the same delete events as archive rows the way a hand-written
// loader would, on ONE connection, into archive_v1.rows of a fresh database
// created by the projector's own code (same DDL, primary key and indexes):
// per batch of the projector's page size, one transaction with a COPY into
// a temporary staging table (ON COMMIT DELETE ROWS: no WAL, emptied at
// commit) and one INSERT .. SELECT .. ON CONFLICT DO NOTHING. The staging
// columns are text where the projector sends text (JSON, LSN) and the
// INSERT casts them, as the projector's statement does. It runs before the
// apply, on an empty table like the apply's. This is what Postgres can take
// here.
func (e *env) raw(ctx context.Context, targetURL string, events []*event.Event, batch int) (float64, error) {
	// The table: archive_v1.rows of a fresh database, created by the
	// projector's own code (same DDL, primary key and indexes).
	pool, err := pgxpool.New(ctx, targetURL)
	if err != nil {
		return 0, err
	}
	if err := migrations.Apply(ctx, pool); err != nil {
		pool.Close()
		return 0, fmt.Errorf("raw: migrate: %w", err)
	}
	if err := version.EnsureArchive(ctx, pool, 8, nil); err != nil {
		pool.Close()
		return 0, fmt.Errorf("raw: create archive_v1: %w", err)
	}
	pool.Close()
	conn, err := pgx.Connect(ctx, targetURL)
	if err != nil {
		return 0, err
	}
	defer conn.Close(ctx)
	_, err = conn.Exec(ctx, `CREATE TEMP TABLE staging (source text, schema_name text, table_name text, key text, row text,
			identity text, correlation_id text, is_root boolean, xid bigint, commit_lsn text, commit_time timestamptz,
			seq integer, refs text, columns text) ON COMMIT DELETE ROWS`)
	if err != nil {
		return 0, fmt.Errorf("raw: create staging: %w", err)
	}
	cols := []string{"source", "schema_name", "table_name", "key", "row", "identity", "correlation_id", "is_root",
		"xid", "commit_lsn", "commit_time", "seq", "refs", "columns"}
	data := make([][]any, len(events))
	for i, ev := range events {
		var commitTime any
		if !ev.CommitTime.IsZero() {
			commitTime = ev.CommitTime
		}
		data[i] = []any{ev.Source, ev.Schema, ev.Table, nullable(ev.Key), nullable(ev.Row), ev.Identity, ev.CorrelationID(), true,
			ev.XID, ev.CommitLSN.String(), commitTime, int32(ev.Seq), jsonText(ev.Refs), jsonText(ev.Columns)}
	}
	cpu0 := e.cpu(0)
	start := time.Now()
	var copyTook time.Duration
	for off := 0; off < len(data); off += batch {
		part := data[off:min(off+batch, len(data))]
		tx, err := conn.Begin(ctx)
		if err != nil {
			return 0, err
		}
		c0 := time.Now()
		if _, err := tx.CopyFrom(ctx, pgx.Identifier{"staging"}, cols, pgx.CopyFromRows(part)); err != nil {
			_ = tx.Rollback(ctx)
			return 0, fmt.Errorf("raw: copy: %w", err)
		}
		copyTook += time.Since(c0)
		if _, err := tx.Exec(ctx, `INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row, identity,
				correlation_id, is_root, xid, commit_lsn, commit_time, seq, refs, columns)
			SELECT source, schema_name, table_name, key::jsonb, row::jsonb, identity, correlation_id, is_root, xid,
				commit_lsn::pg_lsn, commit_time, seq, refs::jsonb, columns::jsonb FROM staging
			ON CONFLICT DO NOTHING`); err != nil {
			_ = tx.Rollback(ctx)
			return 0, fmt.Errorf("raw: insert select: %w", err)
		}
		if err := tx.Commit(ctx); err != nil {
			return 0, fmt.Errorf("raw: commit: %w", err)
		}
	}
	took := time.Since(start)
	cpu := e.cpu(0).sub(cpu0)
	var got int64
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM archive_v1.rows").Scan(&got); err != nil {
		return 0, err
	}
	if got != int64(len(events)) {
		return 0, fmt.Errorf("raw: wrote %d rows, want %d", got, len(events))
	}
	rate := float64(len(events)) / took.Seconds()
	e.figure("projector.raw_copy_seconds", copyTook.Seconds(), "s (the COPYs)")
	e.figure("projector.raw_seconds", took.Seconds(), fmt.Sprintf("s (%d transactions of COPY %d rows + INSERT..SELECT, one connection)", (len(data)+batch-1)/batch, batch))
	e.figure("projector.raw_rows_per_sec", rate, "rows/s")
	e.figure("projector.raw_postgres_cpu_seconds", cpu.postgres, "s")
	return rate, nil
}

func nullable(b json.RawMessage) any {
	if len(b) == 0 {
		return nil
	}
	return string(b)
}

// jsonText is v as JSON text, nil for an empty slice (as the projector
// stores it).
func jsonText[T any](v []T) any {
	if len(v) == 0 {
		return nil
	}
	b, err := json.Marshal(v)
	if err != nil {
		return nil
	}
	return string(b)
}

// dropDatabase drops the database of url (closing its sessions).
func dropDatabase(ctx context.Context, pg *testenv.Postgres, url string) error {
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		return err
	}
	conn, err := pgx.Connect(ctx, pg.URL("postgres"))
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, "DROP DATABASE "+pgx.Identifier{cfg.Database}.Sanitize()+" WITH (FORCE)"); err != nil {
		return fmt.Errorf("drop database %s: %w", cfg.Database, err)
	}
	return nil
}

func pgStatsReset(ctx context.Context, url string) error {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	_, err = conn.Exec(ctx, "CREATE EXTENSION IF NOT EXISTS pg_stat_statements; SELECT pg_stat_statements_reset()")
	return err
}

// pgStatsPrint prints the statements that took the most execution time
// since the last reset, then resets.
func pgStatsPrint(ctx context.Context, url, phase string) error {
	return pgStatsShow(ctx, url, phase, true)
}

// pgStatsShow is pgStatsPrint, resetting only when reset is set (the
// reset clears every database's statements).
func pgStatsShow(ctx context.Context, url, phase string, reset bool) error {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	rows, err := conn.Query(ctx, `SELECT calls, total_exec_time, total_plan_time, rows, shared_blks_hit + shared_blks_read,
			jit_generation_time + jit_inlining_time + jit_optimization_time + jit_emission_time,
			regexp_replace(left(query, 110), '\s+', ' ', 'g')
		FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
		ORDER BY total_exec_time + total_plan_time DESC LIMIT 14`)
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		var calls, n, blocks int64
		var exec, plan, jit float64
		var q string
		if err := rows.Scan(&calls, &exec, &plan, &n, &blocks, &jit, &q); err != nil {
			return err
		}
		// Buffers per call: the work a statement does, whatever the load.
		// JIT time is part of exec: a statement whose estimated cost
		// passes jit_above_cost compiles its plan on every call.
		bench.Note("pgstats %s: %7d calls %9.0f ms exec %6.0f ms plan %6.0f ms jit %8d rows %8.0f buffers/call  %s", phase, calls, exec, plan, jit, n,
			float64(blocks)/float64(max(calls, 1)), q)
	}
	if err := rows.Err(); err != nil || !reset {
		return err
	}
	_, err = conn.Exec(ctx, "SELECT pg_stat_statements_reset()")
	return err
}

// workerCurve applies the stream with each number of projector processes
// into a fresh database and reports the rate, its ratio to the first count
// and how busy the machine's CPUs were: on a machine with C cores the rate
// flattens once the workers and Postgres use them all.
func (e *env) workerCurve(ctx context.Context, counts []int, n int64) error {
	if len(counts) == 0 || e.inProcess {
		return nil
	}
	own := e.workers
	defer func() { e.workers, e.suffix = own, "" }()
	var base float64
	for _, w := range counts {
		url, err := bench.CreateDatabase(ctx, e.pg, fmt.Sprintf("target_w%d", w))
		if err != nil {
			return err
		}
		e.workers, e.suffix = w, fmt.Sprintf(".workers%d", w)
		busy0, total0, err := cpuBusy()
		if err != nil {
			return err
		}
		rate, err := e.apply(ctx, url, "bench", n)
		if err != nil {
			return err
		}
		busy1, total1, err := cpuBusy()
		if err != nil {
			return err
		}
		if err := dropDatabase(ctx, e.pg, url); err != nil {
			return err
		}
		if base == 0 {
			base = rate
		}
		used := float64(runtime.NumCPU()) * (busy1 - busy0) / max(total1-total0, 1)
		bench.Figure(fmt.Sprintf("projector.workers.%d.apply_rows_per_sec", w), rate, "rows/s (from the first start to archive count = N)")
		bench.Figure(fmt.Sprintf("projector.workers.%d.speedup", w), rate/base, fmt.Sprintf("x (against %d worker(s))", counts[0]))
		bench.Figure(fmt.Sprintf("projector.workers.%d.cpus_busy", w), used, fmt.Sprintf("of %d CPUs (the whole machine: projectors, Postgres, JetStream)", runtime.NumCPU()))
	}
	return nil
}

// cpuBusy reads the machine's busy and total CPU time (USER_HZ ticks) from
// /proc/stat.
func cpuBusy() (busy, total float64, err error) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0, fmt.Errorf("read /proc/stat: %w", err)
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 8 || f[0] != "cpu" {
		return 0, 0, fmt.Errorf("unexpected /proc/stat line %q", line)
	}
	for i, v := range f[1:] {
		x, err := strconv.ParseFloat(v, 64)
		if err != nil {
			return 0, 0, fmt.Errorf("parse /proc/stat: %w", err)
		}
		total += x
		if i != 3 && i != 4 { // idle, iowait
			busy += x
		}
	}
	return busy, total, nil
}
