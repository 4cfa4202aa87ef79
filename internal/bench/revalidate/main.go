// Command revalidate measures what revalidating row handlers' deliveries
// costs (`make bench-revalidate`): the evaluation per delivery on
// the cheap path (the set unchanged: one aggregate) and with the full read
// (the pair differs: the set read and hashed), and the delivery rate of the
// real dispatcher through a webhook to a local server that answers at once,
// with revalidation off and on. Target: revalidation costs at most 25% of
// the delivery rate on the cheap path (ratio on/off >= 0.75).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/handler/revalidate"
	"github.com/epitaph-dev/epitaph/internal/bench"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/version"
)

type options struct {
	deliveries, group, parallelism int
	// pairs: Flush rounds with revalidation off and on, interleaved.
	pairs int
	// cpuProfile: a CPU profile of this process during the revalidation-on
	// Flush; pgStats: pg_stat_statements per Flush.
	cpuProfile string
	pgStats    bool
}

func main() {
	var o options
	flag.IntVar(&o.deliveries, "deliveries", 5000, "deliveries (archived rows) per phase")
	flag.IntVar(&o.group, "group", 10, "rows per source transaction (the set each delivery describes)")
	flag.IntVar(&o.parallelism, "parallelism", handler.DefaultParallelism, "evaluations / deliveries at once")
	flag.IntVar(&o.pairs, "pairs", 3, "Flush rounds with revalidation off then on (interleaved pairs; medians reported)")
	flag.StringVar(&o.cpuProfile, "cpuprofile", "", "write CPU profiles of this process during the last pair's Flushes to this file's name with .off and .on")
	flag.BoolVar(&o.pgStats, "pgstats", false, "load pg_stat_statements and print the statements of each Flush (off, on)")
	flag.Parse()
	if o.deliveries < 1 || o.group < 1 || o.parallelism < 1 || o.pairs < 1 {
		fmt.Fprintln(os.Stderr, "bench-revalidate: -deliveries, -group, -parallelism and -pairs must be at least 1")
		os.Exit(2)
	}
	if err := run(context.Background(), o); err != nil {
		fmt.Fprintln(os.Stderr, "bench-revalidate:", err)
		os.Exit(1)
	}
}

const handlerID = "00000000-0000-4000-8000-00000000be00"

type env struct {
	o      options
	target *pgxpool.Pool
	ev     *revalidate.Evaluator
	// pgData: the data directory of the bench's Postgres (its CPU is read
	// from /proc).
	pgData string
}

func run(ctx context.Context, o options) error {
	bench.LoadNote("start")
	defer bench.LoadNote("end")
	pg, err := testenv.StartPostgres()
	if err != nil {
		return err
	}
	defer func() {
		_ = pg.Stop()
		_ = os.RemoveAll(filepath.Dir(pg.DataDir))
	}()
	if o.pgStats {
		if err := pg.SetConfig("shared_preload_libraries = 'pg_stat_statements'", "pg_stat_statements.track = all", "pg_stat_statements.track_planning = on"); err != nil {
			return err
		}
		if err := pg.Restart(); err != nil {
			return err
		}
	}
	e, closeAll, err := setup(ctx, pg, o)
	if err != nil {
		return err
	}
	defer closeAll()
	e.pgData = pg.DataDir
	bench.Note("%d deliveries, sets of %d rows, %d at once", o.deliveries, o.group, o.parallelism)
	if err := e.evaluations(ctx); err != nil {
		return err
	}
	return e.rates(ctx)
}

func setup(ctx context.Context, pg *testenv.Postgres, o options) (*env, func(), error) {
	targetURL, err := bench.CreateDatabase(ctx, pg, "target")
	if err != nil {
		return nil, nil, err
	}
	sourceURL, err := bench.CreateDatabase(ctx, pg, "source")
	if err != nil {
		return nil, nil, err
	}
	src, err := pgx.Connect(ctx, sourceURL)
	if err != nil {
		return nil, nil, fmt.Errorf("connect source: %w", err)
	}
	_, err = src.Exec(ctx, `CREATE TABLE public.customers (id int8 PRIMARY KEY, name text)`)
	_ = src.Close(ctx)
	if err != nil {
		return nil, nil, fmt.Errorf("create source table: %w", err)
	}
	pc, err := pgxpool.ParseConfig(targetURL)
	if err != nil {
		return nil, nil, err
	}
	pc.MaxConns = int32(2*o.parallelism + 2)
	target, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		return nil, nil, err
	}
	if err := migrations.Apply(ctx, target); err != nil {
		target.Close()
		return nil, nil, err
	}
	if err := version.EnsureArchive(ctx, target, 1, nil); err != nil {
		target.Close()
		return nil, nil, err
	}
	ev, err := revalidate.New(target, revalidate.Config{SourceURL: sourceURL, SourceMaxConns: int32(o.parallelism),
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		target.Close()
		return nil, nil, err
	}
	return &env{o: o, target: target, ev: ev}, func() { ev.Close(); target.Close() }, nil
}

// seed archives the rows (groups of o.group in one source transaction) and
// queues one released delivery per row, stamped as the apply stamps them.
func (e *env) seed(ctx context.Context, target string) ([]string, error) {
	var ids []string
	err := pgx.BeginFunc(ctx, e.target, func(tx pgx.Tx) error {
		for _, q := range []string{`TRUNCATE epitaph.deliveries`, `TRUNCATE archive_v1.rows`, `DELETE FROM epitaph.handlers`} {
			if _, err := tx.Exec(ctx, q); err != nil {
				return err
			}
		}
		if _, err := tx.Exec(ctx, `INSERT INTO epitaph.handlers (id, schema_name, table_name, kind, target, backoff)
			VALUES ($1, 'public', 'customers', 'webhook', $2, '10 milliseconds')`, handlerID, target); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `
			INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row, identity, correlation_id, is_root, commit_lsn, seq, verified)
			SELECT 'main', 'public', 'customers', jsonb_build_object('id', i), jsonb_build_object('id', i, 'name', 'customer ' || i),
			       'full', 'main:' || (i / $2) || ':' || lsn, true, lsn::pg_lsn, i % $2, true
			FROM generate_series(0, $1 - 1) AS i, LATERAL (SELECT '0/' || to_hex(4096 + (i / $2) * 256) AS lsn) l`,
			e.o.deliveries, e.o.group); err != nil {
			return fmt.Errorf("archive rows: %w", err)
		}
		if _, err := tx.Exec(ctx, `
			INSERT INTO epitaph.deliveries (id, handler_id, source, commit_lsn, seq, schema_name, table_name, key, correlation_id,
			    version, released_at, payload)
			SELECT gen_random_uuid(), $1, source, commit_lsn, seq, schema_name, table_name, key, correlation_id, 1, now(),
			       jsonb_build_object('key', key, 'columns', '{}'::jsonb)
			FROM archive_v1.rows`, handlerID); err != nil {
			return fmt.Errorf("queue deliveries: %w", err)
		}
		var lsns []string
		rows, err := tx.Query(ctx, `SELECT DISTINCT commit_lsn::text FROM archive_v1.rows`)
		if err != nil {
			return err
		}
		if lsns, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
			return err
		}
		if _, err := revalidate.StampGroups(ctx, tx, "archive_v1", "main", lsns); err != nil {
			return err
		}
		rows, err = tx.Query(ctx, `SELECT id::text FROM epitaph.deliveries ORDER BY commit_lsn, seq`)
		if err != nil {
			return err
		}
		ids, err = pgx.CollectRows(rows, pgx.RowTo[string])
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("seed: %w", err)
	}
	_, err = e.target.Exec(ctx, `ANALYZE archive_v1.rows; ANALYZE epitaph.deliveries`)
	return ids, err
}

// evaluations times Evaluate over every delivery: the cheap path, then the
// full read (every pair made to differ, the sets unchanged).
func (e *env) evaluations(ctx context.Context) error {
	ids, err := e.seed(ctx, "http://127.0.0.1:1/")
	if err != nil {
		return err
	}
	for _, phase := range []struct{ path, prepare string }{
		{revalidate.PathCheap, ``},
		{revalidate.PathFull, `UPDATE archive_v1.rows SET archived_at = archived_at + interval '1 hour'`},
	} {
		if phase.prepare != "" {
			if _, err := e.target.Exec(ctx, phase.prepare); err != nil {
				return err
			}
		}
		took, err := e.evaluateAll(ctx, ids, phase.path)
		if err != nil {
			return err
		}
		per := took / time.Duration(len(ids))
		bench.Figure("revalidate_"+phase.path+"_us_per_delivery", float64(per.Microseconds()), fmt.Sprintf("µs (wall, %d at once)", e.o.parallelism))
		bench.Figure("revalidate_"+phase.path+"_per_s", float64(len(ids))/took.Seconds(), "evaluations/s")
		cpu0, err := e.cpu()
		if err != nil {
			return err
		}
		took, err = e.evaluateBatches(ctx, ids, phase.path)
		if err != nil {
			return err
		}
		cpu1, err := e.cpu()
		if err != nil {
			return err
		}
		per = took / time.Duration(len(ids))
		bench.Figure("revalidate_"+phase.path+"_us_per_delivery_batched", float64(per.Microseconds()),
			fmt.Sprintf("µs (wall, EvaluateBatch of %d ids one at a time)", batchSize))
		n := float64(len(ids))
		bench.Figure("revalidate_"+phase.path+"_cpu_us_per_delivery_batched", 1e6*(cpu1.postgres-cpu0.postgres+cpu1.bench-cpu0.bench)/n,
			fmt.Sprintf("µs of CPU (Postgres %.1f + this process %.1f) per delivery, EvaluateBatch",
				1e6*(cpu1.postgres-cpu0.postgres)/n, 1e6*(cpu1.bench-cpu0.bench)/n))
		if err := e.evaluateClaimedBatches(ctx, ids, phase.path); err != nil {
			return err
		}
	}
	return nil
}

// evaluateClaimedBatches measures EvaluateClaimed, what the dispatcher
// runs on each batch it claims, over the deliveries in claimed-batch sizes,
// one batch at a time: wall time and CPU (Postgres, this process) per
// delivery, the cost revalidation adds to a delivery.
func (e *env) evaluateClaimedBatches(ctx context.Context, ids []string, path string) error {
	rows, err := e.target.Query(ctx, `SELECT id::text, handler_id::text, source, commit_lsn::text, seq, generation,
		schema_name, table_name, key, correlation_id, fingerprint, group_rows, group_max
		FROM epitaph.deliveries ORDER BY commit_lsn, seq`)
	if err != nil {
		return err
	}
	ds, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (handler.Delivery, error) {
		var d handler.Delivery
		err := r.Scan(&d.ID, &d.HandlerID, &d.Source, &d.CommitLSN, &d.Seq, &d.Generation, &d.Schema, &d.Table, &d.Key,
			&d.CorrelationID, &d.Fingerprint, &d.GroupRows, &d.GroupMax)
		return d, err
	})
	if err != nil {
		return fmt.Errorf("read the deliveries as claimed: %w", err)
	}
	// One batch first: the evaluator learns the live schema and the
	// handler's source as the dispatcher's does on its first batch.
	e.ev.EvaluateClaimed(ctx, ds[:1])
	cpu0, err := e.cpu()
	if err != nil {
		return err
	}
	start := time.Now()
	for chunk := range slices.Chunk(ds, batchSize) {
		for i, res := range e.ev.EvaluateClaimed(ctx, chunk) {
			if res.Outcome != revalidate.Send || res.Path != path {
				return fmt.Errorf("delivery %s: %s (%s) on the %s path, want send on the %s path", chunk[i].ID, res.Outcome, res.Reason, res.Path, path)
			}
		}
	}
	took := time.Since(start)
	cpu1, err := e.cpu()
	if err != nil {
		return err
	}
	n := float64(len(ds))
	bench.Figure("revalidate_"+path+"_us_per_delivery_claimed", float64((took / time.Duration(len(ds))).Microseconds()),
		fmt.Sprintf("µs (wall, EvaluateClaimed of %d claimed deliveries one at a time, as the dispatcher)", batchSize))
	bench.Figure("revalidate_"+path+"_cpu_us_per_delivery_claimed", 1e6*(cpu1.postgres-cpu0.postgres+cpu1.bench-cpu0.bench)/n,
		fmt.Sprintf("µs of CPU (Postgres %.1f + this process %.1f) per delivery: what revalidation adds to one",
			1e6*(cpu1.postgres-cpu0.postgres)/n, 1e6*(cpu1.bench-cpu0.bench)/n))
	return nil
}

// batchSize is what the dispatcher claims at once with 4 workers
// (claimAhead).
const batchSize = 64

// evaluateBatches times EvaluateBatch over the deliveries in claimed-batch
// sizes, one batch at a time (the claim loop evaluates its batches so).
func (e *env) evaluateBatches(ctx context.Context, ids []string, path string) (time.Duration, error) {
	start := time.Now()
	for chunk := range slices.Chunk(ids, batchSize) {
		results, errs := e.ev.EvaluateBatch(ctx, chunk)
		for i, res := range results {
			err := errs[i]
			if err == nil && (res.Outcome != revalidate.Send || res.Path != path) {
				err = fmt.Errorf("delivery %s: %s (%s) on the %s path, want send on the %s path", chunk[i], res.Outcome, res.Reason, res.Path, path)
			}
			if err != nil {
				return 0, err
			}
		}
	}
	return time.Since(start), nil
}

func (e *env) evaluateAll(ctx context.Context, ids []string, path string) (time.Duration, error) {
	work := make(chan string)
	errs := make(chan error, e.o.parallelism)
	var wg sync.WaitGroup
	start := time.Now()
	for range e.o.parallelism {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for id := range work {
				res, err := e.ev.Evaluate(ctx, id)
				if err == nil && (res.Outcome != revalidate.Send || res.Path != path) {
					err = fmt.Errorf("delivery %s: %s (%s) on the %s path, want send on the %s path", id, res.Outcome, res.Reason, res.Path, path)
				}
				if err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	var failed error
feed:
	for _, id := range ids {
		select {
		case work <- id:
		case failed = <-errs:
			break feed
		}
	}
	close(work)
	wg.Wait()
	close(errs)
	if failed == nil {
		failed = <-errs
	}
	return time.Since(start), failed
}

// rates runs every delivery through the real dispatcher to a local webhook
// that answers at once, with revalidation off and then on, o.pairs times
// (off, on, off, on, ...: a machine whose load changes during the bench
// moves both sides of a pair alike), and reports each pair and the
// medians.
func (e *env) rates(ctx context.Context) error {
	var mu sync.Mutex
	seen := 0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		mu.Lock()
		seen++
		mu.Unlock()
		w.WriteHeader(http.StatusNoContent)
	}))
	defer srv.Close()
	var rateRatios, cpuRatios []float64
	var runs [2][]flushRun
	for pair := range e.o.pairs {
		var r [2]flushRun
		for k, on := range []bool{false, true} {
			var err error
			if r[k], err = e.flushRound(ctx, srv.URL, on, pair == e.o.pairs-1); err != nil {
				return err
			}
			runs[k] = append(runs[k], r[k])
		}
		rateRatios = append(rateRatios, r[1].rate/r[0].rate)
		cpuRatios = append(cpuRatios, (r[0].cpu.postgres+r[0].cpu.bench)/(r[1].cpu.postgres+r[1].cpu.bench))
		bench.Note("pair %d: %.0f / %.0f deliveries/s (on/off %.2f); CPU per delivery off: Postgres %.0f µs, process %.0f µs; on: %.0f µs, %.0f µs (off/on %.2f)",
			pair+1, r[1].rate, r[0].rate, rateRatios[pair], r[0].cpu.postgres*1e6, r[0].cpu.bench*1e6, r[1].cpu.postgres*1e6,
			r[1].cpu.bench*1e6, cpuRatios[pair])
	}
	for k, name := range []string{"off", "on"} {
		bench.Figure("deliveries_per_s_revalidation_"+name, median(runs[k], func(r flushRun) float64 { return r.rate }),
			fmt.Sprintf("deliveries/s (webhook, local server; median of %d)", e.o.pairs))
		// CPU per delivery: what a loaded machine does not distort.
		bench.Figure("postgres_cpu_us_per_delivery_revalidation_"+name, 1e6*median(runs[k], func(r flushRun) float64 { return r.cpu.postgres }),
			"µs of Postgres CPU per delivery (the whole Flush; median)")
		bench.Figure("dispatcher_cpu_us_per_delivery_revalidation_"+name, 1e6*median(runs[k], func(r flushRun) float64 { return r.cpu.bench }),
			"µs of this process's CPU per delivery (dispatcher, evaluator, webhook server; median)")
	}
	same := func(v float64) float64 { return v }
	bench.Figure("revalidation_rate_ratio_on_off", median(rateRatios, same),
		fmt.Sprintf("median of %d pairs; target >= 0.75 (revalidation costs <= 25%% of the delivery rate)", e.o.pairs))
	bench.Figure("revalidation_cpu_ratio_off_on", median(cpuRatios, same),
		"x: CPU per delivery (Postgres + process) off / on, median of the pairs: the rate ratio a CPU-bound machine would see (target >= 0.75)")
	mu.Lock()
	bench.Note("the webhook saw %d requests", seen)
	mu.Unlock()
	return nil
}

// flushRun is one Flush of every delivery: its rate and CPU per delivery.
type flushRun struct {
	rate float64
	cpu  cpuUse
}

func median[T any](xs []T, f func(T) float64) float64 {
	vs := make([]float64, len(xs))
	for i, x := range xs {
		vs[i] = f(x)
	}
	slices.Sort(vs)
	if len(vs) == 0 {
		return 0
	}
	if len(vs)%2 == 1 {
		return vs[len(vs)/2]
	}
	return (vs[len(vs)/2-1] + vs[len(vs)/2]) / 2
}

// flushRound seeds the deliveries, runs them through a new dispatcher's
// Flush with revalidation on or off and checks every one is done; last:
// the profile and the statements (-cpuprofile, -pgstats) are of this one.
func (e *env) flushRound(ctx context.Context, url string, on, last bool) (flushRun, error) {
	if _, err := e.seed(ctx, url); err != nil {
		return flushRun{}, err
	}
	if _, err := e.target.Exec(ctx, `UPDATE epitaph.handlers SET revalidate = $1`, on); err != nil {
		return flushRun{}, err
	}
	d, err := handler.NewDispatcher(e.target, handler.Config{Parallelism: e.o.parallelism,
		Revalidate: e.ev.Revalidator(), RevalidateBatch: e.ev.BatchRevalidator(), Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		return flushRun{}, err
	}
	name := map[bool]string{false: "off", true: "on"}[on]
	if last {
		if err := e.pgStatsReset(ctx); err != nil {
			return flushRun{}, err
		}
	}
	stopProfile, err := e.profile(name, last)
	if err != nil {
		return flushRun{}, err
	}
	cpu0, err := e.cpu()
	if err != nil {
		return flushRun{}, err
	}
	fctx, cancel := context.WithTimeout(ctx, 10*time.Minute)
	start := time.Now()
	left, err := d.Flush(fctx)
	took := time.Since(start)
	cancel()
	stopProfile()
	if err != nil {
		return flushRun{}, err
	}
	cpu1, err := e.cpu()
	if err != nil {
		return flushRun{}, err
	}
	if last {
		if err := e.pgStatsPrint(ctx, "flush "+name, e.o.deliveries); err != nil {
			return flushRun{}, err
		}
	}
	if left != 0 {
		return flushRun{}, fmt.Errorf("flush left %d deliveries open", left)
	}
	var done int
	if err := e.target.QueryRow(ctx, `SELECT count(*) FROM epitaph.deliveries WHERE state = 'done'`).Scan(&done); err != nil {
		return flushRun{}, err
	}
	if done != e.o.deliveries {
		return flushRun{}, errors.New("not every delivery is done")
	}
	return flushRun{rate: float64(done) / took.Seconds(),
		cpu: cpuUse{postgres: (cpu1.postgres - cpu0.postgres) / float64(done), bench: (cpu1.bench - cpu0.bench) / float64(done)}}, nil
}

// cpuUse is CPU seconds of Postgres and of this process.
type cpuUse struct{ postgres, bench float64 }

func (e *env) cpu() (cpuUse, error) {
	pg, err := bench.PostgresCPU(e.pgData)
	if err != nil {
		return cpuUse{}, err
	}
	self, err := bench.ProcCPU(os.Getpid())
	if err != nil {
		return cpuUse{}, err
	}
	return cpuUse{postgres: pg, bench: self}, nil
}
