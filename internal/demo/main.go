// Command demo is `make demo`: a throwaway PostgreSQL (or EPITAPH_SOURCE_URL),
// the capture with its embedded JetStream, one projector, a small shop whose
// application deletes through cascades and plain SQL, and then what a user
// came for: the archived rows grouped by transaction, a snapshot document,
// and the status. Then it keeps the pipeline running, with the status
// page's address, a psql line and three next steps, until Ctrl-C (SIGINT)
// or SIGTERM stops everything it started. -exit (EPITAPH_DEMO_EXIT=1) stops
// at once instead, for scripts and CI.
package main

import (
	"bytes"
	"context"
	_ "embed"
	"errors"
	"flag"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/epitaph-dev/epitaph/internal/testenv"
)

//go:embed shop.sql
var shopSQL string

// The application's deletes: what an ORM, a cascade or a batch job does.
var workload = []struct{ what, sql string }{
	{"cancel order 7 (cascades to its lines and shipment)", `DELETE FROM orders WHERE id = 7`},
	{"remove one order line", `DELETE FROM order_lines WHERE id = 42`},
	{"close customer 3 (cascades to its orders, their lines and shipments)", `DELETE FROM customers WHERE id = 3`},
	{"purge unpaid orders placed before Nov 3", `DELETE FROM orders WHERE status = 'placed' AND placed_at < '2026-11-03'`},
}

func main() {
	exit := flag.Bool("exit", os.Getenv("EPITAPH_DEMO_EXIT") == "1",
		"stop everything once the archive is shown instead of running until interrupted (EPITAPH_DEMO_EXIT=1)")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	go func() { <-ctx.Done(); stop() }() // a second Ctrl-C kills at once
	err := run(ctx, *exit)
	if err != nil && ctx.Err() != nil {
		step("interrupted: everything it started is stopped")
		return
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		stop()
		os.Exit(1)
	}
}

func run(ctx context.Context, exit bool) error {
	dir, err := filepath.Abs(".demo")
	if err != nil {
		return err
	}
	_ = os.RemoveAll(dir)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	url := os.Getenv("EPITAPH_SOURCE_URL")
	if url == "" {
		step("starting a throwaway PostgreSQL (wal_level=logical)")
		pg, err := testenv.StartPostgres()
		if err != nil {
			return err
		}
		defer func() { _ = pg.Stop(); _ = os.RemoveAll(filepath.Dir(pg.DataDir)) }()
		if err := exec1(ctx, pg.URL("postgres"), "CREATE DATABASE shop"); err != nil {
			return err
		}
		url = pg.URL("shop")
	}
	step("creating the shop schema and data (customers, orders, order_lines, shipments; ON DELETE CASCADE)")
	if err := exec1(ctx, url, shopSQL); err != nil {
		return fmt.Errorf("create shop (use an empty database): %w", err)
	}

	natsPort, _ := testenv.FreePort()
	capMetrics, _ := testenv.FreePort()
	projMetrics, _ := testenv.FreePort()
	natsListen := fmt.Sprintf("127.0.0.1:%d", natsPort)
	env := append(os.Environ(),
		"EPITAPH_SOURCE_URL="+url, "EPITAPH_TARGET_URL="+url,
		"EPITAPH_NATS_LISTEN="+natsListen, "EPITAPH_DATA_DIR="+filepath.Join(dir, "data"),
		"EPITAPH_SNAPSHOT_ROOTS=public.orders,public.customers")

	step("starting capture (embedded JetStream on " + natsListen + ")")
	capture, err := startProc(ctx, dir, "capture", append(env, "EPITAPH_NATS_URL=", fmt.Sprintf("EPITAPH_METRICS_ADDR=127.0.0.1:%d", capMetrics),
		// Heartbeats reach every partition, so even the ones no demo
		// transaction lands in advance and the archive can say it is ready.
		"EPITAPH_HEARTBEAT_INTERVAL=1s"))
	if err != nil {
		return err
	}
	defer capture.stop()
	if err := waitHTTP(ctx, fmt.Sprintf("http://127.0.0.1:%d/healthz", capMetrics), capture); err != nil {
		return err
	}
	// The embedded broker requires credentials; the capture made the
	// projector's on its first start.
	projectorCreds := filepath.Join(dir, "data", "nats", "projector.creds")
	step("starting a projector worker (--nats-creds " + projectorCreds + ")")
	projector, err := startProc(ctx, dir, "projector", append(env, "EPITAPH_NATS_URL=nats://"+natsListen, "EPITAPH_NATS_CREDS="+projectorCreds,
		fmt.Sprintf("EPITAPH_METRICS_ADDR=127.0.0.1:%d", projMetrics), "EPITAPH_WORKER_ID=demo-worker"), "run")
	if err != nil {
		return err
	}
	defer projector.stop()
	if err := waitHTTP(ctx, fmt.Sprintf("http://127.0.0.1:%d/healthz", projMetrics), projector); err != nil {
		return err
	}

	deleted, err := deleteAndWait(ctx, url, dir)
	if err != nil {
		return err
	}
	if err := showArchive(ctx, url, natsListen, projectorCreds); err != nil {
		return err
	}
	if !exit {
		printNext(url, natsListen, projectorCreds, fmt.Sprintf("127.0.0.1:%d", projMetrics), dir)
		<-ctx.Done()
		step("stopping: projector, capture, then the database")
		projector.stop()
		capture.stop()
	}
	step(fmt.Sprintf("done: %d deleted rows archived; capture and projector stopped, database removed (logs were in %s)", deleted, dir))
	return nil
}

// printNext says where to look while the demo runs: the status page, the
// archive in psql, and three things to try.
func printNext(url, natsListen, creds, projectorAddr, dir string) {
	admin := fmt.Sprintf("EPITAPH_TARGET_URL='%s' EPITAPH_SOURCE_URL='%s' EPITAPH_NATS_URL=nats://%s EPITAPH_NATS_CREDS=%s",
		url, url, natsListen, creds)
	step("the pipeline keeps running: capture, JetStream, projector")
	fmt.Printf(`    status page:  http://%s/
    the archive:  psql '%s' -c 'SELECT correlation_id, table_name, row FROM archive.rows ORDER BY commit_time DESC, seq LIMIT 20'
    logs:         %s

    Next:
    1. Delete more and watch it arrive (the status page refreshes itself):
       psql '%s' -c 'DELETE FROM orders WHERE id = (SELECT max(id) FROM orders)'
    2. Put customer 3 back into the shop, with its orders, their lines and shipments:
       %s bin/projector restore --correlation "$(psql '%s' -Atc "SELECT correlation_id FROM archive.rows WHERE table_name = 'customers' LIMIT 1")"
    3. Run it against your own database: README.md, "Quick start against your own database".

    Ctrl-C stops everything and removes the database.
`, projectorAddr, url, dir, url, admin, url)
}

// deleteAndWait runs the demo's deletes against url and waits for the
// archive to hold every row they deleted: how many.
func deleteAndWait(ctx context.Context, url, dir string) (int64, error) {
	step("the application deletes (plain SQL; cascades do the rest)")
	seeded, err := countShop(ctx, url)
	if err != nil {
		return 0, err
	}
	for _, w := range workload {
		n, err := execCount(ctx, url, w.sql)
		if err != nil {
			return 0, fmt.Errorf("%s: %w", w.sql, err)
		}
		fmt.Printf("    %-70s DELETE %d\n", w.what, n)
	}
	left, err := countShop(ctx, url)
	if err != nil {
		return 0, err
	}
	deleted := seeded - left

	step(fmt.Sprintf("waiting for the archive to hold all %d deleted rows", deleted))
	deadline := time.Now().Add(2 * time.Minute)
	for {
		var n int64
		err := queryRow(ctx, url, `SELECT count(*) FROM archive.rows`, &n)
		if err == nil && n == deleted {
			return deleted, nil
		}
		if time.Now().After(deadline) {
			return 0, fmt.Errorf("archive holds %d rows after 2 minutes, want %d (logs in %s)", n, deleted, dir)
		}
		select {
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// showArchive prints what the archive made of the deletes, a snapshot, and
// the projector's status once it is ready (or says why not).
func showArchive(ctx context.Context, url, natsListen, projectorCreds string) error {
	step("archived rows, grouped by the transaction that deleted them")
	if err := printQuery(ctx, url, `
SELECT correlation_id, to_char(commit_time, 'HH24:MI:SS.MS') AS committed, count(*) AS rows,
       string_agg(DISTINCT table_name, ', ' ORDER BY table_name) AS tables,
       count(*) FILTER (WHERE is_root) AS roots
FROM archive.rows GROUP BY correlation_id, commit_time ORDER BY commit_time`); err != nil {
		return err
	}
	step("one deleted order with its lines and shipment, as the archive keeps them")
	if err := printQuery(ctx, url, `
SELECT table_name, key::text, row::text FROM archive.rows
WHERE correlation_id = (SELECT correlation_id FROM archive.rows ORDER BY commit_time LIMIT 1)
ORDER BY seq`); err != nil {
		return err
	}
	step("the same order as a snapshot document (order with its lines and shipment)")
	if err := waitSnapshot(ctx, url); err != nil {
		return err
	}
	step("waiting for archive.status to say ready (every partition advancing, lag sampled)")
	ready := false
	for end := time.Now().Add(45 * time.Second); !ready && time.Now().Before(end); {
		if err := queryRow(ctx, url, `SELECT coalesce(bool_and(ready), false) FROM archive.status`, &ready); err != nil || !ready {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(500 * time.Millisecond):
			}
		}
	}
	if !ready {
		fmt.Println("    not ready yet: the status below says why")
	}
	step("projector status")
	out, err := exec.CommandContext(ctx, filepath.Join("bin", "projector"), "status", "--target-url", url, "--nats-url", "nats://"+natsListen, "--nats-creds", projectorCreds).CombinedOutput()
	fmt.Print(indent(string(out)))
	if err != nil {
		return fmt.Errorf("projector status: %w", err)
	}
	return nil
}

func waitSnapshot(ctx context.Context, url string) error {
	deadline := time.Now().Add(time.Minute)
	for {
		var doc []byte
		err := queryRow(ctx, url, `SELECT jsonb_pretty(payload)::bytea FROM archive.snapshots
			WHERE status = 'complete' AND root_table = 'public.orders' AND root_key = '{"id":7}'`, &doc)
		if err == nil {
			fmt.Println(indent(string(doc)))
			return nil
		}
		if !errors.Is(err, pgx.ErrNoRows) || time.Now().After(deadline) {
			return fmt.Errorf("snapshot of order 7: %w", err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(300 * time.Millisecond):
		}
	}
}

type proc struct {
	cmd     *exec.Cmd
	name    string
	log     string
	done    chan error
	stopped bool
}

func startProc(ctx context.Context, dir, name string, env []string, args ...string) (*proc, error) {
	logPath := filepath.Join(dir, name+".log")
	f, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(filepath.Join("bin", name), args...)
	cmd.Env = env
	// Its own process group: Ctrl-C reaches the demo alone, which stops
	// the projector, then the capture, then the database.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Stdout, cmd.Stderr = f, f
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s (run `make build` first): %w", name, err)
	}
	p := &proc{cmd: cmd, name: name, log: logPath, done: make(chan error, 1)}
	go func() { p.done <- cmd.Wait(); f.Close() }()
	return p, nil
}

// stop stops the process (SIGTERM, SIGKILL after 20 s) and says so when it
// did not stop cleanly; once.
func (p *proc) stop() {
	if p.stopped {
		return
	}
	p.stopped = true
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	var err error
	select {
	case err = <-p.done:
	case <-time.After(20 * time.Second):
		_ = p.cmd.Process.Kill()
		err = <-p.done
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "demo: %s did not stop cleanly: %v (log: %s)\n", p.name, err, p.log)
	}
}

func waitHTTP(ctx context.Context, url string, p *proc) error {
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case err := <-p.done:
			log, _ := os.ReadFile(p.log)
			return fmt.Errorf("%s exited: %v\n%s", p.name, err, log)
		default:
		}
		if resp, err := http.Get(url); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
	log, _ := os.ReadFile(p.log)
	return fmt.Errorf("%s not healthy after 30s:\n%s", p.name, log)
}

func step(s string) { fmt.Printf("\n==> %s\n", s) }

func indent(s string) string {
	return "    " + strings.ReplaceAll(strings.TrimRight(s, "\n"), "\n", "\n    ") + "\n"
}

func exec1(ctx context.Context, url, sql string) error {
	_, err := execCount(ctx, url, sql)
	return err
}

func execCount(ctx context.Context, url, sql string) (int64, error) {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return 0, fmt.Errorf("connect: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	tag, err := conn.Exec(ctx, sql)
	if err != nil {
		return 0, err
	}
	return tag.RowsAffected(), nil
}

func queryRow(ctx context.Context, url, sql string, dst ...any) error {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	return conn.QueryRow(ctx, sql).Scan(dst...)
}

func countShop(ctx context.Context, url string) (int64, error) {
	var n int64
	err := queryRow(ctx, url, `SELECT (SELECT count(*) FROM customers) + (SELECT count(*) FROM orders)
		+ (SELECT count(*) FROM order_lines) + (SELECT count(*) FROM shipments)`, &n)
	return n, err
}

// printQuery prints a result set as an aligned table.
func printQuery(ctx context.Context, url, sql string) error {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	rows, err := conn.Query(ctx, sql)
	if err != nil {
		return err
	}
	var table [][]string
	var head []string
	for _, f := range rows.FieldDescriptions() {
		head = append(head, f.Name)
	}
	table = append(table, head)
	for rows.Next() {
		vals, err := rows.Values()
		if err != nil {
			return err
		}
		var r []string
		for _, v := range vals {
			s := fmt.Sprint(v)
			if b, ok := v.([]byte); ok {
				s = string(b)
			}
			if len(s) > 110 {
				s = s[:107] + "..."
			}
			r = append(r, s)
		}
		table = append(table, r)
	}
	if err := rows.Err(); err != nil {
		return err
	}
	widths := make([]int, len(head))
	for _, r := range table {
		for i, c := range r {
			widths[i] = max(widths[i], len(c))
		}
	}
	var b bytes.Buffer
	for i, r := range table {
		b.WriteString("    ")
		for j, c := range r {
			fmt.Fprintf(&b, "%-*s  ", widths[j], c)
		}
		b.WriteString("\n")
		if i == 0 {
			b.WriteString("    ")
			for j := range r {
				b.WriteString(strings.Repeat("-", widths[j]) + "  ")
			}
			b.WriteString("\n")
		}
	}
	fmt.Print(b.String())
	return nil
}
