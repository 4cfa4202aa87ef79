// Command retention is `make bench-retention`. On one throwaway Postgres
// and an embedded JetStream server, with the projector service in process,
// -pairs interleaved pairs (the order alternating from pair to pair) of
//
//   - apply without cleanup: a stream of -apply delete events applied into
//     an archive that already holds -rows unexpired rows;
//   - apply with cleanup: the same stream into an archive holding -rows
//     expired rows, with the projector's cleaner running (every 50 ms while
//     batches are not full): the apply rate, and the cleanup rate (expired
//     rows deleted per second, from the start until none is left);
//
// each round into a file copy of an archive prefilled once, after a
// checkpoint and with no autovacuum running, dropped after it. Each pair's
// ratio, the median and the min, and the CPU per applied row with and
// without cleanup are printed. Then an erasure by --match on a copy of the
// unexpired archive: the database time of Erase (the sum of its statements'
// execution times, from pg_stat_statements), its wall time, and whether the
// plan uses the GIN index.
//
// Beside the rates it prints CPU seconds (postgres: the postmaster and its
// backends; this process: the projector, the JetStream server and the
// bench) and the cleanup's database time, which on a shared machine say
// more than the wall-clock rates.
//
// Output lines are "BENCH <name> <value> <unit>" and "NOTE <text>".
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/bench"
	"github.com/epitaph-dev/epitaph/internal/broker"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection"
	"github.com/epitaph-dev/epitaph/projection/erasure"
	"github.com/epitaph-dev/epitaph/projection/snapshot"
	"github.com/epitaph-dev/epitaph/projection/version"
)

const (
	source     = "bench"
	partitions = 4
)

func main() {
	rows := flag.Int("rows", 1_000_000, "rows in the archive before the apply")
	apply := flag.Int("apply", 200_000, "delete events applied")
	perTx := flag.Int("per-tx", 10, "rows per source transaction")
	pairs := flag.Int("pairs", 3, "interleaved without/with cleanup apply pairs (each pair's ratio, the median and the min are printed)")
	flag.StringVar(&sharedBuffers, "shared-buffers", "", "the bench server's shared_buffers (default: the test server's, 128MB, Postgres' default)")
	flag.IntVar(&cleanupRate, "cleanup-rate", 0, "the projector's --cleanup-rate (0: its default, 60,000 rows/s; negative: unpaced)")
	flag.StringVar(&explainTo, "explain", "", "copy auto_explain's plans (ANALYZE, BUFFERS) of statements over 200 ms to this file")
	flag.Parse()
	ctx := context.Background()
	if err := run(ctx, *rows, *apply, *perTx, max(1, *pairs)); err != nil {
		log.Fatal(err)
	}
}

var (
	explainTo, sharedBuffers string
	cleanupRate              int
)

// startServer starts the bench's Postgres with pg_stat_statements (and
// auto_explain with -explain, shared_buffers with -shared-buffers); stop
// stops it and removes its data.
func startServer() (pg *testenv.Postgres, stop func(), err error) {
	pg, err = testenv.StartPostgres()
	if err != nil {
		return nil, nil, err
	}
	stop = func() {
		if explainTo != "" {
			if b, err := os.ReadFile(filepath.Join(filepath.Dir(pg.DataDir), "postgres.log")); err == nil {
				_ = os.WriteFile(explainTo, b, 0o644)
			}
		}
		_ = pg.Stop()
		_ = os.RemoveAll(filepath.Dir(pg.DataDir))
	}
	// The database time of the cleanup and the erase: per statement.
	settings := []string{"shared_preload_libraries = 'pg_stat_statements'", "pg_stat_statements.track = all"}
	if explainTo != "" {
		settings = []string{"shared_preload_libraries = 'pg_stat_statements,auto_explain'", "pg_stat_statements.track = all",
			"auto_explain.log_min_duration = '200ms'", "auto_explain.log_analyze = on", "auto_explain.log_buffers = on",
			"auto_explain.log_timing = off", "auto_explain.log_level = warning"}
	}
	if sharedBuffers != "" {
		settings = append(settings, "shared_buffers = '"+strings.ReplaceAll(sharedBuffers, "'", "")+"'")
	}
	if err := pg.SetConfig(settings...); err != nil {
		stop()
		return nil, nil, err
	}
	if err := pg.Restart(); err != nil {
		stop()
		return nil, nil, err
	}
	return pg, stop, nil
}

func run(ctx context.Context, rows, apply, perTx, pairs int) error {
	bench.LoadNote("before")
	dir, err := bench.TempDir("epitaph-bench-retention")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	pg, stop, err := startServer()
	if err != nil {
		return err
	}
	defer stop()
	listen, err := bench.LocalAddr()
	if err != nil {
		return err
	}
	srv, err := broker.Start(broker.Config{StoreDir: filepath.Join(dir, "jetstream"), Listen: listen})
	if err != nil {
		return err
	}
	defer srv.Shutdown()
	natsURL := "nats://" + listen
	last, err := bench.PublishSessions(ctx, bench.Sessions{NATSURL: natsURL, Source: source, Partitions: partitions,
		Apply: apply, PerTx: perTx, IDBase: 10_000_000, FirstLSN: 0x1000000})
	if err != nil {
		return err
	}
	bench.Note("%d rows in the archive, %d delete events in %d-row transactions, %d partitions, the projector in process", rows, apply, perTx, partitions)
	serverNote(ctx, pg)

	// Two template archives, prefilled once; every round applies into a
	// fresh file copy of one, so each starts from the same state.
	for _, expired := range []bool{false, true} {
		url, err := bench.CreateDatabase(ctx, pg, templateName(expired))
		if err != nil {
			return err
		}
		if err := prefill(ctx, url, rows, expired); err != nil {
			return err
		}
	}
	var p pairFigures
	for i := 1; i <= pairs; i++ {
		bench.LoadNote(fmt.Sprintf("before pair %d", i))
		var without, with applyResult
		for _, cleanup := range pairOrder(i) {
			r, err := round(ctx, applyCase{pg: pg, natsURL: natsURL, last: last, apply: apply, rows: rows, pair: i, cleanup: cleanup})
			if err != nil {
				return err
			}
			if cleanup {
				with = r
			} else {
				without = r
			}
		}
		p.add(i, apply, without, with)
	}
	p.report(pairs, apply)

	bench.LoadNote("after the apply runs")
	url, err := copyArchive(ctx, pg, "erase", false)
	if err != nil {
		return err
	}
	return eraseRun(ctx, url, rows)
}

// serverNote prints what the bench server is configured with.
func serverNote(ctx context.Context, pg *testenv.Postgres) {
	conn, err := pgx.Connect(ctx, pg.URL("postgres"))
	if err != nil {
		bench.Note("server settings: %v", err)
		return
	}
	defer conn.Close(ctx)
	var parts []string
	for _, name := range []string{"shared_buffers", "max_wal_size", "full_page_writes", "fsync", "synchronous_commit", "wal_buffers", "autovacuum_vacuum_cost_limit"} {
		var v string
		if err := conn.QueryRow(ctx, "SELECT current_setting($1)", name).Scan(&v); err == nil {
			parts = append(parts, name+" = "+v)
		}
	}
	bench.Note("server: %s", strings.Join(parts, ", "))
}

func templateName(expired bool) string {
	return map[bool]string{false: "template_unexpired", true: "template_expired"}[expired]
}

// copyArchive creates database name as a file copy of the unexpired or
// expired template, then checkpoints and waits (up to two minutes) until
// no autovacuum worker runs, so that a round starts with no dirty buffers
// and no vacuum of an earlier round's deletes.
func copyArchive(ctx context.Context, pg *testenv.Postgres, name string, expired bool) (string, error) {
	conn, err := pgx.Connect(ctx, pg.URL("postgres"))
	if err != nil {
		return "", fmt.Errorf("connect postgres: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()+" TEMPLATE "+
		pgx.Identifier{templateName(expired)}.Sanitize()+" STRATEGY = FILE_COPY"); err != nil {
		return "", fmt.Errorf("create database %s: %w", name, err)
	}
	if _, err := conn.Exec(ctx, "CHECKPOINT"); err != nil {
		return "", fmt.Errorf("checkpoint: %w", err)
	}
	deadline := time.Now().Add(2 * time.Minute)
	for {
		var n int
		if err := conn.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'autovacuum worker'`).Scan(&n); err != nil {
			return "", fmt.Errorf("autovacuum workers: %w", err)
		}
		if n == 0 {
			break
		}
		if time.Now().After(deadline) {
			bench.Note("%s: %d autovacuum workers still running after two minutes", name, n)
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	return pg.URL(name), nil
}

// dropDatabase drops database name (its autovacuum with it).
func dropDatabase(ctx context.Context, pg *testenv.Postgres, name string) error {
	conn, err := pgx.Connect(ctx, pg.URL("postgres"))
	if err != nil {
		return fmt.Errorf("connect postgres: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "DROP DATABASE "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
		return fmt.Errorf("drop database %s: %w", name, err)
	}
	return nil
}

// applyCase is one apply of a pair: the stream at natsURL (last: each
// partition's last LSN; apply of its events, holding rows rows) into a
// database of pg, with or without cleanup.
type applyCase struct {
	pg                *testenv.Postgres
	natsURL           string
	last              map[int]event.LSN
	apply, rows, pair int
	cleanup           bool
}

// round is one apply of a pair into a fresh copy of a template archive,
// dropped after.
func round(ctx context.Context, c applyCase) (applyResult, error) {
	name := fmt.Sprintf("%s_pair%d", sideName(c.cleanup), c.pair)
	url, err := copyArchive(ctx, c.pg, name, c.cleanup)
	if err != nil {
		return applyResult{}, err
	}
	r, err := applyRun(ctx, c, url)
	if err != nil {
		return applyResult{}, err
	}
	return r, dropDatabase(ctx, c.pg, name)
}

func sideName(cleanup bool) string {
	return map[bool]string{false: "without_cleanup", true: "with_cleanup"}[cleanup]
}

// pairOrder is the order of pair p's applies: odd pairs start without
// cleanup, even pairs with, so a load drifting through the bench favours
// neither side.
func pairOrder(p int) []bool {
	if p%2 == 1 {
		return []bool{false, true}
	}
	return []bool{true, false}
}

// pairFigures collects the pairs' figures for their medians.
type pairFigures struct {
	ratios, without, with, cleanup           []float64
	pgWithout, pgWith, procWithout, procWith []float64 // µs per applied row, until applied
	pgWithAll, procWithAll                   []float64 // µs per applied row, until applied and cleaned
}

func (p *pairFigures) add(i, apply int, without, with applyResult) {
	us := func(s float64) float64 { return s / float64(apply) * 1e6 }
	ratio := with.rate / without.rate
	pre := fmt.Sprintf("retention.pair%d.", i)
	bench.Figure(pre+"apply_ratio", ratio, fmt.Sprintf("(with / without cleanup: %.0f / %.0f rows/s)", with.rate, without.rate))
	bench.Figure(pre+"cleanup_rows_per_sec", with.cleanup, "rows/s")
	bench.Figure(pre+"cpu_us_per_applied_row.postgres", us(with.applied.postgres),
		fmt.Sprintf("us with cleanup, %.1f without (until applied)", us(without.applied.postgres)))
	bench.Figure(pre+"cpu_us_per_applied_row.process", us(with.applied.proc),
		fmt.Sprintf("us with cleanup, %.1f without (until applied)", us(without.applied.proc)))
	p.ratios = append(p.ratios, ratio)
	p.without, p.with, p.cleanup = append(p.without, without.rate), append(p.with, with.rate), append(p.cleanup, with.cleanup)
	p.pgWithout, p.pgWith = append(p.pgWithout, us(without.applied.postgres)), append(p.pgWith, us(with.applied.postgres))
	p.procWithout, p.procWith = append(p.procWithout, us(without.applied.proc)), append(p.procWith, us(with.applied.proc))
	p.pgWithAll, p.procWithAll = append(p.pgWithAll, us(with.total.postgres)), append(p.procWithAll, us(with.total.proc))
}

func (p *pairFigures) report(pairs, apply int) {
	of := fmt.Sprintf("median of %d interleaved pairs", pairs)
	bench.Figure("retention.apply_rows_per_sec.without_cleanup", bench.Median(p.without), "rows/s ("+of+")")
	bench.Figure("retention.apply_rows_per_sec.with_cleanup", bench.Median(p.with), "rows/s ("+of+")")
	bench.Figure("retention.apply_ratio", bench.Median(p.ratios), "(with / without cleanup, "+of+"; target >= 0.85)")
	bench.Figure("retention.apply_ratio_min", slices.Min(p.ratios), fmt.Sprintf("(the lowest of the %d pairs; target >= 0.85)", pairs))
	bench.Figure("retention.cleanup_rows_per_sec", bench.Median(p.cleanup), "rows/s ("+of+"; target >= 50,000)")
	bench.Figure("retention.cleanup_rows_per_sec_min", slices.Min(p.cleanup), "rows/s (the lowest pair; target >= 50,000)")
	bench.Figure("retention.cpu_us_per_applied_row.postgres.without_cleanup", bench.Median(p.pgWithout), "us ("+of+", until applied)")
	bench.Figure("retention.cpu_us_per_applied_row.postgres.with_cleanup", bench.Median(p.pgWith), "us ("+of+", until applied: the apply and the cleanup's share beside it)")
	bench.Figure("retention.cpu_us_per_applied_row.process.without_cleanup", bench.Median(p.procWithout), "us ("+of+", until applied)")
	bench.Figure("retention.cpu_us_per_applied_row.process.with_cleanup", bench.Median(p.procWith), "us ("+of+", until applied)")
	bench.Figure("retention.cpu_us_per_applied_row.postgres.with_cleanup_until_cleaned", bench.Median(p.pgWithAll),
		fmt.Sprintf("us (%s, until applied and cleaned, per applied row of %d)", of, apply))
	bench.Figure("retention.cpu_us_per_applied_row.process.with_cleanup_until_cleaned", bench.Median(p.procWithAll), "us ("+of+", until applied and cleaned)")
}

// prefill makes archive v1 and writes rows rows into it, expired or not.
func prefill(ctx context.Context, url string, rows int, expired bool) error {
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := migrations.Apply(ctx, pool); err != nil {
		return err
	}
	if err := version.EnsureArchive(ctx, pool, partitions, snapshot.DDL); err != nil {
		return err
	}
	expiry := "now() + interval '100 years'"
	if expired {
		expiry = "now() - interval '1 day' + i * interval '1 microsecond'"
	}
	start := time.Now()
	_, err = pool.Exec(ctx, `INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row, correlation_id, commit_lsn, seq, expires_at)
		SELECT 'old', 'public', 'customers', jsonb_build_object('id', i),
		       jsonb_build_object('id', i, 'email', 'user-' || i || '@example.com', 'name', 'customer ' || i),
		       'old:' || (i / 10) || ':0/' || to_hex(i / 10 + 1), ('0/' || to_hex(i / 10 + 1))::pg_lsn, i % 10, `+expiry+`
		FROM generate_series(1, $1) i`, rows)
	if err != nil {
		return fmt.Errorf("prefill: %w", err)
	}
	if _, err := pool.Exec(ctx, `VACUUM ANALYZE archive_v1.rows`); err != nil {
		return err
	}
	bench.Note("prefilled %d rows (expired %v) in %s", rows, expired, time.Since(start).Round(time.Millisecond))
	return nil
}

// applyResult is one apply run's figures: the apply rate, the cleanup
// rate (with cleanup), and the CPU seconds until the stream was applied
// and until it was applied and (with cleanup) the expired rows deleted.
type applyResult struct {
	rate, cleanup  float64
	applied, total cpuTimes
}

// applyRun applies the stream into url and returns its figures; it prints
// the CPU seconds the run took, what the sampler saw and, with cleanup, the
// database time of the cleanup's statements.
func applyRun(ctx context.Context, c applyCase, url string) (applyResult, error) {
	cfg := projection.Config{TargetURL: url, NATSURL: c.natsURL, SourceName: source, WorkerID: "bench",
		ArchiveTTL: map[string]time.Duration{"*": 100 * 365 * 24 * time.Hour}, CleanupInterval: -1}
	if c.cleanup {
		cfg.CleanupInterval = 50 * time.Millisecond
		cfg.CleanupRate = cleanupRate
	}
	svc, err := projection.New(cfg, projection.WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil))))
	if err != nil {
		return applyResult{}, err
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return applyResult{}, err
	}
	defer pool.Close()
	if err := resetStatements(ctx, pool); err != nil {
		return applyResult{}, err
	}
	name := fmt.Sprintf("%s.pair%d", sideName(c.cleanup), c.pair)
	stats0 := readServerStats(ctx, pool)
	samp := startSampler(ctx, pool)
	cpu0 := cpuNow(c.pg)
	start := time.Now()
	if err := svc.Start(ctx); err != nil {
		return applyResult{}, err
	}
	defer func() { _ = svc.Stop(context.Background()) }()
	var applied, cleaned time.Time
	var r applyResult
	deadline := time.Now().Add(30 * time.Minute)
	for applied.IsZero() || (c.cleanup && cleaned.IsZero()) {
		if time.Now().After(deadline) {
			return applyResult{}, fmt.Errorf("not done in 30 minutes")
		}
		time.Sleep(200 * time.Millisecond)
		if applied.IsZero() {
			done, err := appliedAll(ctx, pool, c.last, c.apply)
			if err != nil {
				return applyResult{}, err
			}
			if done {
				applied = time.Now()
				r.applied = cpuNow(c.pg).minus(cpu0)
			}
		}
		if c.cleanup && cleaned.IsZero() {
			// By the expires_at index (only the prefilled rows are
			// expired): a scan of the heap would read the dead tuples the
			// cleanup leaves at its start.
			var left bool
			if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM archive_v1.rows WHERE expires_at < now() AND source = 'old')`).Scan(&left); err != nil {
				return applyResult{}, err
			}
			if !left {
				cleaned = time.Now()
			}
		}
	}
	r.total = cpuNow(c.pg).minus(cpu0)
	samp.report(name)
	stats0.note(name, readServerStats(ctx, pool))
	if c.pair == 1 {
		topStatements(ctx, pool, name, 12)
	}
	bench.Figure("retention.cpu_seconds.postgres."+name, r.total.postgres, fmt.Sprintf("s (until applied and, with cleanup, cleaned; %.2f until applied)", r.applied.postgres))
	bench.Figure("retention.cpu_seconds.process."+name, r.total.proc, fmt.Sprintf("s (projector, JetStream server and bench; %.2f until applied)", r.applied.proc))
	r.rate = float64(c.apply) / applied.Sub(start).Seconds()
	bench.Figure("retention.apply_rows_per_sec."+name, r.rate, "rows/s")
	if !c.cleanup {
		return r, nil
	}
	dbTime, calls, err := statementTime(ctx, pool, "%expires_at <= now()%")
	if err != nil {
		return applyResult{}, err
	}
	bench.Figure("retention.cleanup_database_seconds.pair"+strconv.Itoa(c.pair), dbTime.Seconds(), fmt.Sprintf("s (%d statements: batches and oldest-due checks, for %d rows: %.0f rows per database second)",
		calls, c.rows, float64(c.rows)/dbTime.Seconds()))
	if cleaned.Before(applied) {
		bench.Note("%s: cleanup finished %s before the apply (all of it ran while applying)", name, applied.Sub(cleaned).Round(time.Millisecond))
	} else {
		bench.Note("%s: cleanup finished %s after the apply", name, cleaned.Sub(applied).Round(time.Millisecond))
	}
	r.cleanup = float64(c.rows) / cleaned.Sub(start).Seconds()
	bench.Figure("retention.cleanup_rows_per_sec.pair"+strconv.Itoa(c.pair), r.cleanup, "rows/s (start to the last expired row)")
	return r, nil
}

// appliedAll: every partition's progress has reached its last commit
// (read from epitaph.progress, cheap), and then the stream's rows are all
// archived and verified (counted only then: the count reads the archive,
// and polled every 200 ms it cost the apply's server more database time
// than the cleanup, 14 s a round of 1M rows, and less with cleanup, as the
// rows it scans are deleted).
func appliedAll(ctx context.Context, pool *pgxpool.Pool, last map[int]event.LSN, apply int) (bool, error) {
	var parts []int
	var lsns []string
	for p, lsn := range last {
		parts, lsns = append(parts, p), append(lsns, lsn.String())
	}
	var behind int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM unnest($1::int[], $2::text[]) w(p, lsn)
		WHERE NOT EXISTS (SELECT 1 FROM epitaph.progress g WHERE g.partition = w.p AND g.last_commit_lsn >= w.lsn::pg_lsn)`, parts, lsns).Scan(&behind); err != nil {
		return false, fmt.Errorf("read progress: %w", err)
	}
	if behind > 0 {
		return false, nil
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM archive_v1.rows WHERE source = $1 AND verified`, source).Scan(&n); err != nil {
		return false, fmt.Errorf("count archived rows: %w", err)
	}
	return n >= apply, nil
}

// eraseRun erases one customer by --match on the archive of url.
func eraseRun(ctx context.Context, url string, rows int) error {
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return err
	}
	defer pool.Close()
	match := fmt.Sprintf(`{"email": "user-%d@example.com"}`, rows/2)
	var plan []string
	res, err := pool.Query(ctx, `EXPLAIN SELECT 1 FROM archive_v1.rows r WHERE r.schema_name = 'public' AND r.table_name = 'customers' AND r.row @> $1::jsonb`, match)
	if err != nil {
		return err
	}
	for res.Next() {
		var line string
		if err := res.Scan(&line); err != nil {
			return err
		}
		plan = append(plan, strings.TrimSpace(line))
	}
	if err := res.Err(); err != nil {
		return err
	}
	uses := strings.Contains(strings.Join(plan, " "), "rows_row_match_idx")
	bench.Note("erase plan uses the GIN index: %v (%s)", uses, strings.Join(plan, " | "))
	if err := resetStatements(ctx, pool); err != nil {
		return err
	}
	start := time.Now()
	rc, err := erasure.Erase(ctx, pool, erasure.EraseOptions{Table: "public.customers", Match: json.RawMessage(match),
		WithChildren: true, Actor: "bench"})
	if err != nil {
		return err
	}
	took := time.Since(start)
	if rc.Removed["archive_v1.rows"] != 1 {
		return fmt.Errorf("erase removed %v, want one row", rc.Removed)
	}
	dbTime, calls, err := statementTime(ctx, pool, "%")
	if err != nil {
		return err
	}
	bench.Figure("retention.erase_by_match_database_seconds", dbTime.Seconds(),
		fmt.Sprintf("s (%d statements, %d-row archive; target < 1)", calls, rows))
	bench.Figure("retention.erase_by_match_seconds", took.Seconds(), "s (wall)")
	return nil
}

// resetStatements empties pg_stat_statements (created in the database of
// pool if missing).
func resetStatements(ctx context.Context, pool *pgxpool.Pool) error {
	if _, err := pool.Exec(ctx, `CREATE EXTENSION IF NOT EXISTS pg_stat_statements`); err != nil {
		return fmt.Errorf("pg_stat_statements: %w", err)
	}
	if _, err := pool.Exec(ctx, `SELECT pg_stat_statements_reset()`); err != nil {
		return fmt.Errorf("pg_stat_statements: %w", err)
	}
	return nil
}

// statementTime is the execution time and calls of the statements of
// pool's database whose text is like pattern, since the last reset (the
// reset itself left out).
func statementTime(ctx context.Context, pool *pgxpool.Pool, pattern string) (time.Duration, int, error) {
	var ms float64
	var calls int
	err := pool.QueryRow(ctx, `SELECT COALESCE(sum(total_exec_time), 0), COALESCE(sum(calls), 0)::int FROM pg_stat_statements
		WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) AND query LIKE $1
		  AND query NOT LIKE '%pg_stat_statements%'`, pattern).Scan(&ms, &calls)
	if err != nil {
		return 0, 0, fmt.Errorf("pg_stat_statements: %w", err)
	}
	return time.Duration(ms * float64(time.Millisecond)), calls, nil
}

// cpuTimes are CPU seconds consumed so far.
type cpuTimes struct{ postgres, proc float64 }

func (a cpuTimes) minus(b cpuTimes) cpuTimes {
	return cpuTimes{a.postgres - b.postgres, a.proc - b.proc}
}

// cpuNow reads the CPU seconds of pg's postmaster with its backends (live
// ones, and exited ones through the postmaster's children times) and of
// this process, from /proc (zero where it cannot be read).
func cpuNow(pg *testenv.Postgres) cpuTimes {
	var t cpuTimes
	t.proc, _ = procTicks(os.Getpid())
	b, err := os.ReadFile(filepath.Join(pg.DataDir, "postmaster.pid"))
	if err != nil {
		return t
	}
	pm, err := strconv.Atoi(strings.TrimSpace(strings.SplitN(string(b), "\n", 2)[0]))
	if err != nil {
		return t
	}
	t.postgres, _ = procTicks(pm)
	dirs, _ := os.ReadDir("/proc")
	for _, d := range dirs {
		if pid, err := strconv.Atoi(d.Name()); err == nil && parentOf(pid) == pm {
			c, _ := procTicks(pid)
			t.postgres += c
		}
	}
	return t
}

// statFields are the fields of /proc/PID/stat after the command name.
func statFields(pid int) []string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return nil
	}
	s := string(b)
	return strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
}

// procTicks is utime+stime+cutime+cstime of pid in seconds.
func procTicks(pid int) (float64, error) {
	f := statFields(pid)
	if len(f) < 15 {
		return 0, fmt.Errorf("no /proc/%d/stat", pid)
	}
	var ticks int64
	for _, x := range f[11:15] {
		v, _ := strconv.ParseInt(x, 10, 64)
		ticks += v
	}
	return float64(ticks) / 100, nil
}

func parentOf(pid int) int {
	f := statFields(pid)
	if len(f) < 2 {
		return 0
	}
	ppid, _ := strconv.Atoi(f[1])
	return ppid
}
