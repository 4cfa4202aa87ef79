// Command revalidate measures what revalidating row handlers' deliveries
// costs (issue 16, `make bench-revalidate`): the evaluation per delivery on
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
	"github.com/epitaph-dev/epitaph/projection"
)

type options struct {
	deliveries, group, parallelism int
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
	flag.StringVar(&o.cpuProfile, "cpuprofile", "", "write a CPU profile of this process during the revalidation-on Flush to this file")
	flag.BoolVar(&o.pgStats, "pgstats", false, "load pg_stat_statements and print the statements of each Flush (off, on)")
	flag.Parse()
	if o.deliveries < 1 || o.group < 1 || o.parallelism < 1 {
		fmt.Fprintln(os.Stderr, "bench-revalidate: -deliveries, -group and -parallelism must be at least 1")
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
	if err := projection.EnsureArchive(ctx, target, 1, nil); err != nil {
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
		took, err = e.evaluateBatches(ctx, ids, phase.path)
		if err != nil {
			return err
		}
		per = took / time.Duration(len(ids))
		bench.Figure("revalidate_"+phase.path+"_us_per_delivery_batched", float64(per.Microseconds()),
			fmt.Sprintf("µs (wall, batches of %d one at a time, as the dispatcher claims)", batchSize))
	}
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
// that answers at once, with revalidation off and then on.
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
	rate := map[bool]float64{}
	cpu := map[bool]cpuUse{}
	for _, on := range []bool{false, true} {
		if _, err := e.seed(ctx, srv.URL); err != nil {
			return err
		}
		if _, err := e.target.Exec(ctx, `UPDATE epitaph.handlers SET revalidate = $1`, on); err != nil {
			return err
		}
		d, err := handler.NewDispatcher(e.target, handler.Config{Parallelism: e.o.parallelism,
			Revalidate: e.ev.Revalidator(), RevalidateBatch: e.ev.BatchRevalidator(), Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
		if err != nil {
			return err
		}
		name := map[bool]string{false: "off", true: "on"}[on]
		if err := e.pgStatsReset(ctx); err != nil {
			return err
		}
		stopProfile, err := e.profile(on)
		if err != nil {
			return err
		}
		cpu0, err := e.cpu()
		if err != nil {
			return err
		}
		fctx, cancel := context.WithTimeout(ctx, 10*time.Minute)
		start := time.Now()
		left, err := d.Flush(fctx)
		took := time.Since(start)
		cancel()
		stopProfile()
		if err != nil {
			return err
		}
		cpu1, err := e.cpu()
		if err != nil {
			return err
		}
		if err := e.pgStatsPrint(ctx, "flush "+name, e.o.deliveries); err != nil {
			return err
		}
		if left != 0 {
			return fmt.Errorf("flush left %d deliveries open", left)
		}
		var done int
		if err := e.target.QueryRow(ctx, `SELECT count(*) FROM epitaph.deliveries WHERE state = 'done'`).Scan(&done); err != nil {
			return err
		}
		if done != e.o.deliveries {
			return errors.New("not every delivery is done")
		}
		rate[on] = float64(done) / took.Seconds()
		bench.Figure("deliveries_per_s_revalidation_"+name, rate[on], "deliveries/s (webhook, local server)")
		// CPU per delivery: what a loaded machine does not distort.
		cpu[on] = cpuUse{postgres: (cpu1.postgres - cpu0.postgres) / float64(done), bench: (cpu1.bench - cpu0.bench) / float64(done)}
		bench.Figure("postgres_cpu_us_per_delivery_revalidation_"+name, cpu[on].postgres*1e6, "µs of Postgres CPU per delivery (the whole Flush)")
		bench.Figure("dispatcher_cpu_us_per_delivery_revalidation_"+name, cpu[on].bench*1e6, "µs of this process's CPU per delivery (dispatcher, evaluator, webhook server)")
	}
	bench.Figure("revalidation_rate_ratio_on_off", rate[true]/rate[false], "target >= 0.75 (revalidation costs <= 25% of the delivery rate)")
	bench.Figure("revalidation_cpu_ratio_off_on", (cpu[false].postgres+cpu[false].bench)/(cpu[true].postgres+cpu[true].bench),
		"x: CPU per delivery (Postgres + process) off / on, the rate ratio a CPU-bound machine would see (target >= 0.75)")
	mu.Lock()
	bench.Note("the webhook saw %d requests", seen)
	mu.Unlock()
	return nil
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
