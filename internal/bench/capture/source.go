package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/epitaph-dev/epitaph/internal/bench"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/internal/workload"
)

// triggerArchiveSQL is the usual trigger-based archive, the alternative to
// reading the WAL: every deleted row copied as JSON, in the deleting
// transaction, into a table of its own.
const triggerArchiveSQL = `
CREATE SCHEMA trigger_archive;
CREATE TABLE trigger_archive.rows (
    id bigserial PRIMARY KEY,
    schema_name text NOT NULL,
    table_name text NOT NULL,
    row jsonb NOT NULL,
    xid bigint NOT NULL,
    deleted_at timestamptz NOT NULL DEFAULT now()
);
CREATE FUNCTION trigger_archive.keep() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO trigger_archive.rows (schema_name, table_name, row, xid)
    VALUES (TG_TABLE_SCHEMA, TG_TABLE_NAME, to_jsonb(OLD), txid_current());
    RETURN OLD;
END $$;
`

// sourceCost measures what archiving costs the application's DELETEs: the
// same cascading deletes (fresh databases, same seed) with nothing
// archiving them, with a trigger-based archive, and while the capture (with
// its embedded broker) streams them from the WAL on the same two cores,
// and while pg_recvlogical decodes them (the walsender's share).
// The plain run goes first and last; the faster is the baseline.
// It reads o's source rows, transaction size and variants.
func sourceCost(ctx context.Context, pg *testenv.Postgres, captureBin, dir string, o options) error {
	c := &sourceCostRun{ctx: ctx, pg: pg, captureBin: captureBin, dir: dir, seed: bench.ShopFor(o.sourceRows), perTx: o.perTx}
	variants := o.sourceVariants
	plain1, err := c.run("plain_first", nil)
	if err != nil {
		return err
	}
	trigger, err := c.run("trigger", c.withTrigger)
	if err != nil {
		return err
	}
	withCapture, err := c.run("with_capture", c.withCapture("default"))
	if err != nil {
		return err
	}
	// The share of that which is logical decoding itself (the walsender on
	// the source, what any WAL-based tool costs): pg_recvlogical reading the
	// deletes as they happen.
	withRecv, err := c.run("with_pg_recvlogical", c.withRecvlogical)
	if err != nil {
		return err
	}
	variantRates := make([]float64, len(variants))
	for i, v := range variants {
		if variantRates[i], err = c.run("with_capture_"+v.name, c.withCapture(v.name, v.env...)); err != nil {
			return err
		}
	}
	plain2, err := c.run("plain_last", nil)
	if err != nil {
		return err
	}
	plain := max(plain1, plain2)
	for i, v := range variants {
		bench.Figure("capture.source_cost.capture_"+v.name+"_slowdown", plain/variantRates[i], fmt.Sprintf("x (as capture_slowdown, the capture with %v)", v.env))
	}
	bench.Figure("capture.source_cost.plain_delete_rows_per_sec", plain, "rows/s (the faster plain run: the baseline)")
	bench.Figure("capture.source_cost.trigger_slowdown", plain/trigger, "x (DELETE time with a trigger-based archive / without)")
	base := min(c.backend["plain_first"], c.backend["plain_last"])
	bench.Figure("capture.source_cost.trigger_backend_added_cpu_us_per_row", c.backend["trigger"]-base, "µs (CPU the trigger adds to the deleting backend, inside every transaction)")
	bench.Figure("capture.source_cost.capture_backend_added_cpu_us_per_row", c.backend["with_capture"]-base, "µs (CPU the capture adds to the deleting backend: none expected)")
	bench.Figure("capture.source_cost.capture_slowdown", plain/withCapture, "x (DELETE time while the capture and its broker stream them on the same cores / without)")
	bench.Figure("capture.source_cost.decoding_slowdown", plain/withRecv, "x (DELETE time while pg_recvlogical decodes them / without: the walsender's share)")
	return nil
}

// sourceVariant is a capture configuration measured beside the default
// (-source-variant).
type sourceVariant struct {
	name string
	env  []string
}

// sourceCostRun is one sourceCost measurement: its databases are seeded
// alike and emptied perTx orders a transaction.
type sourceCostRun struct {
	ctx             context.Context
	pg              *testenv.Postgres
	captureBin, dir string
	seed            workload.SeedConfig
	perTx           int
	n               int64              // rows deleted by each run (the same seed)
	files           []string           // what the run's setup wrote (removed after the run)
	slot            string             // the slot a setup decodes with ("" = none)
	backend         map[string]float64 // µs of backend CPU per row, by run
}

// prepare makes a database name with the shop seeded: its URL and how many
// rows deleting every order deletes.
func (c *sourceCostRun) prepare(name string) (url string, n int64, err error) {
	url, err = bench.CreateDatabase(c.ctx, c.pg, name)
	if err != nil {
		return "", 0, err
	}
	if err := workload.Setup(c.ctx, url); err != nil {
		return "", 0, err
	}
	counts, err := workload.Seed(c.ctx, url, c.seed)
	if err != nil {
		return "", 0, err
	}
	return url, int64(counts.Total() - counts.Customers), nil
}

// run deletes every order of a fresh database, with setup (nil: none)
// started before and its stop called after, and reports the rate.
func (c *sourceCostRun) run(name string, setup func(url string) (stop func() error, err error)) (float64, error) {
	db := "source_cost_" + name
	url, n, err := c.prepare(db)
	if err != nil {
		return 0, err
	}
	c.n, c.slot, c.files = n, "", nil
	stop := func() error { return nil }
	if setup != nil {
		if stop, err = setup(url); err != nil {
			return 0, err
		}
	}
	walsender := func() float64 { return 0 }
	if c.slot != "" {
		if walsender, err = bench.SampleWalsender(c.ctx, url, c.slot); err != nil {
			return 0, err
		}
	}
	took, backend, err := bench.DeleteAllOrdersCPU(c.ctx, url, c.perTx)
	ws := walsender()
	if err != nil {
		return 0, err
	}
	if err := stop(); err != nil {
		return 0, err
	}
	c.discard(db)
	prefix := "capture.source_cost." + name + "_"
	bench.Figure(prefix+"backend_cpu_us_per_row", backend*1e6/float64(n), fmt.Sprintf("µs (the deleting backend, %.2f CPU-s)", backend))
	if c.backend == nil {
		c.backend = map[string]float64{}
	}
	c.backend[name] = backend * 1e6 / float64(n)
	if c.slot != "" {
		bench.Figure(prefix+"walsender_cpu_us_per_row", ws*1e6/float64(n), fmt.Sprintf("µs (the walsender decoding them while the DELETEs ran, %.2f CPU-s)", ws))
	}
	rate := float64(n) / took.Seconds()
	bench.Figure("capture.source_cost."+name+"_delete_rows_per_sec", rate, fmt.Sprintf("rows/s (%d rows)", n))
	return rate, nil
}

// discard drops a run's database and removes what its setup wrote (as
// the drains do, backlog.go's discard): kept, every run's pages stay in
// the page cache and each later run writes into memory the kernel has not
// used before, dearer per byte on this VM.
func (c *sourceCostRun) discard(db string) {
	if err := bench.DropDatabase(c.ctx, c.pg, db); err != nil {
		bench.Note("%v", err)
	}
	for _, f := range c.files {
		if err := os.RemoveAll(f); err != nil {
			bench.Note("remove %s: %v", f, err)
		}
	}
}

// withTrigger installs a trigger-based archive; its stop checks it kept
// rows.
func (c *sourceCostRun) withTrigger(url string) (func() error, error) {
	conn, err := pgx.Connect(c.ctx, url)
	if err != nil {
		return nil, err
	}
	defer conn.Close(c.ctx)
	if _, err := conn.Exec(c.ctx, triggerArchiveSQL); err != nil {
		return nil, fmt.Errorf("trigger archive: %w", err)
	}
	for _, t := range workload.Tables {
		if _, err := conn.Exec(c.ctx, `CREATE TRIGGER keep_deleted AFTER DELETE ON `+t+
			` FOR EACH ROW EXECUTE FUNCTION trigger_archive.keep()`); err != nil {
			return nil, fmt.Errorf("trigger on %s: %w", t, err)
		}
	}
	return func() error {
		// The trigger archive must have kept every row, or the
		// comparison is void.
		n, err := bench.Count(c.ctx, url, `SELECT count(*) FROM trigger_archive.rows`)
		if err == nil && n == 0 {
			err = fmt.Errorf("the trigger archive kept nothing")
		}
		return err
	}, nil
}

// withCapture returns a setup that starts the capture (embedded broker,
// env added to its environment) on url; its stop waits until the stream
// holds every deleted row (the catch-up after the last DELETE), prints the
// capture's CPU and stops it.
func (c *sourceCostRun) withCapture(label string, env ...string) func(url string) (func() error, error) {
	return func(url string) (func() error, error) {
		listen, err := bench.LocalAddr()
		if err != nil {
			return nil, err
		}
		metrics, err := bench.LocalAddr()
		if err != nil {
			return nil, err
		}
		c.slot = "epitaph_source_cost_" + label
		data := filepath.Join(c.dir, "source-cost-"+label)
		c.files = append(c.files, data)
		env := append(bench.CaptureEnv(url, "", listen, data, metrics, "main", "epitaph_source_cost_"+label), env...)
		watch, err := bench.WatchStream("nats://"+listen, "main", bench.EmbeddedCreds(data))
		if err != nil {
			return nil, err
		}
		bin, args := c.captureBin, []string(nil)
		if i := slices.IndexFunc(env, func(kv string) bool { return strings.HasPrefix(kv, "NICE=") }); i >= 0 {
			// Not an environment variable: the capture runs under nice(1).
			bin, args = "nice", []string{"-n", strings.TrimPrefix(env[i], "NICE="), c.captureBin}
			env = slices.Delete(env, i, i+1)
		}
		// A session of its own, as a service runs (systemd starts each in
		// one; pg_ctl does the same for the postmaster): where --tail-nice
		// applies (cpunice_linux.go).
		p, err := bench.StartSessionProc("capture-source-cost-"+label, bin, env, c.dir, args...)
		if err != nil {
			watch.Close()
			return nil, err
		}
		if err := bench.WaitCaptureReady(c.ctx, watch, url, "epitaph_source_cost_"+label, 2*time.Minute, exited(p)); err != nil {
			p.Kill()
			watch.Close()
			return nil, fmt.Errorf("capture did not start: %w", err)
		}
		cpu0 := procCPU(p)
		return func() error {
			defer watch.Close()
			defer p.Kill()
			deleted := time.Now()
			atEnd := procCPU(p) - cpu0
			// The CPU mode at the last DELETE (cpumode.go): what the capture
			// ran on while the source deleted.
			mode := ""
			if m, err := bench.Scrape(c.ctx, metrics); err == nil {
				mode = fmt.Sprintf("; at the last DELETE on %v CPUs, catching up %v, %v WAL bytes behind, %v mode switches",
					m["epitaph_capture_cpus"], m["epitaph_capture_catching_up"], m["epitaph_capture_backlog_bytes"], m["epitaph_capture_cpu_mode_switches_total"])
			}
			n, err := bench.Count(c.ctx, url, `SELECT count(*) FROM public.order_lines`)
			if err != nil {
				return err
			}
			if n != 0 {
				return fmt.Errorf("%d order lines left", n)
			}
			rows := c.n
			end, err := watch.WaitDeletes(c.ctx, rows, 10*time.Minute, exited(p))
			if err != nil {
				return err
			}
			all := procCPU(p) - cpu0
			prefix := "capture.source_cost." + label + "_"
			bench.Figure(prefix+"catch_up_seconds", end.Sub(deleted).Seconds(), "s (after the last DELETE until the stream holds every row)")
			bench.Figure(prefix+"cpu_us_per_row", all*1e6/float64(rows), fmt.Sprintf("µs (capture and its embedded server, %.2f CPU-s; %.2f CPU-s of it while the DELETEs ran%s)", all, atEnd, mode))
			return p.Stop(30 * time.Second)
		}, nil
	}
}

// withRecvlogical starts pg_recvlogical decoding url's deletes.
func (c *sourceCostRun) withRecvlogical(url string) (func() error, error) {
	conn, err := pgx.Connect(c.ctx, url)
	if err != nil {
		return nil, err
	}
	defer conn.Close(c.ctx)
	if _, err := conn.Exec(c.ctx, `CREATE PUBLICATION source_cost FOR TABLE `+strings.Join(workload.Tables, ", ")+
		` WITH (publish = 'delete, truncate')`); err != nil {
		return nil, err
	}
	if _, err := conn.Exec(c.ctx, `SELECT pg_create_logical_replication_slot('source_cost', 'pgoutput')`); err != nil {
		return nil, err
	}
	c.slot = "source_cost"
	out := filepath.Join(c.dir, "source-cost.out")
	c.files = append(c.files, out)
	cmd := exec.CommandContext(c.ctx, filepath.Join(c.pg.BinDir, "pg_recvlogical"),
		"-d", url, "-S", "source_cost", "--start", "-o", "proto_version=1", "-o", "publication_names=source_cost",
		"-f", out)
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	return func() error {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		return nil
	}, nil
}
