package revalidate_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	neturl "net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/handler/revalidate"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/version"
)

func TestMain(m *testing.M) { testenv.MainNoLeaks(m) }

const src = "main"

// env is one test's target (migrated, archive v1 live) and source
// databases, with query counters on both.
type env struct {
	t         *testing.T
	ctx       context.Context
	target    *pgxpool.Pool
	source    *pgxpool.Pool
	sourceURL string
	targetQ   *counter
	sourceQ   *counter
	reg       *prometheus.Registry
	ev        *revalidate.Evaluator
	handler   string
	lsn       atomic.Int64
}

// counter is a pgx.QueryTracer that counts the statements run, by text.
type counter struct {
	mu   sync.Mutex
	sqls []string
}

func (c *counter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	c.mu.Lock()
	c.sqls = append(c.sqls, d.SQL)
	c.mu.Unlock()
	return ctx
}

func (c *counter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// since counts statements after mark that contain substr ("" = all).
func (c *counter) since(mark int, substr string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for _, s := range c.sqls[mark:] {
		if strings.Contains(s, substr) {
			n++
		}
	}
	return n
}

func (c *counter) mark() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.sqls)
}

func tracedPool(t *testing.T, url string, tr pgx.QueryTracer) *pgxpool.Pool {
	t.Helper()
	pc, err := pgxpool.ParseConfig(url)
	require.NoError(t, err)
	pc.ConnConfig.Tracer = tr
	p, err := pgxpool.NewWithConfig(context.Background(), pc)
	require.NoError(t, err)
	t.Cleanup(p.Close)
	return p
}

func setup(t *testing.T) *env {
	t.Helper()
	return setupWith(t, testenv.NewDatabase(t))
}

func setupWith(t *testing.T, sourceURL string) *env {
	t.Helper()
	t.Parallel()
	ctx := context.Background()
	e := &env{t: t, ctx: ctx, targetQ: &counter{}, sourceQ: &counter{}, reg: prometheus.NewRegistry(), sourceURL: sourceURL}
	e.target = tracedPool(t, testenv.NoSearchPath(testenv.NewDatabase(t)), e.targetQ)
	require.NoError(t, migrations.Apply(ctx, e.target))
	require.NoError(t, version.EnsureArchive(ctx, e.target, 1, nil))
	e.source = tracedPool(t, sourceURL, nil)
	_, err := e.source.Exec(ctx, `CREATE TABLE IF NOT EXISTS public.customers (id int8 PRIMARY KEY, name text)`)
	require.NoError(t, err)
	e.ev, err = revalidate.New(e.target, revalidate.Config{SourceURL: sourceURL, SourceTracer: e.sourceQ,
		Logger: testLogger(), Registerer: e.reg})
	require.NoError(t, err)
	t.Cleanup(e.ev.Close)
	e.handler = e.addHandler("00000000-0000-4000-8000-000000000001", true)
	e.lsn.Store(0x1000000)
	return e
}

func (e *env) exec(sql string, args ...any) {
	e.t.Helper()
	_, err := e.target.Exec(e.ctx, sql, args...)
	require.NoError(e.t, err)
}

func (e *env) addHandler(id string, revalidateOn bool) string {
	e.t.Helper()
	e.exec(`INSERT INTO epitaph.handlers (id, schema_name, table_name, kind, target, revalidate)
		VALUES ($1, 'public', 'customers', 'webhook', 'http://127.0.0.1:1/', $2)`, id, revalidateOn)
	return id
}

// group is an archived source transaction.
type group struct {
	lsn, corr string
}

func (e *env) newGroup() group {
	l := e.lsn.Add(0x100)
	lsn := fmt.Sprintf("0/%X", l)
	return group{lsn: lsn, corr: fmt.Sprintf("%s:%d:%s", src, l/16, lsn)}
}

// archive inserts a verified row of customers into the live version, as
// the apply does.
func (e *env) archive(g group, seq int, id int64, name string) {
	e.t.Helper()
	e.exec(`INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row, identity, correlation_id,
		is_root, commit_lsn, seq, verified)
		VALUES ($1, 'public', 'customers', $2, $3, 'full', $4, true, $5::pg_lsn, $6, true)`,
		src, fmt.Sprintf(`{"id":%d}`, id), fmt.Sprintf(`{"id":%d,"name":%q}`, id, name), g.corr, g.lsn, seq)
}

// queue inserts the handler's released delivery for a row, as the apply
// does, and stamps the group as the release does. It returns the id.
func (e *env) queue(handler string, g group, seq int, id int64) string {
	e.t.Helper()
	var did string
	err := pgx.BeginFunc(e.ctx, e.target, func(tx pgx.Tx) error {
		err := tx.QueryRow(e.ctx, `INSERT INTO epitaph.deliveries (id, handler_id, source, commit_lsn, seq, schema_name,
			table_name, key, correlation_id, version, released_at, payload)
			VALUES (gen_random_uuid(), $1, $2, $3::pg_lsn, $4, 'public', 'customers', $5, $6, 1, now(), $7)
			RETURNING id::text`, handler, src, g.lsn, seq, fmt.Sprintf(`{"id":%d}`, id), g.corr,
			fmt.Sprintf(`{"key":{"id":%d},"columns":{}}`, id)).Scan(&did)
		if err != nil {
			return err
		}
		_, err = revalidate.StampGroups(e.ctx, tx, "archive_v1", src, []string{g.lsn})
		return err
	})
	require.NoError(e.t, err)
	return did
}

// evaluate evaluates and records, as the dispatcher does before an attempt.
func (e *env) evaluate(id string) revalidate.Result {
	e.t.Helper()
	res, err := e.ev.Evaluate(e.ctx, id)
	require.NoError(e.t, err)
	require.NoError(e.t, e.ev.Record(e.ctx, res))
	return res
}

// deliveryRow is what the tests check of a delivery.
type deliveryRow struct {
	ID, Outcome, Fingerprint, Observed string
	Generation, GroupRows              int
	Payload                            map[string]json.RawMessage
	Evaluated                          bool
}

func (e *env) delivery(where string, args ...any) deliveryRow {
	e.t.Helper()
	var d deliveryRow
	var payload []byte
	err := e.target.QueryRow(e.ctx, `SELECT id::text, COALESCE(outcome, ''), COALESCE(fingerprint, ''),
		COALESCE(observed_fingerprint, ''), generation, COALESCE(group_rows, -1), payload, evaluated_at IS NOT NULL
		FROM epitaph.deliveries WHERE `+where, args...).Scan(&d.ID, &d.Outcome, &d.Fingerprint, &d.Observed,
		&d.Generation, &d.GroupRows, &payload, &d.Evaluated)
	require.NoError(e.t, err)
	if payload != nil {
		require.NoError(e.t, json.Unmarshal(payload, &d.Payload))
	}
	return d
}

func writeFile(path, s string) error { return os.WriteFile(path, []byte(s), 0o600) }

func withUser(url, user string) string {
	u, err := neturl.Parse(url)
	if err != nil {
		panic(err)
	}
	u.User = neturl.User(user)
	return u.String()
}

func testLogger() *slog.Logger {
	if os.Getenv("EPITAPH_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

// metric is the value of the series of a counter with exactly labels.
func (e *env) metric(name string, labels map[string]string) float64 {
	e.t.Helper()
	mfs, err := e.reg.Gather()
	require.NoError(e.t, err)
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	series:
		for _, m := range mf.GetMetric() {
			if len(m.GetLabel()) != len(labels) {
				continue
			}
			for _, l := range m.GetLabel() {
				if labels[l.GetName()] != l.GetValue() {
					continue series
				}
			}
			return m.GetCounter().GetValue()
		}
	}
	return 0
}
