// Command capture is `make bench-capture`: on one throwaway Postgres it
// drains the same backlog of cascading deletes (REPLICA IDENTITY FULL),
// retained by four slots: with pg_recvlogical (pgoutput, the raw limit of
// logical decoding here) before and after the captures, the faster run
// being the limit; with the capture binary into its embedded JetStream; and
// with a capture whose stream has persist mode "default". It prints the
// rates and the ratios to pg_recvlogical. Then it measures what archiving
// costs the source (source.go): the same deletes with nothing archiving
// them, with a trigger-based archive, while pg_recvlogical decodes them and
// while the capture streams them. Last it deletes 1,000,000 rows in a
// single transaction through a running capture and prints the capture's
// peak RSS.
//
// The big transaction runs twice: with the capture's embedded JetStream (the
// single-machine default, whose broker memory counts in the process) and with
// an external server (the capture alone).
//
// Output lines are "BENCH <name> <value> <unit>" (stable, greppable) and
// "NOTE <text>".
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"

	"github.com/epitaph-dev/epitaph/broker"
	"github.com/epitaph-dev/epitaph/internal/bench"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/internal/workload"
)

func main() {
	rows := flag.Int("rows", 300_000, "deleted rows in the backlog (at least; 0 = skip)")
	perTx := flag.Int("orders-per-tx", 100, "orders per cascading delete transaction (7 rows each)")
	bigRows := flag.Int("big-tx-rows", 1_000_000, "rows of the single big transaction (0 = skip)")
	keep := flag.Bool("keep", false, "keep the temporary directory (logs, stores)")
	cost := flag.Bool("source-cost", true, "also measure the source's DELETE rate plain, with a trigger-based archive and while the capture streams (-rows rows each)")
	flag.Parse()
	if err := run(*rows, *perTx, *bigRows, *keep, *cost); err != nil {
		log.Fatalf("bench-capture: %v", err)
	}
}

func run(rows, perTx, bigRows int, keep, cost bool) (err error) {
	ctx := context.Background()
	bench.LoadNote("at start")
	defer bench.LoadNote("at end")
	dir, err := bench.TempDir("epitaph-bench-capture-")
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
	bins, err := bench.Build(ctx, dir, "capture")
	if err != nil {
		return err
	}
	pg, err := testenv.StartPostgres()
	if err != nil {
		return err
	}
	defer func() {
		_ = pg.Stop()
		_ = os.RemoveAll(filepath.Dir(pg.DataDir))
	}()
	bench.Note("postgres %s, binaries in %s", pg.BinDir, dir)

	if rows > 0 {
		if err := backlog(ctx, pg, bins["capture"], dir, rows, perTx); err != nil {
			return err
		}
	}
	if rows > 0 && cost {
		if err := sourceCost(ctx, pg, bins["capture"], dir, rows, perTx); err != nil {
			return err
		}
	}
	if bigRows > 0 {
		// Embedded JetStream (the single-machine default: the broker's
		// memory counts in the process), then an external server (the
		// capture alone).
		for _, external := range []bool{false, true} {
			if err := bigTransaction(ctx, pg, bins["capture"], dir, bigRows, external); err != nil {
				return err
			}
		}
	}
	return nil
}

func backlog(ctx context.Context, pg *testenv.Postgres, captureBin, dir string, rows, perTx int) error {
	url, err := bench.CreateDatabase(ctx, pg, "backlog")
	if err != nil {
		return err
	}
	if err := workload.Setup(ctx, url); err != nil {
		return err
	}
	seed := bench.ShopFor(rows)
	counts, err := workload.Seed(ctx, url, seed)
	if err != nil {
		return err
	}
	n := counts.Total() - counts.Customers // deleting every order leaves only customers
	bench.Note("seeded %d rows; the backlog will be %d deleted rows in transactions of %d orders (%d rows)",
		counts.Total(), n, perTx, perTx*seed.RowsPerOrder())

	// Slot B and the publication are the capture's own: start it once so it
	// creates them (and its stream), then stop it before the deletes.
	listen, err := bench.LocalAddr()
	if err != nil {
		return err
	}
	metrics, err := bench.LocalAddr()
	if err != nil {
		return err
	}
	env := bench.CaptureEnv(url, "", listen, filepath.Join(dir, "backlog-data"), metrics, "main", "epitaph")
	watch, err := bench.WatchStream("nats://"+listen, "main", bench.EmbeddedCreds(filepath.Join(dir, "backlog-data")))
	if err != nil {
		return err
	}
	defer watch.Close()
	if err := startAndStop(ctx, captureBin, env, dir, watch, url, "epitaph"); err != nil {
		return err
	}
	// Slot C: a second capture with its own embedded broker whose stream
	// is made with persist mode "default".
	listenDefault, err := bench.LocalAddr()
	if err != nil {
		return err
	}
	metricsDefault, err := bench.LocalAddr()
	if err != nil {
		return err
	}
	envDefault := append(bench.CaptureEnv(url, "", listenDefault, filepath.Join(dir, "backlog-data-default"), metricsDefault, "main", "epitaph_default"),
		"EPITAPH_STREAM_PERSIST=default")
	watchDefault, err := bench.WatchStream("nats://"+listenDefault, "main", bench.EmbeddedCreds(filepath.Join(dir, "backlog-data-default")))
	if err != nil {
		return err
	}
	defer watchDefault.Close()
	if err := startAndStop(ctx, captureBin, envDefault, dir, watchDefault, url, "epitaph_default"); err != nil {
		return err
	}
	// Slot A, for pg_recvlogical, at the same point.
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	// Two: pg_recvlogical runs before and after the captures, and the
	// faster run is the limit (the first reader of the WAL finds colder
	// caches).
	for _, slot := range []string{"bench_recvlogical", "bench_recvlogical_2"} {
		if _, err := conn.Exec(ctx, "SELECT pg_create_logical_replication_slot($1, 'pgoutput')", slot); err != nil {
			return fmt.Errorf("create slot for pg_recvlogical: %w", err)
		}
	}

	took, err := bench.DeleteAllOrders(ctx, url, perTx)
	if err != nil {
		return err
	}
	bench.Figure("capture.backlog_rows", float64(n), "rows")
	bench.Figure("capture.source_delete_rows_per_sec", float64(n)/took.Seconds(), "rows/s")
	var endLSN string
	if err := conn.QueryRow(ctx, "SELECT pg_current_wal_lsn()::text").Scan(&endLSN); err != nil {
		return err
	}
	// One more WAL record past the end, so pg_recvlogical sees a position
	// beyond --endpos and stops.
	if _, err := conn.Exec(ctx, "SELECT pg_logical_emit_message(false, 'bench.end', '')"); err != nil {
		return err
	}
	var retained int64
	if err := conn.QueryRow(ctx, "SELECT pg_current_wal_lsn() - restart_lsn FROM pg_replication_slots WHERE slot_name = 'bench_recvlogical'").Scan(&retained); err != nil {
		return err
	}
	bench.Figure("capture.backlog_wal_bytes", float64(retained), "bytes")

	// A: pg_recvlogical, to a file, until the end LSN.
	recvRate, err := recvlogical(ctx, pg, dir, url, "bench_recvlogical", endLSN, n)
	if err != nil {
		return err
	}
	bench.Figure("capture.pg_recvlogical_rows_per_sec.first", recvRate, "rows/s (before the captures)")

	// B: the capture, into its embedded JetStream, until the stream holds
	// every row.
	capRate, rss, err := drain(ctx, "capture", captureBin, env, dir, watch, metrics, n)
	if err != nil {
		return err
	}
	if rss > 0 {
		bench.Figure("capture.backlog_peak_rss_mib", float64(rss)/(1<<20), "MiB")
	}

	// C: the same with the stream's persist mode "default" (a write per
	// message before its acknowledgement), as with an external broker.
	drate, _, err := drain(ctx, "persist_default", captureBin, envDefault, dir, watchDefault, metricsDefault, n)
	if err != nil {
		return err
	}

	// A again, on its second slot.
	recv2, err := recvlogical(ctx, pg, dir, url, "bench_recvlogical_2", endLSN, n)
	if err != nil {
		return err
	}
	bench.Figure("capture.pg_recvlogical_rows_per_sec.second", recv2, "rows/s (after the captures)")
	recvRate = max(recvRate, recv2)
	bench.Figure("capture.pg_recvlogical_rows_per_sec", recvRate, "rows/s (the faster run: the limit)")
	bench.Figure("capture.ratio_capture_to_pg_recvlogical", capRate/recvRate, "x (target >= 0.70)")
	bench.Figure("capture.ratio_persist_default_to_pg_recvlogical", drate/recvRate, "x")
	return nil
}

// recvlogical drains slot with pg_recvlogical (pgoutput, the capture's
// publication) into a file until endLSN and returns its rate.
func recvlogical(ctx context.Context, pg *testenv.Postgres, dir, url, slot, endLSN string, n int64) (float64, error) {
	out := filepath.Join(dir, slot+".out")
	cmd := exec.CommandContext(ctx, filepath.Join(pg.BinDir, "pg_recvlogical"),
		"-d", url, "-S", slot, "--start", "-E", endLSN, "--no-loop",
		"-o", "proto_version=1", "-o", "publication_names=epitaph", "-f", out)
	start := time.Now()
	if b, err := cmd.CombinedOutput(); err != nil {
		return 0, fmt.Errorf("pg_recvlogical: %w\n%s", err, b)
	}
	took := time.Since(start)
	if st, err := os.Stat(out); err == nil {
		bench.Figure("capture.pg_recvlogical_output_bytes."+slot, float64(st.Size()), "bytes")
	}
	bench.Figure("capture.pg_recvlogical_seconds."+slot, took.Seconds(), "s")
	return float64(n) / took.Seconds(), nil
}

// drain runs the capture until the stream holds n delete events, prints
// its figures under capture.<label>_* and returns its rate from process
// start and its peak RSS.
func drain(ctx context.Context, label, captureBin string, env []string, dir string, watch *bench.StreamWatch, metrics string, n int64) (rate float64, rss int64, err error) {
	p, err := bench.StartProc("capture", captureBin, env, dir)
	if err != nil {
		return 0, 0, err
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
	end, err := watch.WaitDeletes(ctx, n, 5*time.Minute, alive)
	if err != nil {
		return 0, 0, bench.Stalled(ctx, p, metrics, err)
	}
	took := end.Sub(p.Started())
	rate = float64(n) / took.Seconds()
	bench.Figure("capture."+label+"_seconds", took.Seconds(), "s")
	bench.Figure("capture."+label+"_rows_per_sec", rate, "rows/s")
	if !first.IsZero() && end.After(first) {
		bench.Figure("capture."+label+"_rows_per_sec_after_first_row", float64(n)/end.Sub(first).Seconds(), "rows/s")
	}
	if r, err := p.PeakRSS(); err == nil {
		rss = int64(r)
	}
	if err := p.Stop(30 * time.Second); err != nil {
		bench.Note("capture stop: %v", err)
	}
	return rate, rss, nil
}

// startAndStop runs the capture until it has made its stream and slot,
// then stops it gracefully.
func startAndStop(ctx context.Context, bin string, env []string, dir string, watch *bench.StreamWatch, url, slot string) error {
	p, err := bench.StartProc("capture", bin, env, dir)
	if err != nil {
		return err
	}
	err = bench.WaitCaptureReady(ctx, watch, url, slot, 2*time.Minute, exited(p))
	if err != nil {
		p.Kill()
		return fmt.Errorf("capture did not create its stream: %w", err)
	}
	if err := p.Stop(30 * time.Second); err != nil {
		bench.Note("capture stop: %v", err)
	}
	return nil
}

func bigTransaction(ctx context.Context, pg *testenv.Postgres, captureBin, dir string, rows int, external bool) error {
	name, prefix := "bigtx", "capture.big_tx_"
	if external {
		name, prefix = "bigtx_external", "capture.big_tx_external_nats_"
	}
	url, err := bench.CreateDatabase(ctx, pg, name)
	if err != nil {
		return err
	}
	if err := workload.Setup(ctx, url); err != nil {
		return err
	}
	// 1,000 orders of 1,000 lines each: one DELETE of every order removes
	// 1,001,000 rows in one transaction.
	lines := max(1, rows/1000)
	counts, err := workload.Seed(ctx, url, workload.SeedConfig{Customers: 1, OrdersPerCustomer: 1000, LinesPerOrder: lines,
		ShipmentsPerOrder: -1, ItemsPerShipment: -1, NoLedger: true})
	if err != nil {
		return err
	}
	n := counts.Orders + counts.OrderLines
	listen, err := bench.LocalAddr()
	if err != nil {
		return err
	}
	metrics, err := bench.LocalAddr()
	if err != nil {
		return err
	}
	natsURL := ""
	if external {
		srv, err := broker.Start(broker.Config{StoreDir: filepath.Join(dir, name+"-jetstream"), Listen: listen})
		if err != nil {
			return err
		}
		defer srv.Shutdown()
		natsURL = "nats://" + listen
	}
	env := bench.CaptureEnv(url, natsURL, listen, filepath.Join(dir, name+"-data"), metrics, "main", "epitaph_"+name)
	var creds []nats.Option
	if !external {
		creds = append(creds, bench.EmbeddedCreds(filepath.Join(dir, name+"-data")))
	}
	watch, err := bench.WatchStream("nats://"+listen, "main", creds...)
	if err != nil {
		return err
	}
	defer watch.Close()
	p, err := bench.StartProc("capture-"+name, captureBin, env, dir)
	if err != nil {
		return err
	}
	defer p.Kill()
	if err := bench.WaitCaptureReady(ctx, watch, url, "epitaph_"+name, 2*time.Minute, exited(p)); err != nil {
		return err
	}
	idle, err := p.PeakRSS()
	if err != nil {
		return err
	}
	start := time.Now()
	testConn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer testConn.Close(ctx)
	if _, err := testConn.Exec(ctx, "DELETE FROM public.orders"); err != nil {
		return fmt.Errorf("big delete: %w", err)
	}
	deleted := time.Since(start)
	// Sample the current RSS while the transaction streams through.
	var maxRSS int64
	alive := func() error {
		if done, err := p.Exited(); done {
			return fmt.Errorf("capture exited (%v):\n%s", err, p.LogTail(2000))
		}
		if r, err := p.RSS(); err == nil && r > maxRSS {
			maxRSS = r
		}
		return nil
	}
	end, err := watch.WaitDeletes(ctx, n, 10*time.Minute, alive)
	if err != nil {
		return bench.Stalled(ctx, p, metrics, err)
	}
	peak, err := p.PeakRSS()
	if err != nil {
		return err
	}
	bench.Figure(prefix+"rows", float64(n), "rows")
	bench.Figure(prefix+"source_delete_seconds", deleted.Seconds(), "s")
	bench.Figure(prefix+"published_seconds", end.Sub(start).Seconds(), "s (from DELETE start to last row in the stream)")
	bench.Figure(prefix+"rows_per_sec", float64(n)/end.Sub(start).Seconds(), "rows/s")
	bench.Figure(prefix+"idle_peak_rss_mib", float64(idle)/(1<<20), "MiB (VmHWM before the transaction)")
	bench.Figure(prefix+"peak_rss_mib", float64(peak)/(1<<20), "MiB (VmHWM after the transaction)")
	bench.Figure(prefix+"sampled_max_rss_mib", float64(maxRSS)/(1<<20), "MiB (VmRSS sampled every 25ms)")
	if err := p.Stop(30 * time.Second); err != nil {
		bench.Note("capture stop: %v", err)
	}
	return nil
}

func exited(p *bench.Proc) func() error {
	return func() error {
		if done, err := p.Exited(); done {
			return fmt.Errorf("%s exited (%v):\n%s", p.Name, err, p.LogTail(2000))
		}
		return nil
	}
}
