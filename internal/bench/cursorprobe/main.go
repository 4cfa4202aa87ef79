// Command cursorprobe measures the core loop of a cursor-based webhook
// dispatcher, the alternative to a queued row per delivery: the apply
// writes no delivery row; each batching webhook handler keeps a cursor
// (commit_lsn, seq) in a small table and walks the live archive in commit
// order up to the archive's horizon (the minimum of the partitions'
// watermarks). Per batch: one query for the next rows of the handler's
// table after the cursor, the batch body built and signed as the
// dispatcher's webhook kind does, one POST, one UPDATE of the cursor.
//
// It seeds a real archive (migrations and the archive version's own DDL)
// on a throwaway PostgreSQL, runs the loop against a receiver in a child
// process (this binary) that answers 200 at once, and prints the CPU per
// delivery of Postgres, of this process (the dispatcher) and of the
// receiver. It fails unless every seeded row reached the receiver exactly
// once for its table's handler, each batch correctly signed.
package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/internal/bench"
	"github.com/epitaph-dev/epitaph/internal/pgquote"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// receiverEnv, when set (to the secret file), makes this binary the
// receiver: see receiverMain.
const receiverEnv = "EPITAPH_CURSORPROBE_RECEIVER"

const source = "bench"

// tables are the seeded tables with their rows per transaction (the
// projector bench's shop: an order with 3 lines, a shipment with 2 items;
// a customer every 10th transaction).
var tables = []struct {
	name  string
	perTx int
}{{"customers", 0}, {"orders", 1}, {"order_lines", 3}, {"shipments", 1}, {"shipment_items", 2}}

type opts struct {
	rows, batch, parallelism int
	keep                     bool
}

func main() {
	if secret := os.Getenv(receiverEnv); secret != "" {
		os.Exit(receiverMain(secret))
	}
	var o opts
	flag.IntVar(&o.rows, "rows", 100_000, "archived rows to seed (over 5 tables)")
	flag.IntVar(&o.batch, "batch", 100, "deliveries per POST (the handlers' --batch-size)")
	flag.IntVar(&o.parallelism, "parallelism", 4, "batches in flight at once (the dispatcher's --handler-parallelism)")
	flag.BoolVar(&o.keep, "keep", false, "keep the work directory")
	flag.Parse()
	if o.rows < 1 || o.batch < 1 || o.batch > handler.MaxBatchSize || o.parallelism < 1 {
		fmt.Fprintf(os.Stderr, "cursorprobe: -rows and -parallelism must be >= 1, -batch in 1..%d\n", handler.MaxBatchSize)
		os.Exit(2)
	}
	if err := run(o); err != nil {
		fmt.Fprintf(os.Stderr, "cursorprobe: %v\n", err)
		os.Exit(1)
	}
}

func run(o opts) (err error) {
	ctx := context.Background()
	bench.LoadNote("at start")
	defer bench.LoadNote("at end")
	dir, err := bench.TempDir("epitaph-cursorprobe-")
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
	pg, err := testenv.StartPostgres()
	if err != nil {
		return err
	}
	defer func() {
		_ = pg.Stop()
		_ = os.RemoveAll(filepath.Dir(pg.DataDir))
	}()
	url, err := bench.CreateDatabase(ctx, pg, "cursorprobe")
	if err != nil {
		return err
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return err
	}
	defer pool.Close()
	s, err := seed(ctx, pool, o.rows)
	if err != nil {
		return err
	}
	bench.Note("postgres %s: seeded %d archived rows in %d transactions over %d tables, horizon %s", pg.BinDir, o.rows, s.txs, len(tables), s.horizon)

	secretFile := filepath.Join(dir, "webhook-secret")
	if err := os.WriteFile(secretFile, []byte(handler.NewSecret()+"\n"), 0o600); err != nil {
		return err
	}
	secrets, err := handler.ReadSecrets(secretFile)
	if err != nil {
		return err
	}
	rcv, err := startReceiver(secretFile)
	if err != nil {
		return err
	}
	defer rcv.stop()

	hs := make([]*cursor, len(tables))
	for i, t := range tables {
		hs[i] = &cursor{id: fmt.Sprintf("00000000-0000-4000-8000-%012d", i+1), schema: "public", table: t.name, lsn: "0/0", seq: -1}
		if _, err := pool.Exec(ctx, `INSERT INTO cursorprobe.handler_cursors (handler_id, source) VALUES ($1, $2)`, hs[i].id, source); err != nil {
			return fmt.Errorf("insert cursor: %w", err)
		}
	}
	// The densest table (3 rows of 7) and the sparsest (1 of ~70): the
	// rows of the other tables between them are read and filtered out.
	for _, h := range []*cursor{hs[2], hs[0]} {
		if err := explain(ctx, pool, h, s, o.batch); err != nil {
			return err
		}
	}

	l := &loop{pool: pool, client: handler.NewHTTPClient(o.parallelism), url: rcv.url, secrets: secrets, batch: o.batch}
	pg0, err := bench.PostgresCPU(pg.DataDir)
	if err != nil {
		return err
	}
	self0, _ := bench.ProcCPU(os.Getpid())
	rcv0, _ := bench.ProcCPU(rcv.pid())
	start := time.Now()
	if err := l.run(ctx, hs, o.parallelism); err != nil {
		return err
	}
	wall := time.Since(start).Seconds()
	pg1, err := bench.PostgresCPU(pg.DataDir)
	if err != nil {
		return err
	}
	self1, _ := bench.ProcCPU(os.Getpid())
	rcv1, _ := bench.ProcCPU(rcv.pid())

	n := l.delivered.Load()
	if err := verify(ctx, pool, rcv, hs); err != nil {
		return err
	}
	us := func(sec float64) float64 { return sec * 1e6 / float64(n) }
	bench.Figure("cursorprobe.deliveries", float64(n), fmt.Sprintf("deliveries (%d handlers, one a table; every one checked at the receiver)", len(hs)))
	bench.Figure("cursorprobe.batches", float64(l.batches.Load()), fmt.Sprintf("POSTs (--batch-size %d)", o.batch))
	bench.Figure("cursorprobe.wall_seconds", wall, fmt.Sprintf("s (parallelism %d)", o.parallelism))
	bench.Figure("cursorprobe.deliveries_per_sec", float64(n)/wall, "deliveries/s")
	bench.Figure("cursorprobe.postgres_cpu_us_per_delivery", us(pg1-pg0), "µs of Postgres CPU per delivery (postmaster and every child: the select, the cursor update, the horizon)")
	bench.Figure("cursorprobe.probe_cpu_us_per_delivery", us(self1-self0), "µs of this process's CPU per delivery (query, body, signature, POST: the dispatcher's side)")
	bench.Figure("cursorprobe.receiver_cpu_us_per_delivery", us(rcv1-rcv0), "µs of the receiver process's CPU per delivery (answers 200 at once)")
	bench.Figure("cursorprobe.postgres_plus_probe_cpu_us_per_delivery", us(pg1-pg0+self1-self0), "µs per delivery, Postgres + dispatcher (bench-handlers' \"CPU per delivery after the apply\")")
	return nil
}

// seeded is what seed made.
type seeded struct {
	txs     int
	horizon string // the archive's "complete up to" LSN
}

// seed creates the schema (migrations, archive version 1 with its own DDL
// and the current period's partition, the cursor table), archives rows
// rows in transactions of the shop's shape, sets every partition's
// watermark to the last commit and leaves the tables vacuumed, analyzed
// and checkpointed.
func seed(ctx context.Context, pool *pgxpool.Pool, rows int) (seeded, error) {
	if err := migrations.Apply(ctx, pool); err != nil {
		return seeded{}, fmt.Errorf("migrate: %w", err)
	}
	const partitions = 8
	if err := version.EnsureArchive(ctx, pool, partitions, nil); err != nil {
		return seeded{}, fmt.Errorf("create archive_v1: %w", err)
	}
	now := time.Now()
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := archive.EnsurePartitions(ctx, tx, archive.Schema(1), archive.DefaultPeriod, now)
		return err
	}); err != nil {
		return seeded{}, fmt.Errorf("create the partition: %w", err)
	}
	if _, err := pool.Exec(ctx, `CREATE SCHEMA cursorprobe;
		CREATE TABLE cursorprobe.handler_cursors (handler_id uuid PRIMARY KEY, source text NOT NULL,
			commit_lsn pg_lsn NOT NULL DEFAULT '0/0', seq integer NOT NULL DEFAULT -1, updated_at timestamptz NOT NULL DEFAULT now())`); err != nil {
		return seeded{}, fmt.Errorf("create the cursor table: %w", err)
	}
	pad := strings.Repeat("x", 96)
	var data [][]any
	lsn := event.LSN(0x1000000)
	tx := 0
	for len(data) < rows {
		tx++
		lsn += 0x2000
		xid := int64(1000 + tx)
		ct := now.Add(-time.Duration(rows-len(data)) * time.Millisecond)
		corr := event.CorrelationID(source, xid, lsn)
		seq := 0
		for _, t := range tables {
			k := t.perTx
			if t.perTx == 0 && tx%10 == 1 {
				k = 1
			}
			for range k {
				if len(data) == rows {
					break
				}
				id := len(data) + 1
				row := fmt.Sprintf(`{"id": %d, "tx": %d, "amount": "%d.%02d", "status": "shipped", "created_at": "%s", "note": "%s"}`,
					id, tx, id%1000, id%100, ct.UTC().Format(time.RFC3339Nano), pad)
				data = append(data, []any{source, "public", t.name, fmt.Sprintf(`{"id": %d}`, id), row, "full", corr, true, xid,
					lsn.String(), ct, int32(seq), true})
				seq++
			}
		}
	}
	cols := []string{"source", "schema_name", "table_name", "key", "row", "identity", "correlation_id", "is_root", "xid",
		"commit_lsn", "commit_time", "seq", "verified"}
	// Through a staging table of text columns (pgx has no pg_lsn type),
	// as the projector bench's raw writes do.
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return seeded{}, err
	}
	defer conn.Release()
	if _, err := conn.Exec(ctx, `CREATE TEMP TABLE staging (source text, schema_name text, table_name text, key text, row text,
		identity text, correlation_id text, is_root boolean, xid bigint, commit_lsn text, commit_time timestamptz, seq integer, verified boolean)`); err != nil {
		return seeded{}, fmt.Errorf("create staging: %w", err)
	}
	if _, err := conn.Conn().CopyFrom(ctx, pgx.Identifier{"staging"}, cols, pgx.CopyFromRows(data)); err != nil {
		return seeded{}, fmt.Errorf("copy: %w", err)
	}
	tag, err := conn.Exec(ctx, `INSERT INTO archive_v1.rows (`+strings.Join(cols, ", ")+`)
		SELECT source, schema_name, table_name, key::jsonb, row::jsonb, identity, correlation_id, is_root, xid,
		       commit_lsn::pg_lsn, commit_time, seq, verified FROM staging`)
	if err != nil {
		return seeded{}, fmt.Errorf("insert the archive rows: %w", err)
	}
	if tag.RowsAffected() != int64(rows) {
		return seeded{}, fmt.Errorf("archived %d rows, want %d", tag.RowsAffected(), rows)
	}
	var inDefault int64
	if err := conn.QueryRow(ctx, `SELECT count(*) FROM archive_v1.`+archive.DefaultPartition).Scan(&inDefault); err != nil {
		return seeded{}, err
	}
	if inDefault != 0 {
		return seeded{}, fmt.Errorf("%d seeded rows went to the default partition", inDefault)
	}
	// The watermarks: every partition of the live version complete up to
	// the last commit.
	tag, err = conn.Exec(ctx, `UPDATE epitaph.progress SET source_lsn = $2::pg_lsn WHERE projection = $1 AND version = 1`,
		archive.Projection, lsn.String())
	if err != nil {
		return seeded{}, fmt.Errorf("watermarks: %w", err)
	}
	if tag.RowsAffected() != partitions {
		return seeded{}, fmt.Errorf("watermarks: %d progress rows of archive_v1, want %d", tag.RowsAffected(), partitions)
	}
	for _, q := range []string{"VACUUM ANALYZE", "CHECKPOINT"} {
		if _, err := conn.Exec(ctx, q); err != nil {
			return seeded{}, fmt.Errorf("%s: %w", q, err)
		}
	}
	return seeded{txs: tx, horizon: lsn.String()}, nil
}

// horizonSQL is the archive's "complete up to" LSN: the minimum of the
// live version's partition watermarks.
const horizonSQL = `SELECT min(source_lsn)::text FROM epitaph.progress WHERE projection = $1 AND version = 1`

// nextSQL reads a handler's next batch: the rows of its table after its
// cursor, up to the horizon, in commit order (rows_key: source,
// commit_lsn, seq, commit_time). The LSN's text is named apart: ORDER BY
// commit_lsn would sort by an output column of that name, as text.
const nextSQL = `SELECT key, correlation_id, commit_lsn::text AS lsn_text, seq, commit_time FROM archive_v1.rows
	WHERE source = $1 AND (commit_lsn, seq) > ($2::pg_lsn, $3::integer) AND commit_lsn <= $4::pg_lsn
	  AND schema_name = $5 AND table_name = $6 AND verified
	ORDER BY commit_lsn, seq LIMIT $7`

const advanceSQL = `UPDATE cursorprobe.handler_cursors SET commit_lsn = $2::pg_lsn, seq = $3, updated_at = now() WHERE handler_id = $1`

// cursor is one handler's position; a handler is worked by one goroutine
// at a time.
type cursor struct {
	id, schema, table string
	lsn               string
	seq               int
}

type loop struct {
	pool               *pgxpool.Pool
	client             *http.Client
	url                string
	secrets            handler.Secrets
	batch              int
	delivered, batches atomic.Int64
}

// run works every handler to the horizon, parallelism batches at once:
// each goroutine takes a handler, sends its next batch and hands it back,
// until every handler has caught up.
func (l *loop) run(ctx context.Context, hs []*cursor, parallelism int) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	ready := make(chan *cursor, len(hs))
	for _, h := range hs {
		ready <- h
	}
	var active atomic.Int64
	active.Store(int64(len(hs)))
	var wg sync.WaitGroup
	var once sync.Once
	var failed error
	for range parallelism {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				var h *cursor
				select {
				case <-ctx.Done():
					return
				case h = <-ready:
				}
				more, err := l.step(ctx, h)
				switch {
				case err != nil:
					once.Do(func() { failed = fmt.Errorf("handler %s (%s.%s): %w", h.id, h.schema, h.table, err) })
					cancel()
					return
				case more:
					ready <- h // never blocks: room for every handler
				case active.Add(-1) == 0:
					cancel() // every handler caught up
				}
			}
		}()
	}
	wg.Wait()
	return failed
}

// step sends h's next batch and advances its cursor; false when h has
// caught up with the horizon.
func (l *loop) step(ctx context.Context, h *cursor) (bool, error) {
	var horizon string
	if err := l.pool.QueryRow(ctx, horizonSQL, archive.Projection).Scan(&horizon); err != nil {
		return false, fmt.Errorf("horizon: %w", err)
	}
	rows, err := l.pool.Query(ctx, nextSQL, source, h.lsn, h.seq, horizon, h.schema, h.table, l.batch)
	if err != nil {
		return false, fmt.Errorf("next batch: %w", err)
	}
	body := handler.BatchBody{Deliveries: make([]handler.Body, 0, l.batch)}
	ids := make([]string, 0, l.batch)
	var (
		key        json.RawMessage
		corr, lsn  string
		seq        int
		commitTime *time.Time
	)
	_, err = pgx.ForEachRow(rows, []any{&key, &corr, &lsn, &seq, &commitTime}, func() error {
		d := handler.Delivery{ID: handler.DeliveryID(h.id, source, lsn, seq, 0), HandlerID: h.id, Source: source,
			CommitLSN: lsn, Seq: seq, Schema: h.schema, Table: h.table, Key: bytes.Clone(key), CorrelationID: corr}
		if commitTime != nil {
			ct := *commitTime
			d.CommitTime = &ct
		}
		body.Deliveries = append(body.Deliveries, d.Body())
		ids = append(ids, d.ID)
		return nil
	})
	if err != nil {
		return false, fmt.Errorf("next batch: %w", err)
	}
	if len(ids) == 0 {
		return false, nil
	}
	b, err := json.Marshal(body)
	if err != nil {
		return false, fmt.Errorf("encode the batch: %w", err)
	}
	if err := l.post(ctx, handler.BatchID(ids), len(ids), b); err != nil {
		return false, err
	}
	if _, err := l.pool.Exec(ctx, advanceSQL, h.id, lsn, seq); err != nil {
		return false, fmt.Errorf("advance the cursor: %w", err)
	}
	h.lsn, h.seq = lsn, seq
	l.delivered.Add(int64(len(ids)))
	l.batches.Add(1)
	return len(ids) == l.batch, nil
}

// post sends a batch as the dispatcher's webhook kind does (same headers,
// Standard Webhooks signature and the deprecated Epitaph-Signature with
// the current key, as its unexported signWebhook sets them).
func (l *loop) post(ctx context.Context, id string, n int, body []byte) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, l.url, bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("User-Agent", "epitaph-projector")
	req.Header.Set(handler.HeaderBatchSize, strconv.Itoa(n))
	req.Header.Set(handler.HeaderAttempt, "1")
	now := time.Now()
	req.Header.Set(handler.HeaderWebhookID, id)
	req.Header.Set(handler.HeaderWebhookTimestamp, strconv.FormatInt(now.Unix(), 10))
	sig, err := l.secrets.SignatureHeader(id, now, body)
	if err != nil {
		return fmt.Errorf("sign: %w", err)
	}
	req.Header.Set(handler.HeaderWebhookSignature, sig)
	req.Header.Set(handler.HeaderSignature, handler.Sign(l.secrets[0].Key, body))
	resp, err := l.client.Do(req)
	if err != nil {
		return fmt.Errorf("post: %w", err)
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("post: %s", resp.Status)
	}
	return nil
}

// explain prints the plans of h's batch query from the middle of the
// archive, with its parameters (a custom plan) and as the generic plan a
// prepared statement may switch to, and whether each reads every
// partition through its rows_key index.
func explain(ctx context.Context, pool *pgxpool.Pool, h *cursor, s seeded, batch int) error {
	var mid string
	if err := pool.QueryRow(ctx, `SELECT commit_lsn::text FROM archive_v1.rows WHERE source = $1 AND table_name = $2
		ORDER BY commit_lsn OFFSET (SELECT count(*) / 2 FROM archive_v1.rows WHERE table_name = $2) LIMIT 1`, source, h.table).Scan(&mid); err != nil {
		return fmt.Errorf("explain: middle: %w", err)
	}
	parts, err := archive.Partitions(ctx, pool, archive.Schema(1))
	if err != nil {
		return err
	}
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	custom, err := planLines(ctx, conn.Conn(), `EXPLAIN (ANALYZE, BUFFERS, COSTS OFF, TIMING OFF) `+nextSQL, source, mid, 0, s.horizon, h.schema, h.table, batch)
	if err != nil {
		return err
	}
	if _, err := conn.Exec(ctx, `SET plan_cache_mode = force_generic_plan;
		PREPARE cursorprobe_next (text, pg_lsn, integer, pg_lsn, text, text, bigint) AS `+nextSQL); err != nil {
		return fmt.Errorf("explain: prepare: %w", err)
	}
	generic, err := planLines(ctx, conn.Conn(), fmt.Sprintf(`EXPLAIN (COSTS OFF) EXECUTE cursorprobe_next (%s, %s, 0, %s, %s, %s, %d)`,
		pgquote.Literal(source), pgquote.Literal(mid), pgquote.Literal(s.horizon), pgquote.Literal(h.schema), pgquote.Literal(h.table), batch))
	if err != nil {
		return err
	}
	if _, err := conn.Exec(ctx, `DEALLOCATE cursorprobe_next; RESET plan_cache_mode`); err != nil {
		return fmt.Errorf("explain: deallocate: %w", err)
	}
	for _, kind := range []string{"custom", "generic"} {
		lines := custom
		if kind == "generic" {
			lines = generic
		}
		for _, l := range lines {
			bench.Note("plan (%s, %s, cursor at %s): %s", kind, h.table, mid, l)
		}
		var off []string
		for _, p := range parts {
			if scan := partitionScan(lines, p.Name); scan != "Index Scan using "+p.Name+"_source_commit_lsn_seq_commit_time_key" {
				off = append(off, p.Name+": "+scan)
			}
		}
		if len(off) == 0 {
			bench.Note("plan check (%s, %s): every partition read through its rows_key index, in commit order (Merge Append)", kind, h.table)
		} else {
			bench.Note("plan check (%s, %s): NOT through rows_key: %s", kind, h.table, strings.Join(off, "; "))
		}
	}
	return nil
}

// partitionScan is how a plan reads a partition: its scan node's kind and
// index ("" when the plan does not read it).
func partitionScan(lines []string, partition string) string {
	for _, l := range lines {
		l = strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(l), "->"))
		if i := strings.Index(l, " on "+partition+" "); i >= 0 { // "<scan> on <partition> <alias> ..."
			return l[:i]
		}
	}
	return ""
}

func planLines(ctx context.Context, conn *pgx.Conn, query string, args ...any) ([]string, error) {
	rows, err := conn.Query(ctx, query, args...)
	if err != nil {
		return nil, fmt.Errorf("explain: %w", err)
	}
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("explain: %w", err)
	}
	return lines, nil
}

// receiver is the child process that answers the POSTs.
type receiver struct {
	cmd *exec.Cmd
	url string
}

func (r *receiver) pid() int { return r.cmd.Process.Pid }

func (r *receiver) stop() {
	_ = r.cmd.Process.Kill()
	_ = r.cmd.Wait()
}

// startReceiver starts this binary as the receiver and reads its address.
func startReceiver(secretFile string) (*receiver, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(self)
	cmd.Env = append(os.Environ(), receiverEnv+"="+secretFile)
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = bench.DiesWithParent(&syscall.SysProcAttr{})
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start the receiver: %w", err)
	}
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		return nil, fmt.Errorf("the receiver's address: %w", err)
	}
	return &receiver{cmd: cmd, url: "http://" + strings.TrimSpace(line) + "/hook"}, nil
}

// report is the receiver's account of what it got.
type report struct {
	Calls         int      `json:"calls"`
	BadSignatures int      `json:"bad_signatures"`
	BadBodies     int      `json:"bad_bodies"`
	IDs           []string `json:"ids"`
}

// receiverMain serves POSTs on a local port (printed on stdout), keeping
// each body and its signature headers and answering 200 at once; GET
// /report checks the signatures and returns every delivery id received.
func receiverMain(secretFile string) int {
	secrets, err := handler.ReadSecrets(secretFile)
	if err != nil {
		fmt.Fprintf(os.Stderr, "receiver: %v\n", err)
		return 2
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fmt.Fprintf(os.Stderr, "receiver: %v\n", err)
		return 1
	}
	type call struct {
		id, ts, sig, legacy string
		body                []byte
	}
	var mu sync.Mutex
	var calls []call
	mux := http.NewServeMux()
	mux.HandleFunc("POST /hook", func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		c := call{id: r.Header.Get(handler.HeaderWebhookID), ts: r.Header.Get(handler.HeaderWebhookTimestamp),
			sig: r.Header.Get(handler.HeaderWebhookSignature), legacy: r.Header.Get(handler.HeaderSignature), body: b}
		mu.Lock()
		calls = append(calls, c)
		mu.Unlock()
		w.WriteHeader(http.StatusOK)
	})
	mux.HandleFunc("GET /report", func(w http.ResponseWriter, _ *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		rep := report{Calls: len(calls)}
		for _, c := range calls {
			sec, err := strconv.ParseInt(c.ts, 10, 64)
			want, serr := secrets.SignatureHeader(c.id, time.Unix(sec, 0), c.body)
			if err != nil || serr != nil || want != c.sig || c.legacy != handler.Sign(secrets[0].Key, c.body) {
				rep.BadSignatures++
			}
			var bb handler.BatchBody
			if err := json.Unmarshal(c.body, &bb); err != nil || len(bb.Deliveries) == 0 {
				rep.BadBodies++
				continue
			}
			ids := make([]string, len(bb.Deliveries))
			for i, d := range bb.Deliveries {
				ids[i] = d.DeliveryID
			}
			if handler.BatchID(ids) != c.id {
				rep.BadBodies++
			}
			rep.IDs = append(rep.IDs, ids...)
		}
		_ = json.NewEncoder(w).Encode(rep)
	})
	fmt.Println(ln.Addr().String())
	srv := &http.Server{ReadHeaderTimeout: 5 * time.Second, Handler: mux}
	if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		fmt.Fprintf(os.Stderr, "receiver: %v\n", err)
		return 1
	}
	return 0
}

// verify checks that the receiver got every archived row exactly once for
// its table's handler (by the deterministic delivery ids), every batch
// signed and named by its ids, and that each handler's persisted cursor is
// its table's last row.
func verify(ctx context.Context, pool *pgxpool.Pool, rcv *receiver, hs []*cursor) error {
	resp, err := http.Get(strings.TrimSuffix(rcv.url, "/hook") + "/report")
	if err != nil {
		return fmt.Errorf("receiver report: %w", err)
	}
	defer resp.Body.Close()
	var rep report
	if err := json.NewDecoder(resp.Body).Decode(&rep); err != nil {
		return fmt.Errorf("receiver report: %w", err)
	}
	if rep.BadSignatures > 0 || rep.BadBodies > 0 {
		return fmt.Errorf("receiver: %d of %d batches badly signed, %d with a bad body or batch id", rep.BadSignatures, rep.Calls, rep.BadBodies)
	}
	want := map[string]bool{}
	for _, h := range hs {
		rows, err := pool.Query(ctx, `SELECT commit_lsn::text, seq FROM archive_v1.rows WHERE source = $1 AND schema_name = $2 AND table_name = $3`,
			source, h.schema, h.table)
		if err != nil {
			return err
		}
		var lsn string
		var seq int
		if _, err := pgx.ForEachRow(rows, []any{&lsn, &seq}, func() error {
			want[handler.DeliveryID(h.id, source, lsn, seq, 0)] = true
			return nil
		}); err != nil {
			return err
		}
		var last, stored string
		if err := pool.QueryRow(ctx, `SELECT (SELECT (commit_lsn, seq)::text FROM archive_v1.rows WHERE source = $1 AND table_name = $2
				ORDER BY commit_lsn DESC, seq DESC LIMIT 1), (SELECT (commit_lsn, seq)::text FROM cursorprobe.handler_cursors WHERE handler_id = $3)`,
			source, h.table, h.id).Scan(&last, &stored); err != nil {
			return err
		}
		if last != stored {
			return fmt.Errorf("handler %s: cursor %s, last row %s", h.id, stored, last)
		}
	}
	seen := make(map[string]int, len(rep.IDs))
	var dup, unexpected int
	for _, id := range rep.IDs {
		seen[id]++
		if seen[id] == 2 {
			dup++
		}
		if !want[id] {
			unexpected++
		}
	}
	missing := 0
	for id := range want {
		if seen[id] == 0 {
			missing++
		}
	}
	if dup > 0 || unexpected > 0 || missing > 0 {
		return fmt.Errorf("receiver: %d delivery ids of %d rows: %d duplicated, %d unexpected, %d missing", len(rep.IDs), len(want), dup, unexpected, missing)
	}
	bench.Note("verified: %d deliveries, each archived row once for its table's handler, in %d signed batches; every cursor at its table's last row", len(rep.IDs), rep.Calls)
	return nil
}
