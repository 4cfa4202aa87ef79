// Command scale is `make bench-scale`: what the archive costs as it grows.
// On one throwaway Postgres and an embedded JetStream server, with the
// projector service in process, for each archive size of -sizes (and an
// empty archive first, the baseline) in a database of its own:
//
//   - the archive (partitioned by month) is filled directly in the target:
//     rows spread over 13 months, the oldest month's rows expired; each
//     month's partition filled by INSERT .. SELECT generate_series before
//     it has an index, its indexes built after (a table per core), then
//     attached;
//   - the same stream of -apply delete events (published once) is applied
//     through the projector on top: the apply rate, and the CPU per row of
//     Postgres plus this process (projector, JetStream server, bench);
//   - 1,000 lookups by key on archive.rows: their p99;
//   - one retention batch, which drops the expired month's partition;
//   - an erasure by --match of one customer.
//
// Then a quick A/B of the GIN index over every row (jsonb_path_ops): the
// same stream applied into an empty archive without it.
//
// Output lines are "BENCH <name> <value> <unit>" and "NOTE <text>"; a
// figure of a size carries its label (100k, 1m, 20m).
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/bench"
	"github.com/epitaph-dev/epitaph/internal/broker"
	"github.com/epitaph-dev/epitaph/internal/pgquote"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/erasure"
	"github.com/epitaph-dev/epitaph/projection/retention"
	"github.com/epitaph-dev/epitaph/projection/snapshot"
	"github.com/epitaph-dev/epitaph/projection/version"
)

const (
	source     = "bench"
	partitions = 4
	months     = 13 // the archive's rows span this many months, the oldest expired
)

func main() {
	sizes := flag.String("sizes", "1000000,5000000,20000000", "archive sizes (rows) filled before the apply, comma-separated")
	apply := flag.Int("apply", 100_000, "delete events applied through the projector into each archive")
	perTx := flag.Int("per-tx", 10, "rows per source transaction")
	gin := flag.Int("gin-pairs", 3, "interleaved pairs of applies into an empty archive with and without the GIN index over every row (0: none)")
	flag.Parse()
	var ns []int
	for _, s := range strings.FieldsFunc(*sizes, func(r rune) bool { return r == ',' }) {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n < months*10 {
			log.Fatalf("-sizes: %q is not a size of at least %d rows", s, months*10)
		}
		ns = append(ns, n)
	}
	if err := run(context.Background(), ns, *apply, *perTx, *gin); err != nil {
		log.Fatal(err)
	}
}

// label names a size: 100k, 1m, 20m.
func label(n int) string {
	switch {
	case n == 0:
		return "empty"
	case n%1_000_000 == 0:
		return strconv.Itoa(n/1_000_000) + "m"
	case n%1000 == 0:
		return strconv.Itoa(n/1000) + "k"
	}
	return strconv.Itoa(n)
}

// result is one archive size's figures.
type result struct {
	rate, cpuPerRow float64
}

func run(ctx context.Context, sizes []int, apply, perTx, ginPairs int) error {
	bench.LoadNote("before")
	dir, err := bench.TempDir("epitaph-bench-scale")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	pg, err := testenv.StartPostgres()
	if err != nil {
		return err
	}
	defer func() { _ = pg.Stop(); _ = os.RemoveAll(filepath.Dir(pg.DataDir)) }()
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
		Apply: apply, PerTx: perTx, IDBase: 10_000_000_000, FirstLSN: 0x100000000})
	if err != nil {
		return err
	}
	bench.Note("%d delete events in %d-row transactions, %d stream partitions, the projector in process; archive sizes %v", apply, perTx, partitions, sizes)
	s := applyStream{pg: pg, natsURL: natsURL, last: last, apply: apply}

	// Each size's apply is bracketed by two into an empty archive, its
	// baseline: the other load on the machine drifts less between
	// neighbouring runs than across the whole bench.
	var empties []result
	emptyRun := func() (result, error) {
		r, err := sizeRun(ctx, s, 0, true)
		empties = append(empties, r)
		return r, err
	}
	if len(sizes) == 0 {
		if _, err := emptyRun(); err != nil {
			return err
		}
	}
	for _, n := range sizes {
		before, err := emptyRun()
		if err != nil {
			return err
		}
		r, err := sizeRun(ctx, s, n, true)
		if err != nil {
			return err
		}
		after, err := emptyRun()
		if err != nil {
			return err
		}
		base := (before.rate + after.rate) / 2
		baseCPU := (before.cpuPerRow + after.cpuPerRow) / 2
		bench.Figure("scale.apply_ratio_"+label(n), r.rate/base,
			fmt.Sprintf("(apply rows/s with %d archived / empty before and after: %.0f / (%.0f, %.0f); CPU per row %.1f / %.1f us; target >= 0.9)",
				n, r.rate, before.rate, after.rate, r.cpuPerRow, baseCPU))
		ceiling := float64(runtime.NumCPU()) * 1e6 / r.cpuPerRow
		bench.Figure("scale.cpu_us_per_row_e2e_"+label(n), r.cpuPerRow,
			fmt.Sprintf("us (Postgres + projector + JetStream server + bench, per applied row; stream to archive, no capture); %.0f rows/s measured beside a CPU ceiling of %.0f rows/s on %d cores",
				r.rate, ceiling, runtime.NumCPU()))
	}
	var cpus, rates []float64
	for _, e := range empties {
		cpus, rates = append(cpus, e.cpuPerRow), append(rates, e.rate)
	}
	cpu, rate := bench.Median(cpus), bench.Median(rates)
	ceiling := float64(runtime.NumCPU()) * 1e6 / cpu
	bench.Figure("scale.cpu_us_per_row_e2e", cpu, fmt.Sprintf("us (median of %d applies into an empty archive; target <= 60)", len(empties)))
	bench.Figure("scale.e2e_rows_per_sec", rate, fmt.Sprintf("rows/s (median of the same applies; target >= 32000; the CPU ceiling %.0f rows/s on %d cores)", ceiling, runtime.NumCPU()))
	bench.Figure("scale.cpu_ceiling_rows_per_sec", ceiling, fmt.Sprintf("rows/s (%d cores x 1e6 / %.1f us per row)", runtime.NumCPU(), cpu))
	return ginAB(ctx, s, ginPairs)
}

// ginAB applies the stream into empty archives with and without the GIN
// index, pairs interleaved (the order alternating), and prints the medians
// of the CPU per row and the index's share of it.
func ginAB(ctx context.Context, s applyStream, pairs int) error {
	if pairs <= 0 {
		return nil
	}
	var with, without, rateWith, rateWithout []float64
	for i := range pairs {
		for _, gin := range [][]bool{{true, false}, {false, true}}[i%2] {
			r, err := sizeRun(ctx, s, 0, gin)
			if err != nil {
				return err
			}
			if gin {
				with, rateWith = append(with, r.cpuPerRow), append(rateWith, r.rate)
			} else {
				without, rateWithout = append(without, r.cpuPerRow), append(rateWithout, r.rate)
			}
		}
	}
	w, wo := bench.Median(with), bench.Median(without)
	bench.Figure("scale.gin_share_of_apply_cpu", 1-wo/w,
		fmt.Sprintf("(median CPU per applied row of %d interleaved pairs: %.1f us with the GIN index, %.1f us without; apply %.0f vs %.0f rows/s, empty archive)",
			pairs, w, wo, bench.Median(rateWith), bench.Median(rateWithout)))
	return nil
}

// applyStream is what every run applies: apply events of the stream at
// natsURL (last: each partition's last LSN), measured on pg.
type applyStream struct {
	pg      *testenv.Postgres
	natsURL string
	last    map[int]event.LSN
	apply   int
}

// sizeRun fills a fresh archive with n rows, applies the stream on top and
// measures it; for n > 0 it also measures lookups, the retention drop and
// an erasure. withGIN false drops the GIN index before the apply.
func sizeRun(ctx context.Context, s applyStream, n int, withGIN bool) (result, error) {
	name := "scale_" + label(n)
	if !withGIN {
		name += "_nogin"
	}
	url, err := bench.CreateDatabase(ctx, s.pg, name)
	if err != nil {
		return result{}, err
	}
	defer func() { _ = bench.DropDatabase(context.WithoutCancel(ctx), s.pg, name) }()
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return result{}, err
	}
	defer pool.Close()
	if err := fill(ctx, pool, n); err != nil {
		return result{}, err
	}
	if !withGIN {
		if _, err := pool.Exec(ctx, `DROP INDEX archive_v1.rows_row_match_idx`); err != nil {
			return result{}, err
		}
	}
	if _, err := pool.Exec(ctx, `CHECKPOINT`); err != nil {
		return result{}, err
	}
	r, err := applyRun(ctx, s, pool, url)
	if err != nil {
		return result{}, err
	}
	lbl := label(n)
	if !withGIN {
		lbl += "_without_gin"
	}
	bench.Figure("scale.apply_rows_per_sec_"+lbl, r.rate, fmt.Sprintf("rows/s (%.1f us CPU per row)", r.cpuPerRow))
	if n == 0 {
		return r, nil
	}
	if err := lookups(ctx, pool, n); err != nil {
		return result{}, err
	}
	if err := retentionDrop(ctx, pool, n); err != nil {
		return result{}, err
	}
	return r, eraseOne(ctx, pool, n)
}

// fill makes archive v1 (partitions of the last 13 months) and writes n
// rows into it directly, a transaction of 10 rows per month in turn; the
// oldest month's rows are expired. The bulk path: each month's partition
// is first a plain table, filled by INSERT .. SELECT without an index,
// given the rows table's indexes and unique key (built after the rows, one
// table per core), vacuumed, and then attached, which adopts those indexes.
func fill(ctx context.Context, pool *pgxpool.Pool, n int) error {
	if err := migrations.Apply(ctx, pool); err != nil {
		return err
	}
	if err := version.EnsureArchive(ctx, pool, partitions, snapshot.DDL); err != nil {
		return err
	}
	schema := archive.Schema(1)
	now := time.Now().UTC()
	var starts []time.Time
	for m := range months {
		starts = append(starts, archive.PeriodStart(archive.PeriodMonth, now).AddDate(0, -m, 0))
	}
	if n == 0 {
		return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := archive.EnsurePartitions(ctx, tx, schema, archive.PeriodMonth, starts...)
			return err
		})
	}
	start := time.Now()
	ddl, err := partitionDDL(ctx, pool, schema)
	if err != nil {
		return err
	}
	var took steps
	work := make(chan int, months)
	for m := range months {
		work <- m
	}
	close(work)
	errs := make(chan error, runtime.NumCPU())
	for range runtime.NumCPU() {
		go func() {
			for m := range work {
				if err := fillMonth(ctx, pool, schema, ddl, starts[m], m, n, &took); err != nil {
					errs <- err
					return
				}
			}
			errs <- nil
		}()
	}
	for range runtime.NumCPU() {
		if e := <-errs; e != nil && err == nil {
			err = e
		}
	}
	if err != nil {
		return err
	}
	built := time.Since(start)
	attach := time.Now()
	for _, s := range starts {
		tbl := archive.Ident(schema, archive.PartitionName(s))
		_, err := pool.Exec(ctx, `ALTER TABLE `+archive.Ident(schema, "rows")+` ATTACH PARTITION `+tbl+` FOR VALUES FROM (`+
			pgquote.Literal(s.Format(time.RFC3339))+`) TO (`+pgquote.Literal(archive.PeriodEnd(archive.PeriodMonth, s).Format(time.RFC3339))+`);
			ALTER TABLE `+tbl+` DROP CONSTRAINT fill_bounds`)
		if err != nil {
			return fmt.Errorf("attach %s: %w", tbl, err)
		}
	}
	took.add("attach", time.Since(attach))
	analyze := time.Now()
	if _, err := pool.Exec(ctx, `ANALYZE `+archive.Ident(schema, "rows")); err != nil {
		return err
	}
	took.add("analyze", time.Since(analyze))
	var loose int // an index of a partition that is not one of the rows table's: built by the attach beside the bench's
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_index x JOIN pg_inherits i ON i.inhrelid = x.indrelid
		WHERE i.inhparent = to_regclass($1) AND NOT EXISTS (SELECT 1 FROM pg_inherits j WHERE j.inhrelid = x.indexrelid)`,
		archive.Ident(schema, "rows")).Scan(&loose); err != nil {
		return err
	}
	if loose > 0 {
		return fmt.Errorf("fill: %d indexes of the partitions are not the rows table's (the attach built its own)", loose)
	}
	bench.Note("filled %d rows in %s (rows, indexes and vacuum %s on %d connections; then attach and analyze); summed: %s", n,
		time.Since(start).Round(time.Millisecond), built.Round(time.Millisecond), runtime.NumCPU(), took.String())
	return nil
}

// partitionDDL is, for a partition %[1]s (its name) of the schema's rows
// table, the statements making its indexes and unique key as the rows
// table has them, so that attaching it adopts them instead of building
// them.
func partitionDDL(ctx context.Context, pool *pgxpool.Pool, schema string) ([]string, error) {
	rows, err := pool.Query(ctx, `SELECT c.relname, pg_get_indexdef(i.indexrelid), con.conname, pg_get_constraintdef(con.oid)
		FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
		LEFT JOIN pg_constraint con ON con.conindid = i.indexrelid AND con.conrelid = i.indrelid
		WHERE i.indrelid = to_regclass($1) ORDER BY 1`, archive.Ident(schema, "rows"))
	if err != nil {
		return nil, err
	}
	var out []string
	var name, def string
	var conName, conDef *string
	_, err = pgx.ForEachRow(rows, []any{&name, &def, &conName, &conDef}, func() error {
		if conName != nil {
			out = append(out, `ALTER TABLE %[1]s ADD CONSTRAINT %[2]s `+*conDef)
			return nil
		}
		at := strings.Index(def, " USING ")
		if at < 0 {
			return fmt.Errorf("index %s: definition %q", name, def)
		}
		out = append(out, `CREATE INDEX %[2]s ON %[1]s`+def[at:])
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("indexes of %s.rows: %w", schema, err)
	}
	return out, nil
}

// fillMonth makes the table of the month starting at s (month m back
// from now) with its rows of 1..n, its indexes, and a CHECK of its bounds
// (so the attach need not scan it).
func fillMonth(ctx context.Context, pool *pgxpool.Pool, schema string, ddl []string, s time.Time, m, n int, took *steps) error {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	name := archive.PartitionName(s)
	tbl := archive.Ident(schema, name)
	lo, hi := pgquote.Literal(s.Format(time.RFC3339)), pgquote.Literal(archive.PeriodEnd(archive.PeriodMonth, s).Format(time.RFC3339))
	stmts := []string{
		`SET maintenance_work_mem = '1GB'`,
		`SET max_parallel_maintenance_workers = 0`,
		`DROP TABLE IF EXISTS ` + tbl, // the current month's, empty, made with the version
		`CREATE TABLE ` + tbl + ` (LIKE ` + archive.Ident(schema, "rows") + ` INCLUDING DEFAULTS)`,
	}
	for _, st := range stmts {
		if _, err := conn.Exec(ctx, st); err != nil {
			return fmt.Errorf("fill %s: %w", name, err)
		}
	}
	// Row i (1..n) is seq i%10 of transaction i/10, whose month is
	// (i/10)%13 months back.
	t := time.Now()
	_, err = conn.Exec(ctx, `INSERT INTO `+tbl+` (source, schema_name, table_name, key, row, identity, correlation_id, xid,
			commit_lsn, commit_time, seq, expires_at, columns)
		SELECT 'old', 'public', 'customers', jsonb_build_object('id', i),
		       jsonb_build_object('id', i, 'email', 'user-' || i || '@example.com', 'name', 'customer ' || i), 'full',
		       'old:' || t || ':0/' || to_hex(t + 1), t, ('0/' || to_hex(t + 1))::pg_lsn,
		       $3::timestamptz + interval '1 day', s,
		       CASE WHEN $2::bigint = $4::bigint - 1 THEN now() - interval '1 day' ELSE now() + interval '100 years' END,
		       '[{"name":"id","type":"bigint","pk":true}]'
		FROM generate_series($2::bigint, $1::bigint / 10, $4::bigint) t, generate_series(0, 9) s, LATERAL (SELECT t * 10 + s AS i) x
		WHERE i BETWEEN 1 AND $1::bigint`, n, m, s, months)
	if err != nil {
		return fmt.Errorf("fill %s: %w", name, err)
	}
	took.add("rows", time.Since(t))
	for i, d := range ddl {
		t := time.Now()
		if _, err := conn.Exec(ctx, fmt.Sprintf(d, tbl, archive.Ident(name+"_fill_"+strconv.Itoa(i)))); err != nil {
			return fmt.Errorf("fill %s: %w", name, err)
		}
		took.add("index"+strconv.Itoa(i), time.Since(t))
	}
	t = time.Now()
	_, err = conn.Exec(ctx, `ALTER TABLE `+tbl+` ADD CONSTRAINT fill_bounds CHECK (commit_time IS NOT NULL AND commit_time >= `+lo+` AND commit_time < `+hi+`)`)
	if err != nil {
		return fmt.Errorf("fill %s: %w", name, err)
	}
	took.add("check", time.Since(t))
	t = time.Now()
	if _, err := conn.Exec(ctx, `VACUUM (FREEZE) `+tbl); err != nil {
		return fmt.Errorf("fill %s: %w", name, err)
	}
	took.add("vacuum", time.Since(t))
	return nil
}

// steps sums the time of the fill's steps over its connections.
type steps struct {
	mu    sync.Mutex
	names []string
	took  map[string]time.Duration
}

func (s *steps) add(name string, d time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.took == nil {
		s.took = map[string]time.Duration{}
	}
	if _, ok := s.took[name]; !ok {
		s.names = append(s.names, name)
	}
	s.took[name] += d
}

func (s *steps) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var b strings.Builder
	for i, n := range s.names {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "%s %s", n, s.took[n].Round(time.Millisecond))
	}
	return b.String()
}

// applyRun applies the stream into the archive of url with the projector
// in process and returns the rate and the CPU per applied row.
func applyRun(ctx context.Context, s applyStream, pool *pgxpool.Pool, url string) (result, error) {
	cfg := projection.Config{TargetURL: url, NATSURL: s.natsURL, SourceName: source, WorkerID: "bench",
		ArchiveTTL: map[string]time.Duration{"*": 100 * 365 * 24 * time.Hour}, CleanupInterval: -1}
	svc, err := projection.New(cfg, projection.WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil))))
	if err != nil {
		return result{}, err
	}
	cpu0, err := cpuNow(s.pg)
	if err != nil {
		return result{}, err
	}
	start := time.Now()
	if err := svc.Start(ctx); err != nil {
		return result{}, err
	}
	defer func() { _ = svc.Stop(context.Background()) }()
	deadline := time.Now().Add(30 * time.Minute)
	for {
		if time.Now().After(deadline) {
			return result{}, fmt.Errorf("not applied in 30 minutes")
		}
		time.Sleep(100 * time.Millisecond)
		done, err := appliedAll(ctx, pool, s.last, s.apply)
		if err != nil {
			return result{}, err
		}
		if done {
			break
		}
	}
	took := time.Since(start)
	cpu1, err := cpuNow(s.pg)
	if err != nil {
		return result{}, err
	}
	return result{rate: float64(s.apply) / took.Seconds(), cpuPerRow: (cpu1 - cpu0) / float64(s.apply) * 1e6}, nil
}

func cpuNow(pg *testenv.Postgres) (float64, error) {
	p, err := bench.PostgresCPU(pg.DataDir)
	if err != nil {
		return 0, err
	}
	me, err := bench.ProcCPU(os.Getpid())
	return p + me, err
}

// appliedAll: every partition's progress has reached its last commit, and
// the stream's rows are all archived and verified.
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

// lookups reads 1,000 random rows by key through archive.rows, as the read
// API does, and prints their p99.
func lookups(ctx context.Context, pool *pgxpool.Pool, n int) error {
	var took []float64
	for range 1000 {
		id := 1 + rand.IntN(n)
		if (id/10)%months == months-1 {
			id += 10 // an expired row is not served
		}
		start := time.Now()
		var row []byte
		err := pool.QueryRow(ctx, `SELECT row FROM archive.rows WHERE schema_name = 'public' AND table_name = 'customers' AND key = $1::jsonb
			ORDER BY commit_lsn DESC, seq DESC LIMIT 100`, fmt.Sprintf(`{"id": %d}`, id)).Scan(&row)
		if err != nil && !(id > n && err == pgx.ErrNoRows) {
			return fmt.Errorf("lookup %d: %w", id, err)
		}
		took = append(took, float64(time.Since(start).Microseconds())/1000)
	}
	slices.Sort(took)
	bench.Figure("scale.read_p99_ms_"+label(n), took[len(took)*99/100], fmt.Sprintf("ms (1,000 lookups by key, median %.2f; target <= 10)", took[len(took)/2]))
	return nil
}

// retentionDrop runs one retention batch: it must drop the expired month.
func retentionDrop(ctx context.Context, pool *pgxpool.Pool, n int) error {
	res, err := retention.CleanupBatch(ctx, pool, retention.CleanupOptions{Batch: 1000, StatementTimeout: time.Minute})
	if err != nil {
		return err
	}
	if len(res.Dropped) != 1 {
		return fmt.Errorf("retention dropped %v, want one partition (deleted %d rows)", res.Dropped, res.Deleted)
	}
	bench.Figure("scale.retention_month_ms_"+label(n), float64(res.Duration.Microseconds())/1000,
		fmt.Sprintf("ms (one batch dropping %s: %d rows; target <= 1000)", res.Dropped[0], res.Deleted))
	if n >= 20_000_000 || label(n) == "20m" {
		bench.Figure("scale.retention_month_ms", float64(res.Duration.Microseconds())/1000, "ms (20m archive)")
	}
	return nil
}

// eraseOne erases one customer by --match and prints how long it took.
func eraseOne(ctx context.Context, pool *pgxpool.Pool, n int) error {
	id := n/2 + 1
	if (id/10)%months == months-1 {
		id += 10 // the expired month, dropped by retentionDrop before
	}
	match := fmt.Sprintf(`{"email": "user-%d@example.com"}`, id)
	start := time.Now()
	rc, err := erasure.Erase(ctx, pool, erasure.EraseOptions{Table: "public.customers", Match: json.RawMessage(match), Actor: "bench"})
	if err != nil {
		return err
	}
	took := time.Since(start)
	if rc.Removed["archive_v1.rows"] != 1 {
		return fmt.Errorf("erase removed %v, want one row", rc.Removed)
	}
	bench.Figure("scale.erase_match_ms_"+label(n), float64(took.Microseconds())/1000, "ms (erase --match of one customer, wall)")
	return nil
}
