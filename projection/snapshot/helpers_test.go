package snapshot_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/projection/snapshot"
)

func TestMain(m *testing.M) { testenv.MainNoLeaks(m) }

// archiveRowsDDL is the archive read model's rows table exactly as the
// projector creates it (COMMON.md), for tests that do not run the projector.
const archiveRowsDDL = `
CREATE SCHEMA IF NOT EXISTS %[1]s;
CREATE TABLE %[1]s.rows (
	source text, schema_name text, table_name text, key jsonb, row jsonb, identity text,
	correlation_id text, is_root boolean, xid bigint, commit_lsn pg_lsn, commit_time timestamptz,
	seq integer, archived_at timestamptz default now(), expires_at timestamptz, refs jsonb, columns jsonb,
	verified boolean NOT NULL DEFAULT true,
	primary key (source, commit_lsn, seq));`

// sourceDDL is the application schema whose deletes the tests archive:
// orders -> lines (composite key) -> line_notes (composite foreign key),
// orders -> shipments, self-referencing categories, and an unrelated table.
const sourceDDL = `
CREATE TYPE mood AS ENUM ('happy', 'sad');
CREATE TABLE orders (
	id bigint PRIMARY KEY, customer text NOT NULL, total numeric(12,2), big bigint, placed_at timestamptz,
	rush boolean, score double precision, attrs jsonb, tags text[], blob bytea, feeling mood, note text);
CREATE TABLE lines (
	order_id bigint REFERENCES orders(id), line_no int, sku text, qty int, price numeric,
	PRIMARY KEY (order_id, line_no));
CREATE TABLE line_notes (
	id serial PRIMARY KEY, order_id bigint, line_no int, body text,
	FOREIGN KEY (order_id, line_no) REFERENCES lines(order_id, line_no));
CREATE TABLE shipments (id int PRIMARY KEY, order_id bigint REFERENCES orders(id), carrier text);
CREATE TABLE categories (id int PRIMARY KEY, parent_id int REFERENCES categories(id) DEFERRABLE, name text);
CREATE TABLE audit (id serial PRIMARY KEY, what text);
`

type env struct {
	ctx    context.Context
	pool   *pgxpool.Pool // the code under test's: empty search_path
	src    *pgxpool.Pool // the test's source SQL (unqualified names)
	url    string
	schema string
	lsn    *atomic.Uint64
}

// setup gives a fresh database with the source schema, the archive rows
// table and the snapshots table in archive_v1.
func setup(t *testing.T) *env {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	t.Cleanup(cancel)
	url := testenv.NewDatabase(t)
	testenv.Exec(t, url, sourceDDL)
	testenv.Exec(t, url, fmt.Sprintf(archiveRowsDDL, "archive_v1"))
	pool, err := pgxpool.New(ctx, testenv.NoSearchPath(url)) // a missing schema qualifier fails
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	src, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	t.Cleanup(src.Close)
	require.NoError(t, snapshot.Migrate(ctx, pool, "archive_v1"))
	lsn := &atomic.Uint64{}
	lsn.Store(0x1A000000)
	return &env{ctx: ctx, pool: pool, src: src, url: url, schema: "archive_v1", lsn: lsn}
}

func (e *env) exec(t *testing.T, sql string, args ...any) {
	t.Helper()
	_, err := e.src.Exec(e.ctx, sql, args...)
	require.NoError(t, err, sql)
}

// archived is a row deleted from the source, encoded as the capture would.
type archived struct {
	Table    string // schema.table
	Schema   string
	Name     string
	Key      json.RawMessage
	Row      json.RawMessage
	Refs     []event.Ref
	Columns  []event.Column
	Seq      int
	Original string // the deleted row's row::text
}

// sourceTx records the deletes of one source transaction.
type sourceTx struct {
	e      *env
	tx     pgx.Tx
	commit event.Event
	rows   []*archived
}

// begin starts a source transaction whose deletes will be archived.
func (e *env) begin(t *testing.T) *sourceTx {
	t.Helper()
	tx, err := e.src.Begin(e.ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	lsn := event.LSN(e.lsn.Add(0x100))
	return &sourceTx{e: e, tx: tx, commit: event.Event{
		V: event.Version, Op: event.OpCommit, Source: "main", XID: int64(lsn) % 100000,
		CommitLSN: lsn, CommitTime: time.Date(2026, 11, 30, 9, 0, 0, 123456000, time.UTC), Tables: map[string]int{},
	}}
}

type colInfo struct {
	name, typ, typname string
	pk                 bool
}

// valueExpr encodes column c of alias t as the wire format does (event.Event
// doc): bool and integers as JSON, floats as numbers or "NaN"/"Infinity",
// json/jsonb embedded, everything else (numeric included) as its text form.
func valueExpr(c colInfo) string {
	col := "t." + pgx.Identifier{c.name}.Sanitize()
	switch c.typname {
	case "bool", "int2", "int4", "int8", "oid":
		return "to_jsonb(" + col + ")"
	case "float4", "float8":
		return fmt.Sprintf("CASE WHEN %[1]s IN ('NaN', 'Infinity', '-Infinity') THEN to_jsonb(%[1]s::text) ELSE to_jsonb(%[1]s) END", col)
	case "json", "jsonb":
		return col + "::jsonb"
	default:
		return "to_jsonb(" + col + "::text)"
	}
}

func objectExpr(cols []colInfo, keyOnly bool) string {
	var parts []string
	for _, c := range cols {
		if keyOnly && !c.pk {
			continue
		}
		parts = append(parts, "'"+strings.ReplaceAll(c.name, "'", "''")+"'", valueExpr(c))
	}
	return "jsonb_build_object(" + strings.Join(parts, ", ") + ")"
}

// del runs DELETE FROM schema.name WHERE where (in order of the given
// clause), and records each deleted row as an archived row with the
// table's columns and foreign keys read from the catalog.
func (s *sourceTx) del(t *testing.T, qualified, where string, args ...any) []*archived {
	t.Helper()
	ctx := s.e.ctx
	schema, name, _ := strings.Cut(qualified, ".")
	rel := pgx.Identifier{schema, name}.Sanitize()
	rows, err := s.tx.Query(ctx, `
		SELECT a.attname, format_type(a.atttypid, a.atttypmod), ty.typname,
		       coalesce(a.attnum = ANY (i.indkey), false)
		  FROM pg_attribute a JOIN pg_type ty ON ty.oid = a.atttypid
		  LEFT JOIN pg_index i ON i.indrelid = a.attrelid AND i.indisprimary
		 WHERE a.attrelid = $1::regclass AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum`, rel)
	require.NoError(t, err)
	cols, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (colInfo, error) {
		var c colInfo
		return c, r.Scan(&c.name, &c.typ, &c.typname, &c.pk)
	})
	require.NoError(t, err)
	rows, err = s.tx.Query(ctx, `
		SELECT array(SELECT a.attname FROM unnest(c.conkey) WITH ORDINALITY k(n, o)
		             JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = k.n ORDER BY k.o),
		       fn.nspname, ft.relname,
		       array(SELECT a.attname FROM unnest(c.confkey) WITH ORDINALITY k(n, o)
		             JOIN pg_attribute a ON a.attrelid = c.confrelid AND a.attnum = k.n ORDER BY k.o)
		  FROM pg_constraint c JOIN pg_class ft ON ft.oid = c.confrelid
		  JOIN pg_namespace fn ON fn.oid = ft.relnamespace
		 WHERE c.contype = 'f' AND c.conrelid = $1::regclass ORDER BY c.conname`, rel)
	require.NoError(t, err)
	refs, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (event.Ref, error) {
		var f event.Ref
		return f, r.Scan(&f.Columns, &f.Schema, &f.Table, &f.RefColumns)
	})
	require.NoError(t, err)
	var columns []event.Column
	for _, c := range cols {
		columns = append(columns, event.Column{Name: c.name, Type: c.typ, PK: c.pk})
	}
	q := fmt.Sprintf("DELETE FROM %s AS t WHERE %s RETURNING %s, %s, t::text",
		rel, where, objectExpr(cols, true), objectExpr(cols, false))
	rows, err = s.tx.Query(ctx, q, args...)
	require.NoError(t, err)
	var out []*archived
	for rows.Next() {
		a := &archived{Table: qualified, Schema: schema, Name: name, Refs: refs, Columns: columns}
		require.NoError(t, rows.Scan(&a.Key, &a.Row, &a.Original))
		a.Seq = len(s.rows)
		s.rows = append(s.rows, a)
		s.commit.Tables[qualified]++
		s.commit.Rows++
		out = append(out, a)
	}
	require.NoError(t, rows.Err())
	require.NotEmpty(t, out, "delete from %s where %s deleted nothing", qualified, where)
	return out
}

func (s *sourceTx) correlationID() string { return s.commit.CorrelationID() }

// archive inserts the given rows into the archive as the projector would.
func (s *sourceTx) archive(t *testing.T, tx pgx.Tx, rows []*archived) {
	t.Helper()
	for _, a := range rows {
		refs, err := json.Marshal(a.Refs)
		require.NoError(t, err)
		cols, err := json.Marshal(a.Columns)
		require.NoError(t, err)
		_, err = tx.Exec(s.e.ctx, `INSERT INTO `+pgx.Identifier{s.e.schema, "rows"}.Sanitize()+`
			(source, schema_name, table_name, key, row, identity, correlation_id, is_root, xid,
			 commit_lsn, commit_time, seq, refs, columns)
			VALUES ($1, $2, $3, $4, $5, 'full', $6, false, $7, $8::pg_lsn, $9, $10, $11, $12)`,
			s.commit.Source, a.Schema, a.Name, a.Key, a.Row, s.correlationID(), s.commit.XID,
			s.commit.CommitLSN.String(), s.commit.CommitTime, a.Seq, refs, cols)
		require.NoError(t, err)
	}
}

// apply commits the source transaction, then archives its rows except
// those withheld (as if quarantined) and applies the commit event with
// snapshot.CreateJobs for roots, in one target transaction. It returns the
// number of jobs created.
func (s *sourceTx) apply(t *testing.T, roots []string, withheld ...*archived) int {
	t.Helper()
	require.NoError(t, s.tx.Commit(s.e.ctx))
	var keep []*archived
	for _, a := range s.rows {
		skip := false
		for _, w := range withheld {
			skip = skip || w == a
		}
		if !skip {
			keep = append(keep, a)
		}
	}
	tx, err := s.e.pool.Begin(s.e.ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.Background()) }()
	s.archive(t, tx, keep)
	n, err := snapshot.CreateJobs(s.e.ctx, tx, s.e.schema, &s.commit, roots)
	require.NoError(t, err)
	require.NoError(t, tx.Commit(s.e.ctx))
	return n
}

// replay archives rows that arrive after the commit was applied and
// invalidates the transaction's jobs, as the projector does.
func (s *sourceTx) replay(t *testing.T, rows ...*archived) int {
	t.Helper()
	tx, err := s.e.pool.Begin(s.e.ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.Background()) }()
	s.archive(t, tx, rows)
	n, err := snapshot.Invalidate(s.e.ctx, tx, s.e.schema, []string{s.correlationID()})
	require.NoError(t, err)
	require.NoError(t, tx.Commit(s.e.ctx))
	return n
}

// doc is a decoded snapshot document.
type doc struct {
	Root     docNode              `json:"root"`
	Children map[string][]docNode `json:"children"`
	Meta     snapshot.Meta        `json:"meta"`
}

type docNode struct {
	Table    string               `json:"table"`
	Key      json.RawMessage      `json:"key"`
	Row      json.RawMessage      `json:"row"`
	Children map[string][]docNode `json:"children"`
}

// show returns the transaction's snapshots keyed by root key text.
func (e *env) show(t *testing.T, correlationID string) map[string]snapshot.Snapshot {
	t.Helper()
	list, err := snapshot.Show(e.ctx, e.pool, e.schema, correlationID)
	require.NoError(t, err)
	out := map[string]snapshot.Snapshot{}
	for _, s := range list {
		out[compact(t, s.RootKey)] = s
	}
	return out
}

func decodeDoc(t *testing.T, s snapshot.Snapshot) doc {
	t.Helper()
	require.Equal(t, snapshot.StatusComplete, s.Status, "reason: %s", s.FailureReason)
	var d doc
	require.NoError(t, json.Unmarshal(s.Payload, &d))
	return d
}

func compact(t *testing.T, raw json.RawMessage) string {
	t.Helper()
	var v any
	d := json.NewDecoder(strings.NewReader(string(raw)))
	d.UseNumber()
	require.NoError(t, d.Decode(&v))
	b, err := json.Marshal(v)
	require.NoError(t, err)
	return string(b)
}

// keys lists the compacted keys of nodes.
func keys(t *testing.T, nodes []docNode) []string {
	t.Helper()
	var out []string
	for _, n := range nodes {
		out = append(out, compact(t, n.Key))
	}
	return out
}

func (e *env) batch(t *testing.T, cfg snapshot.Config) snapshot.Result {
	t.Helper()
	if cfg.Schema == "" {
		cfg.Schema = e.schema
	}
	res, err := snapshot.RunBatch(e.ctx, e.pool, cfg)
	require.NoError(t, err)
	return res
}
