// Command scale is `make bench-scale`: what the archive costs as it grows.
// On one throwaway Postgres and an embedded JetStream server, with the
// projector service in process, for each archive size of -sizes (and an
// empty archive first, the baseline) in a database of its own:
//
//   - the archive (partitioned by month) is filled directly in the target
//     with INSERT .. SELECT generate_series: rows spread over 13 months, the
//     oldest month's rows expired;
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
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/bench"
	"github.com/epitaph-dev/epitaph/internal/broker"
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
	apply := flag.Int("apply", 50_000, "delete events applied through the projector into each archive")
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

	empty, err := sizeRun(ctx, s, 0, true)
	if err != nil {
		return err
	}
	for _, n := range sizes {
		r, err := sizeRun(ctx, s, n, true)
		if err != nil {
			return err
		}
		bench.Figure("scale.apply_ratio_"+label(n), r.rate/empty.rate,
			fmt.Sprintf("(apply rows/s with %d archived / empty: %.0f / %.0f; target >= 0.9)", n, r.rate, empty.rate))
		ceiling := float64(runtime.NumCPU()) * 1e6 / r.cpuPerRow
		bench.Figure("scale.cpu_us_per_row_e2e_"+label(n), r.cpuPerRow,
			fmt.Sprintf("us (Postgres + projector + JetStream server + bench, per applied row; stream to archive, no capture); %.0f rows/s measured beside a CPU ceiling of %.0f rows/s on %d cores",
				r.rate, ceiling, runtime.NumCPU()))
	}
	bench.Figure("scale.cpu_us_per_row_e2e", empty.cpuPerRow, fmt.Sprintf("us (empty archive; ceiling %.0f rows/s on %d cores, measured %.0f rows/s; target <= 60)",
		float64(runtime.NumCPU())*1e6/empty.cpuPerRow, runtime.NumCPU(), empty.rate))
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
	bench.Figure("scale.apply_rows_per_sec_"+lbl, r.rate, "rows/s")
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
// oldest month's rows are expired.
func fill(ctx context.Context, pool *pgxpool.Pool, n int) error {
	if err := migrations.Apply(ctx, pool); err != nil {
		return err
	}
	if err := version.EnsureArchive(ctx, pool, partitions, snapshot.DDL); err != nil {
		return err
	}
	now := time.Now().UTC()
	var times []time.Time
	for m := range months {
		times = append(times, archive.PeriodStart(archive.PeriodMonth, now).AddDate(0, -m, 1))
	}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := archive.EnsurePartitions(ctx, tx, archive.Schema(1), archive.PeriodMonth, times...)
		return err
	}); err != nil {
		return err
	}
	if n == 0 {
		return nil
	}
	start := time.Now()
	const chunk = 1_000_000
	for lo := 1; lo <= n; lo += chunk {
		hi := min(n, lo+chunk-1)
		_, err := pool.Exec(ctx, `INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row, identity, correlation_id, xid,
			commit_lsn, commit_time, seq, expires_at, columns)
		SELECT 'old', 'public', 'customers', jsonb_build_object('id', i),
		       jsonb_build_object('id', i, 'email', 'user-' || i || '@example.com', 'name', 'customer ' || i), 'full',
		       'old:' || (i / 10) || ':0/' || to_hex(i / 10 + 1), i / 10, ('0/' || to_hex(i / 10 + 1))::pg_lsn,
		       date_trunc('month', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' - ((i / 10) % $3) * interval '1 month' + interval '1 day',
		       i % 10,
		       CASE WHEN (i / 10) % $3 = $3 - 1 THEN now() - interval '1 day' ELSE now() + interval '100 years' END,
		       '[{"name":"id","type":"bigint","pk":true}]'
		FROM generate_series($1::bigint, $2::bigint) i`, lo, hi, months)
		if err != nil {
			return fmt.Errorf("fill: %w", err)
		}
	}
	if _, err := pool.Exec(ctx, `VACUUM ANALYZE archive_v1.rows`); err != nil {
		return err
	}
	bench.Note("filled %d rows in %s", n, time.Since(start).Round(time.Millisecond))
	return nil
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
	match := fmt.Sprintf(`{"email": "user-%d@example.com"}`, n/2+1)
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
