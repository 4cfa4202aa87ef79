package e2e_test

import (
	"bytes"
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/bench"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// quickStartBlocks are the shell blocks of the README's quick start, in
// order.
func quickStartBlocks(t *testing.T) []string {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join("..", "README.md"))
	require.NoError(t, err)
	readme := string(raw)
	const heading = "## Quick start against your own database\n"
	i := strings.Index(readme, heading)
	require.GreaterOrEqual(t, i, 0, "the README has no %q", heading)
	section := readme[i+len(heading):]
	if j := strings.Index(section, "\n## "); j >= 0 {
		section = section[:j]
	}
	var blocks []string
	for {
		start := strings.Index(section, "```sh\n")
		if start < 0 {
			break
		}
		section = section[start+len("```sh\n"):]
		end := strings.Index(section, "```\n")
		require.GreaterOrEqual(t, end, 0, "an unclosed block")
		blocks = append(blocks, section[:end])
		section = section[end:]
	}
	return blocks
}

// replaceOnce replaces the one occurrence of old in s.
func replaceOnce(t *testing.T, s, old, new string) string {
	t.Helper()
	require.Equal(t, 1, strings.Count(s, old), "the quick start should hold %q once:\n%s", old, s)
	return strings.Replace(s, old, new, 1)
}

// TestREADMEQuickStart runs the README's quick start as it is written, in
// one bash, against a fresh PostgreSQL (a source database with orders,
// their lines and shipments, and a target database) and a webhook
// receiver: the test gives the three values the reader gives (the two
// database URLs and the webhook URL), has built bin/ for `make build`, and
// deletes an order where the README says "let your application delete an
// order". The archive then holds the order's whole rows, its snapshot
// nests the lines and the shipment, the receiver got the order's webhook,
// and the restore put every deleted row back as it was.
func TestREADMEQuickStart(t *testing.T) {
	t.Parallel()
	blocks := quickStartBlocks(t)
	require.Len(t, blocks, 2, "the quick start: start everything, then look and restore")
	// The quick start uses the binaries' default ports.
	for _, addr := range []string{"127.0.0.1:4222", "127.0.0.1:9187", "127.0.0.1:9188"} {
		l, err := net.Listen("tcp", addr)
		require.NoError(t, err, "the quick start needs %s free (the default ports of the capture and projector)", addr)
		require.NoError(t, l.Close())
	}
	bins := binaries(t)
	work := t.TempDir()
	require.NoError(t, os.Mkdir(filepath.Join(work, "bin"), 0o755))
	for name, path := range bins {
		require.NoError(t, os.Symlink(path, filepath.Join(work, "bin", name)))
	}

	pg, err := testenv.StartPostgres()
	require.NoError(t, err)
	t.Cleanup(func() { _ = pg.Stop(); _ = os.RemoveAll(filepath.Dir(pg.DataDir)) })
	testenv.Exec(t, pg.URL("postgres"), `CREATE DATABASE app`)
	testenv.Exec(t, pg.URL("postgres"), `CREATE DATABASE archive`)
	source, target := pg.URL("app"), pg.URL("archive")
	testenv.Exec(t, source, `
		CREATE TABLE orders (id int PRIMARY KEY, customer text NOT NULL, total numeric(10,2) NOT NULL);
		CREATE TABLE order_lines (id int PRIMARY KEY, order_id int NOT NULL REFERENCES orders ON DELETE CASCADE,
			sku text NOT NULL, qty int NOT NULL);
		CREATE TABLE shipments (id int PRIMARY KEY, order_id int NOT NULL REFERENCES orders ON DELETE CASCADE, carrier text NOT NULL);
		INSERT INTO orders SELECT i, 'customer ' || i, i * 10.5 FROM generate_series(1, 5) i;
		INSERT INTO order_lines SELECT i, 1 + i % 5, 'sku-' || i, i FROM generate_series(1, 15) i;
		INSERT INTO shipments SELECT i, i, 'carrier ' || i FROM generate_series(1, 5) i`)
	const deleteOrder = `DELETE FROM orders WHERE id = 2`
	snapshotOf := func(ctx context.Context, conn *pgx.Conn) string {
		var s string
		require.NoError(t, conn.QueryRow(ctx, `SELECT (SELECT json_agg(o ORDER BY id) FROM orders o WHERE id = 2)::text ||
			(SELECT json_agg(l ORDER BY id) FROM order_lines l WHERE order_id = 2)::text ||
			(SELECT json_agg(s ORDER BY id) FROM shipments s WHERE order_id = 2)::text`).Scan(&s))
		return s
	}
	ctx := context.Background()
	src, err := pgx.Connect(ctx, source)
	require.NoError(t, err)
	defer src.Close(ctx)
	before := snapshotOf(ctx, src)

	var mu sync.Mutex
	var hooks []http.Header
	var bodies []string
	hook := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		hooks, bodies = append(hooks, r.Header.Clone()), append(bodies, string(b))
		mu.Unlock()
		w.WriteHeader(http.StatusNoContent)
	}))
	defer hook.Close()

	first := blocks[0]
	first = replaceOnce(t, first, "make build\n", ": make build: the test built bin/capture and bin/projector\n")
	first = replaceOnce(t, first, "'postgres://epitaph_capture:secret@db:5432/app'", "'"+source+"'")
	first = replaceOnce(t, first, "'postgres://epitaph_projector:secret@db:5432/archive'", "'"+target+"'")
	first = replaceOnce(t, first, "'https://hooks.example/order-deleted'", "'"+hook.URL+"/order-deleted'")
	script := "set -e\n" + first + "\n# the application deletes an order\npsql \"$EPITAPH_SOURCE_URL\" -c '" + deleteOrder + "'\n" + blocks[1]
	require.NoError(t, os.WriteFile(filepath.Join(work, "quickstart.sh"), []byte(script), 0o644))

	cmd := exec.Command("bash", "quickstart.sh")
	cmd.Dir = work
	cmd.Env = []string{"PGCONNECT_TIMEOUT=10"}
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "EPITAPH_") { // nothing of the test's own settings
			cmd.Env = append(cmd.Env, kv)
		}
	}
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	// Its own process group: the capture and the projector it starts in
	// the background are stopped with it.
	cmd.SysProcAttr = bench.DiesWithParent(&syscall.SysProcAttr{Setpgid: true})
	require.NoError(t, cmd.Start())
	pgid := cmd.Process.Pid
	stopAll := func() {
		_ = syscall.Kill(-pgid, syscall.SIGTERM)
		for i := 0; i < 100 && syscall.Kill(-pgid, 0) == nil; i++ {
			time.Sleep(100 * time.Millisecond)
		}
		_ = syscall.Kill(-pgid, syscall.SIGKILL)
	}
	t.Cleanup(stopAll)
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	logs := func() string {
		var b strings.Builder
		for _, f := range []string{"capture.log", "projector.log"} {
			raw, _ := os.ReadFile(filepath.Join(work, f))
			b.WriteString("\n--- " + f + " (tail)\n")
			if len(raw) > 4000 {
				raw = raw[len(raw)-4000:]
			}
			b.Write(raw)
		}
		return b.String()
	}
	select {
	case err := <-done:
		require.NoError(t, err, "the quick start failed:\n%s%s", out.String(), logs())
	case <-time.After(5 * time.Minute):
		stopAll()
		t.Fatalf("the quick start did not finish in 5 minutes:\n%s%s", out.String(), logs())
	}
	printed := out.String()

	// Whole rows archived: the order, its lines and its shipment.
	tgt, err := pgx.Connect(ctx, target)
	require.NoError(t, err)
	defer tgt.Close(ctx)
	var orders, lines, ships int
	require.NoError(t, tgt.QueryRow(ctx, `SELECT count(*) FILTER (WHERE table_name = 'orders' AND row->>'customer' = 'customer 2' AND row->>'total' = '21.00'),
		count(*) FILTER (WHERE table_name = 'order_lines' AND row ? 'sku'),
		count(*) FILTER (WHERE table_name = 'shipments' AND row->>'carrier' = 'carrier 2') FROM archive.rows`).Scan(&orders, &lines, &ships))
	require.Equal(t, []int{1, 3, 1}, []int{orders, lines, ships}, "whole rows archived:\n%s", printed)
	require.Contains(t, printed, `"customer": "customer 2"`, "the README's archive query shows the whole row")

	// A snapshot of the order with its lines and shipment.
	var doc string
	require.NoError(t, tgt.QueryRow(ctx, `SELECT payload::text FROM archive.snapshots
		WHERE root_table = 'public.orders' AND root_key = '{"id": 2}' AND status = 'complete'`).Scan(&doc), printed)
	for _, want := range []string{`"sku-1"`, `"sku-6"`, `"sku-11"`, `"carrier 2"`} {
		require.Contains(t, doc, want, "the snapshot nests the lines and the shipment")
	}

	// The webhook: one signed POST for the order.
	mu.Lock()
	require.Len(t, bodies, 1, "one delivery for the one deleted order")
	require.Regexp(t, `"id":\s*2\b`, bodies[0])
	require.NotEmpty(t, hooks[0].Get("Webhook-Id"), "a Standard Webhooks message id")
	mu.Unlock()
	var state string
	require.NoError(t, tgt.QueryRow(ctx, `SELECT state FROM archive.deliveries`).Scan(&state))
	require.Equal(t, "done", state)

	// Restored: the order and its rows are back as they were.
	require.Equal(t, before, snapshotOf(ctx, src), "restored rows equal the deleted ones:\n%s", printed)
	var restores int
	require.NoError(t, tgt.QueryRow(ctx, `SELECT count(*) FROM epitaph.restores`).Scan(&restores))
	require.Equal(t, 1, restores)
}
