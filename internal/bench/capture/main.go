// Command capture is `make bench-capture`: on one throwaway Postgres it
// drains the same backlog of cascading deletes (REPLICA IDENTITY FULL,
// -backlog-rows rows; `make bench-capture-large`: 1.2M) -runs times (5 by
// default). Every run drains a slot of its own with pg_recvlogical
// (pgoutput, the raw limit of logical decoding here) before and after the
// captures, the faster being that run's limit; with the capture binary into
// its embedded JetStream; and with a capture publishing to an external
// nats-server process (the version the capture embeds, file storage, the
// stream in persist mode "default"), each capture on a slot and stream made
// before the deletes. It prints for every drain the rate from process start,
// the start-up (to the first row in the stream) and the drain rate after
// it, the CPU seconds per row of the capture, of the external server and of
// Postgres (the walsender), and the ratios to pg_recvlogical beside their
// targets; then the min and median over the runs. -variant adds drains of
// a capture with other settings, -profile-dir writes CPU profiles of each
// capture and of the external server.
//
// Then it measures what archiving costs the source (source.go): the same
// deletes with nothing archiving them, with a trigger-based archive, while
// pg_recvlogical decodes them and while the capture streams them (with
// -source-variant settings too). Last it deletes 1,000,000 rows in a single
// transaction through a running capture and prints the capture's peak RSS,
// with the capture's embedded JetStream (the single-machine default, whose
// broker memory counts in the process) and with an external server (the
// capture alone).
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
	"path/filepath"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"

	"github.com/epitaph-dev/epitaph/internal/bench"
	"github.com/epitaph-dev/epitaph/internal/broker"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/internal/workload"
)

func main() {
	o := options{}
	flag.IntVar(&o.backlogRows, "backlog-rows", 300_000, "deleted rows in the backlog (at least; 0 = skip; >= 1,000,000 for the large backlog)")
	flag.IntVar(&o.sourceRows, "source-rows", 300_000, "deleted rows of each source-cost run")
	rows := flag.Int("rows", -1, "set -backlog-rows and -source-rows at once")
	flag.IntVar(&o.runs, "runs", 5, "drain the backlog this many times (each a slot and stream of its own, pg_recvlogical twice a run) and print each run and the min and median")
	flag.IntVar(&o.perTx, "orders-per-tx", 100, "orders per cascading delete transaction (7 rows each)")
	flag.IntVar(&o.bigRows, "big-tx-rows", 1_000_000, "rows of the single big transaction (0 = skip)")
	flag.BoolVar(&o.keep, "keep", false, "keep the temporary directory (logs; each drain's stores and each source-cost database are removed once measured, -keep or not)")
	flag.BoolVar(&o.cost, "source-cost", true, "also measure the source's DELETE rate plain, with a trigger-based archive and while the capture streams (-source-rows rows each)")
	flag.BoolVar(&o.embeddedDefault, "embedded-default", false, "also drain with the embedded broker in persist mode default")
	flag.BoolVar(&o.external, "external", true, "also drain into an external nats-server process (file storage, persist mode default)")
	flag.Func("capture-env", "K=V added to every backlog capture's environment (repeatable; e.g. EPITAPH_DUPLICATE_WINDOW=10s)", func(v string) error {
		if !strings.Contains(v, "=") {
			return fmt.Errorf("%q: want K=V", v)
		}
		o.captureEnv = append(o.captureEnv, v)
		return nil
	})
	o.variants = map[string][]string{}
	flag.Func("variant", "MODE.NAME:K=V[,K=V..]: also drain with a capture of MODE (embedded, external, embedded_default) with that environment, reported as MODE.NAME (repeatable; BIN=PATH drains with that capture binary instead, e.g. an older build)", func(v string) error {
		mode, env, ok := strings.Cut(v, ":")
		base, name, dot := strings.Cut(mode, ".")
		if !ok || !dot || name == "" || (base != modeEmbedded && base != modeExternal && base != modeEmbeddedDefault) {
			return fmt.Errorf("%q: want MODE.NAME:K=V[,K=V..]", v)
		}
		o.variants[mode] = strings.Split(env, ",")
		o.variantOrder = append(o.variantOrder, mode)
		return nil
	})
	flag.Func("source-variant", "NAME:K=V[,K=V..]: also measure the source's DELETEs while a capture with that environment streams them (repeatable; NICE=n runs it under nice -n n)", func(v string) error {
		name, env, ok := strings.Cut(v, ":")
		if !ok || name == "" {
			return fmt.Errorf("%q: want NAME:K=V[,K=V..]", v)
		}
		o.sourceVariants = append(o.sourceVariants, sourceVariant{name: name, env: strings.Split(env, ",")})
		return nil
	})
	flag.BoolVar(&o.noSourceVariants, "no-default-source-variants", false, "do not measure the default source variants (the capture on every CPU, EPITAPH_TAIL_CPUS=0, and always on one, GOMAXPROCS=1)")
	flag.StringVar(&o.profileDir, "profile-dir", "", "write CPU profiles of each capture drain and of the external nats-server there")
	flag.Parse()
	if !o.noSourceVariants {
		// On a machine shared with the source: the capture on every CPU
		// (no tail mode, the default before --tail-cpus), and always on
		// one (no catch-up either). The default tails on one CPU.
		o.sourceVariants = append([]sourceVariant{
			{name: "all_cpus", env: []string{"EPITAPH_TAIL_CPUS=0"}},
			{name: "tail_nice0", env: []string{"EPITAPH_TAIL_NICE=0"}},
			{name: "gomaxprocs1", env: []string{"GOMAXPROCS=1", "EPITAPH_TAIL_NICE=0"}},
		}, o.sourceVariants...)
	}
	if *rows >= 0 {
		o.backlogRows, o.sourceRows = *rows, *rows
	}
	if o.runs < 1 {
		log.Fatalf("bench-capture: -runs %d: at least 1", o.runs)
	}
	if err := run(o); err != nil {
		log.Fatalf("bench-capture: %v", err)
	}
}

type options struct {
	backlogRows, sourceRows, runs, perTx, bigRows int
	keep, cost, embeddedDefault, external         bool
	profileDir                                    string
	captureEnv                                    []string
	variants                                      map[string][]string
	variantOrder                                  []string
	sourceVariants                                []sourceVariant
	noSourceVariants                              bool
}

func run(o options) (err error) {
	ctx := context.Background()
	bench.LoadNote("at start")
	defer bench.LoadNote("at end")
	dir, err := bench.TempDir("epitaph-bench-capture-")
	if err != nil {
		return err
	}
	defer func() {
		if o.keep || err != nil {
			bench.Note("work dir kept: %s", dir)
			return
		}
		os.RemoveAll(dir)
	}()
	bins, err := bench.Build(ctx, dir, "capture")
	if err != nil {
		return err
	}
	natsBin, err := bench.BuildNATSServer(ctx, dir)
	if err != nil {
		return err
	}
	if o.profileDir != "" {
		if o.profileDir, err = filepath.Abs(o.profileDir); err != nil {
			return err
		}
		if err := os.MkdirAll(o.profileDir, 0o755); err != nil {
			return err
		}
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

	if o.backlogRows > 0 {
		modes := []string{modeEmbedded}
		if o.external {
			modes = append(modes, modeExternal)
		}
		if o.embeddedDefault {
			modes = append(modes, modeEmbeddedDefault)
		}
		modes = append(modes, o.variantOrder...)
		b := &backlogBench{variants: o.variants, pg: pg, captureBin: bins["capture"], natsBin: natsBin, dir: dir, rows: o.backlogRows, perTx: o.perTx,
			runs: o.runs, modes: modes, profileDir: o.profileDir, extraEnv: o.captureEnv}
		if err := backlog(ctx, b); err != nil {
			return err
		}
	}
	if o.sourceRows > 0 && o.cost {
		if err := sourceCost(ctx, pg, bins["capture"], dir, o); err != nil {
			return err
		}
	}
	if o.bigRows > 0 {
		// Embedded JetStream (the single-machine default: the broker's
		// memory counts in the process), then an external server (the
		// capture alone).
		for _, external := range []bool{false, true} {
			if err := bigTransaction(ctx, pg, bins["capture"], dir, o.bigRows, external); err != nil {
				return err
			}
		}
	}
	return nil
}

// bigTxPeakTarget and bigTxExternalPeakTarget are the bound on the
// capture's peak RSS for the big transaction with its embedded broker, and
// the stated bound with an external server (the tests'
// EmbeddedPeakRSSBound and PeakRSSBound).
const (
	bigTxPeakTarget         = 150 << 20
	bigTxExternalPeakTarget = 128 << 20
)

func bigTransaction(ctx context.Context, pg *testenv.Postgres, captureBin, dir string, rows int, external bool) error {
	name, prefix, target := "bigtx", "capture.big_tx_", int64(bigTxPeakTarget)
	if external {
		name, prefix, target = "bigtx_external", "capture.big_tx_external_nats_", bigTxExternalPeakTarget
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
	bench.Figure(prefix+"peak_rss_mib", float64(peak)/(1<<20), fmt.Sprintf("MiB (VmHWM after the transaction; target < %d MiB: %s)", target>>20, met(peak < target)))
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
