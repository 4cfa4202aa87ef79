// Command retention is `make bench-retention`. On one throwaway Postgres
// and an embedded JetStream server, with the projector service in process:
//
//  1. apply without cleanup: a stream of -apply delete events applied into
//     an archive that already holds -rows unexpired rows;
//  2. apply with cleanup: the same stream into an archive holding -rows
//     expired rows, with the projector's cleaner running (every 50 ms while
//     batches are not full): the apply rate, its ratio to 1, and the cleanup
//     rate (expired rows deleted per second, from the start until none is
//     left);
//  3. erasure by --match on the first archive: the database time of
//     Erase (the sum of its statements' execution times, from
//     pg_stat_statements), its wall time, and whether the plan uses the GIN
//     index.
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
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/epitaph-dev/epitaph/broker"
	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/bench"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection"
	"github.com/epitaph-dev/epitaph/projection/snapshot"
)

const (
	source     = "bench"
	partitions = 4
)

func main() {
	rows := flag.Int("rows", 1_000_000, "rows in the archive before the apply")
	apply := flag.Int("apply", 200_000, "delete events applied")
	perTx := flag.Int("per-tx", 10, "rows per source transaction")
	flag.StringVar(&explainTo, "explain", "", "copy auto_explain's plans (ANALYZE, BUFFERS) of statements over 200 ms to this file")
	flag.Parse()
	ctx := context.Background()
	if err := run(ctx, *rows, *apply, *perTx); err != nil {
		log.Fatal(err)
	}
}

var explainTo string

func run(ctx context.Context, rows, apply, perTx int) error {
	bench.LoadNote("before")
	dir, err := bench.TempDir("epitaph-bench-retention")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	pg, err := testenv.StartPostgres()
	if err != nil {
		return err
	}
	defer func() {
		_ = pg.Stop()
		_ = os.RemoveAll(filepath.Dir(pg.DataDir))
	}()
	// The database time of the cleanup and the erase: per statement.
	settings := []string{"shared_preload_libraries = 'pg_stat_statements'", "pg_stat_statements.track = all"}
	if explainTo != "" {
		settings = []string{"shared_preload_libraries = 'pg_stat_statements,auto_explain'", "pg_stat_statements.track = all",
			"auto_explain.log_min_duration = '200ms'", "auto_explain.log_analyze = on", "auto_explain.log_buffers = on",
			"auto_explain.log_timing = off", "auto_explain.log_level = warning"}
		defer func() {
			if b, err := os.ReadFile(filepath.Join(filepath.Dir(pg.DataDir), "postgres.log")); err == nil {
				_ = os.WriteFile(explainTo, b, 0o644)
			}
		}()
	}
	if err := pg.SetConfig(settings...); err != nil {
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
	natsURL := "nats://" + listen
	if err := publish(ctx, natsURL, apply, perTx); err != nil {
		return err
	}
	bench.Note("%d rows in the archive, %d delete events in %d-row transactions, %d partitions, the projector in process", rows, apply, perTx, partitions)

	without, err := bench.CreateDatabase(ctx, pg, "without_cleanup")
	if err != nil {
		return err
	}
	if err := prefill(ctx, without, rows, false); err != nil {
		return err
	}
	rateWithout, _, err := applyRun(ctx, pg, without, natsURL, apply, rows, false)
	if err != nil {
		return err
	}
	bench.Figure("retention.apply_rows_per_sec.without_cleanup", rateWithout, "rows/s")

	with, err := bench.CreateDatabase(ctx, pg, "with_cleanup")
	if err != nil {
		return err
	}
	if err := prefill(ctx, with, rows, true); err != nil {
		return err
	}
	rateWith, cleanup, err := applyRun(ctx, pg, with, natsURL, apply, rows, true)
	if err != nil {
		return err
	}
	bench.Figure("retention.apply_rows_per_sec.with_cleanup", rateWith, "rows/s")
	bench.Figure("retention.apply_ratio", rateWith/rateWithout, "(with / without cleanup; target >= 0.85)")
	bench.Figure("retention.cleanup_rows_per_sec", cleanup, "rows/s (target >= 50,000)")

	bench.LoadNote("after the apply runs")
	return eraseRun(ctx, without, rows)
}

// publish writes the stream: apply delete events of public.sessions (ids
// from 10,000,000 on, so they never meet the prefilled ones), signed.
func publish(ctx context.Context, natsURL string, apply, perTx int) error {
	nc, err := nats.Connect(natsURL)
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: event.StreamName(source), Subjects: []string{event.StreamSubjects(source)},
		Storage: jetstream.FileStorage, Metadata: map[string]string{event.MetaPartitions: strconv.Itoa(partitions),
			event.MetaSource: source, event.MetaWireVersion: "1"}}); err != nil {
		return err
	}
	signer := testenv.NewSigner()
	lsn := event.LSN(0x1000000)
	commitTime := time.Now().UTC()
	sent := 0
	for id := 0; sent < apply; {
		lsn += 0x100
		p := event.Partition(lsn, partitions)
		n := min(perTx, apply-sent)
		var msgs []*nats.Msg
		for i := 0; i < n; i++ {
			id++
			ev := &event.Event{Op: event.OpDelete, Source: source, Schema: "public", Table: "sessions", XID: int64(lsn) / 16,
				CommitLSN: lsn, CommitTime: commitTime, Seq: i, Identity: event.IdentityFull,
				Columns: []event.Column{{Name: "id", Type: "bigint", PK: true}},
				Key:     json.RawMessage(fmt.Sprintf(`{"id":%d}`, 10_000_000+id)),
				Row:     json.RawMessage(fmt.Sprintf(`{"id":%d,"email":"s%d@example.com","token":"%032d"}`, 10_000_000+id, id, id))}
			m, err := message(event.DeleteSubject(source, p, "public", "sessions"), event.MsgID(source, lsn, i), ev)
			if err != nil {
				return err
			}
			msgs = append(msgs, m)
		}
		commit := &event.Event{Op: event.OpCommit, Source: source, XID: int64(lsn) / 16, CommitLSN: lsn, CommitTime: commitTime,
			Rows: n, Tables: map[string]int{"public.sessions": n}}
		m, err := message(event.CommitSubject(source, p), event.CommitMsgID(source, lsn), commit)
		if err != nil {
			return err
		}
		for _, m := range append(msgs, m) {
			signer.Sign(m)
			if _, err := js.PublishMsgAsync(m); err != nil {
				return err
			}
		}
		sent += n
		if sent%2000 < perTx || sent == apply { // at most ~2,200 messages pending (the limit is 4,000)
			select {
			case <-js.PublishAsyncComplete():
			case <-time.After(time.Minute):
				return fmt.Errorf("publish did not complete")
			}
		}
	}
	return nil
}

func message(subject, id string, ev *event.Event) (*nats.Msg, error) {
	b, err := event.Encode(ev)
	if err != nil {
		return nil, err
	}
	m := nats.NewMsg(subject)
	m.Data = b
	m.Header.Set(event.HeaderMsgID, id)
	m.Header.Set(event.HeaderVersion, "1")
	return m, nil
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
	if err := projection.EnsureArchive(ctx, pool, partitions, snapshot.DDL); err != nil {
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

// applyRun applies the stream into url and returns the apply rate and, with
// cleanup, the cleanup rate; it prints the CPU seconds the run took and,
// with cleanup, the database time of the cleanup's statements.
func applyRun(ctx context.Context, pg *testenv.Postgres, url, natsURL string, apply, rows int, cleanup bool) (float64, float64, error) {
	cfg := projection.Config{TargetURL: url, NATSURL: natsURL, SourceName: source, WorkerID: "bench",
		ArchiveTTL: map[string]time.Duration{"*": 100 * 365 * 24 * time.Hour}, CleanupInterval: -1}
	if cleanup {
		cfg.CleanupInterval = 50 * time.Millisecond
	}
	svc, err := projection.New(cfg, projection.WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil))))
	if err != nil {
		return 0, 0, err
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return 0, 0, err
	}
	defer pool.Close()
	if err := resetStatements(ctx, pool); err != nil {
		return 0, 0, err
	}
	name := map[bool]string{false: "without_cleanup", true: "with_cleanup"}[cleanup]
	stats0 := readServerStats(ctx, pool)
	samp := startSampler(ctx, pool)
	cpu0 := cpuNow(pg)
	start := time.Now()
	if err := svc.Start(ctx); err != nil {
		return 0, 0, err
	}
	defer func() { _ = svc.Stop(context.Background()) }()
	var applied, cleaned time.Time
	deadline := time.Now().Add(30 * time.Minute)
	for applied.IsZero() || (cleanup && cleaned.IsZero()) {
		if time.Now().After(deadline) {
			return 0, 0, fmt.Errorf("not done in 30 minutes")
		}
		time.Sleep(200 * time.Millisecond)
		if applied.IsZero() {
			var n int
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM archive_v1.rows WHERE source = $1 AND verified`, source).Scan(&n); err != nil {
				return 0, 0, err
			}
			if n >= apply {
				applied = time.Now()
			}
		}
		if cleanup && cleaned.IsZero() {
			var left bool
			if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM archive_v1.rows WHERE source = 'old')`).Scan(&left); err != nil {
				return 0, 0, err
			}
			if !left {
				cleaned = time.Now()
			}
		}
	}
	cpu := cpuNow(pg).minus(cpu0)
	samp.report(name)
	stats0.note(name, readServerStats(ctx, pool))
	topStatements(ctx, pool, name, 12)
	bench.Figure("retention.cpu_seconds.postgres."+name, cpu.postgres, "s (until applied and, with cleanup, cleaned)")
	bench.Figure("retention.cpu_seconds.process."+name, cpu.proc, "s (projector, JetStream server and bench)")
	rate := float64(apply) / applied.Sub(start).Seconds()
	if !cleanup {
		return rate, 0, nil
	}
	dbTime, calls, err := statementTime(ctx, pool, "%expires_at <= now()%")
	if err != nil {
		return 0, 0, err
	}
	bench.Figure("retention.cleanup_database_seconds", dbTime.Seconds(), fmt.Sprintf("s (%d statements: batches and oldest-due checks, for %d rows: %.0f rows per database second)",
		calls, rows, float64(rows)/dbTime.Seconds()))
	if cleaned.Before(applied) {
		bench.Note("cleanup finished %s before the apply (all of it ran while applying)", applied.Sub(cleaned).Round(time.Millisecond))
	} else {
		bench.Note("cleanup finished %s after the apply", cleaned.Sub(applied).Round(time.Millisecond))
	}
	return rate, float64(rows) / cleaned.Sub(start).Seconds(), nil
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
	rc, err := projection.Erase(ctx, pool, projection.EraseOptions{Table: "public.customers", Match: json.RawMessage(match),
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
