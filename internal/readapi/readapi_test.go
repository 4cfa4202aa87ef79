package readapi

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/httptoken"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/projection"
	"github.com/epitaph-dev/epitaph/projection/status"
)

func TestMain(m *testing.M) { testenv.MainNoLeaks(m) }

// env is a live pipeline without the capture: signed events published to
// JetStream as the capture would, the real projector, its target, and the
// read API on an httptest server.
type env struct {
	t      *testing.T
	url    string
	nats   *testenv.NATS
	js     jetstream.JetStream
	signer *testenv.Signer
	pool   *pgxpool.Pool
	api    *httptest.Server
	lsn    event.LSN
}

func setup(t *testing.T, token string) *env {
	t.Helper()
	ctx := context.Background()
	e := &env{t: t, url: testenv.NewDatabase(t), nats: testenv.NewNATS(t), signer: testenv.NewSigner(), lsn: 0x1000000}
	_, e.js = e.nats.Connect(t)
	_, err := e.js.CreateStream(ctx, jetstream.StreamConfig{Name: event.StreamName("main"),
		Subjects: []string{event.StreamSubjects("main")}, Storage: jetstream.FileStorage,
		Metadata: map[string]string{event.MetaPartitions: "1"}})
	require.NoError(t, err)
	e.pool, err = pgxpool.New(ctx, e.url)
	require.NoError(t, err)
	t.Cleanup(e.pool.Close)
	mux := http.NewServeMux()
	cfg := Config{DB: e.pool}
	if token != "" {
		file := filepath.Join(t.TempDir(), "token")
		require.NoError(t, os.WriteFile(file, []byte(token+"\n"), 0o600))
		cfg.Token, err = httptoken.Load(file)
		require.NoError(t, err)
	}
	Register(mux, cfg)
	e.api = httptest.NewServer(mux)
	t.Cleanup(e.api.Close)
	return e
}

func (e *env) startProjector() {
	e.t.Helper()
	svc, err := projection.New(projection.Config{TargetURL: testenv.NoSearchPath(e.url), NATSURL: e.nats.URL, SourceName: "main",
		WorkerID: "w1", LeaseTTL: 3 * time.Second, FetchWait: 100 * time.Millisecond, StatusInterval: 200 * time.Millisecond,
		SnapshotRoots: []string{"public.customers"}},
		projection.WithLogger(slog.New(slog.DiscardHandler)), projection.WithRegistry(prometheus.NewRegistry()))
	require.NoError(e.t, err)
	require.NoError(e.t, svc.Start(context.Background()))
	e.t.Cleanup(func() { require.NoError(e.t, svc.Stop(context.Background())) })
}

func (e *env) publish(subject, id string, ev *event.Event) {
	e.t.Helper()
	b, err := event.Encode(ev)
	require.NoError(e.t, err)
	m := nats.NewMsg(subject)
	m.Data = b
	m.Header.Set(event.HeaderMsgID, id)
	e.signer.Sign(m)
	_, err = e.js.PublishMsg(context.Background(), m)
	require.NoError(e.t, err)
}

// deleteTx publishes a transaction deleting customer cust and its orders;
// it returns its correlation id and commit LSN.
func (e *env) deleteTx(cust int, orders ...int) (string, event.LSN) {
	e.t.Helper()
	e.lsn += 0x100
	lsn, xid := e.lsn, int64(e.lsn)/16
	at := time.Date(2026, 11, 24, 9, 0, 0, 0, time.UTC).Add(time.Duration(lsn) * time.Microsecond)
	row := func(seq int, table, key, image string, refs []event.Ref) {
		e.publish(event.DeleteSubject("main", 0, "public", table), event.MsgID("main", lsn, seq), &event.Event{
			Op: event.OpDelete, Source: "main", Schema: "public", Table: table, XID: xid, CommitLSN: lsn, CommitTime: at, Seq: seq,
			Identity: event.IdentityFull, Key: json.RawMessage(key), Row: json.RawMessage(image), Refs: refs,
			Columns: []event.Column{{Name: "id", Type: "bigint", PK: true}, {Name: "v", Type: "text"}}})
	}
	row(0, "customers", fmt.Sprintf(`{"id":%d}`, cust), fmt.Sprintf(`{"id":%d,"v":"lsn %s"}`, cust, lsn), nil)
	for i, o := range orders {
		row(i+1, "orders", fmt.Sprintf(`{"id":%d}`, o), fmt.Sprintf(`{"id":%d,"v":"of %d","customer_id":%d}`, o, cust, cust),
			[]event.Ref{{Columns: []string{"customer_id"}, Schema: "public", Table: "customers", RefColumns: []string{"id"}}})
	}
	e.publish(event.CommitSubject("main", 0), event.CommitMsgID("main", lsn), &event.Event{
		Op: event.OpCommit, Source: "main", XID: xid, CommitLSN: lsn, CommitTime: at, Rows: 1 + len(orders),
		Tables: map[string]int{"public.customers": 1, "public.orders": len(orders)}})
	return event.CorrelationID("main", xid, lsn), lsn
}

// answer is one response of the read API.
type answer struct {
	status       int
	state        string
	completeUpTo string
	body         map[string]json.RawMessage
}

func (e *env) get(path string, header ...string) answer {
	e.t.Helper()
	req, err := http.NewRequest(http.MethodGet, e.api.URL+path, nil)
	require.NoError(e.t, err)
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	res, err := http.DefaultClient.Do(req)
	require.NoError(e.t, err)
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	require.NoError(e.t, err)
	a := answer{status: res.StatusCode, state: res.Header.Get(HeaderViewState), completeUpTo: res.Header.Get(HeaderCompleteUpTo)}
	require.NoError(e.t, json.Unmarshal(b, &a.body), string(b))
	return a
}

func (a answer) items(t *testing.T, name string) []map[string]any {
	t.Helper()
	var out []map[string]any
	require.NoError(t, json.Unmarshal(a.body[name], &out), string(a.body[name]))
	return out
}

func (a answer) next() string {
	var s *string
	_ = json.Unmarshal(a.body["next_cursor"], &s)
	if s == nil {
		return ""
	}
	return *s
}

func rowsPath(table, key string, extra ...string) string {
	q := url.Values{"table": {table}, "key": {key}}
	for i := 0; i+1 < len(extra); i += 2 {
		q.Set(extra[i], extra[i+1])
	}
	return "/v1/rows?" + q.Encode()
}

// TestReadAPI: each endpoint against a live pipeline; 503 while the
// archive is not ready; pagination; wait_lsn answering 200, 504 and 409;
// a quarantined event makes the view quarantined.
func TestReadAPI(t *testing.T) {
	t.Parallel()
	e := setup(t, "")
	cust := rowsPath("public.customers", `{"id": 42}`)

	a := e.get(cust)
	require.Equal(t, http.StatusServiceUnavailable, a.status, "no projector yet: not a confident empty result")
	require.Equal(t, "unavailable", a.state)

	corr1, _ := e.deleteTx(42, 1, 2, 3)
	corr2, lsn2 := e.deleteTx(42)
	e.startProjector()
	require.Eventually(t, func() bool { return e.get(cust).status == http.StatusOK }, 120*time.Second, 100*time.Millisecond, "the archive becomes ready")

	a = e.get(cust)
	require.Equal(t, "ready", a.state)
	require.Equal(t, lsn2.String(), a.completeUpTo)
	rows := a.items(t, "rows")
	require.Len(t, rows, 2, "every archived version of the row")
	require.Equal(t, corr2, rows[0]["correlation_id"], "newest first")
	require.Equal(t, corr1, rows[1]["correlation_id"])
	for _, field := range []string{"source", "schema_name", "table_name", "key", "row", "identity", "correlation_id", "is_root",
		"xid", "commit_lsn", "commit_time", "seq", "archived_at", "expires_at"} {
		require.Contains(t, rows[0], field, "the view's field names")
	}
	require.Equal(t, map[string]any{"id": float64(42), "v": "lsn " + lsn2.String()}, rows[0]["row"])
	require.Empty(t, a.next())

	// Pagination: one row a page.
	a = e.get(rowsPath("public.customers", `{"id":42}`, "limit", "1"))
	require.Len(t, a.items(t, "rows"), 1)
	require.Equal(t, corr2, a.items(t, "rows")[0]["correlation_id"])
	require.NotEmpty(t, a.next())
	a = e.get(rowsPath("public.customers", `{"id":42}`, "limit", "1", "cursor", a.next()))
	require.Len(t, a.items(t, "rows"), 1)
	require.Equal(t, corr1, a.items(t, "rows")[0]["correlation_id"])
	require.Empty(t, a.next())

	a = e.get("/v1/transactions/" + url.PathEscape(corr1) + "?limit=3")
	require.Equal(t, http.StatusOK, a.status)
	tx := a.items(t, "rows")
	require.Len(t, tx, 3)
	for i, r := range tx {
		require.EqualValues(t, i, r["seq"], "delete order")
	}
	a = e.get("/v1/transactions/" + url.PathEscape(corr1) + "?limit=3&cursor=" + a.next())
	require.Len(t, a.items(t, "rows"), 1)
	require.Equal(t, map[string]any{"id": float64(3)}, a.items(t, "rows")[0]["key"])
	require.Empty(t, a.next())
	require.Equal(t, http.StatusNotFound, e.get("/v1/transactions/main:1:0%2F10").status)

	require.Eventually(t, func() bool {
		a = e.get("/v1/snapshots?" + url.Values{"table": {"public.customers"}, "key": {`{"id":42}`}}.Encode())
		return a.status == http.StatusOK && len(a.items(t, "snapshots")) == 2 && a.items(t, "snapshots")[1]["status"] == "complete"
	}, 60*time.Second, 100*time.Millisecond)
	snaps := a.items(t, "snapshots")
	require.Equal(t, corr2, snaps[0]["correlation_id"], "newest first")
	require.Equal(t, corr1, snaps[1]["correlation_id"])
	require.Equal(t, map[string]any{"id": float64(42)}, snaps[1]["root_key"])

	// Read your deletes: published, then asked for with its LSN.
	corr3, lsn3 := e.deleteTx(7)
	a = e.get(rowsPath("public.customers", `{"id":7}`, "wait_lsn", lsn3.String()))
	require.Equal(t, http.StatusOK, a.status)
	require.Len(t, a.items(t, "rows"), 1)
	require.Equal(t, corr3, a.items(t, "rows")[0]["correlation_id"])
	a = e.get(rowsPath("public.customers", `{"id":7}`, "wait_lsn", "FFFF/0", "timeout", "300ms"))
	require.Equal(t, http.StatusGatewayTimeout, a.status)

	// A quarantined event: wait_lsn past it is 409, and the view is
	// quarantined (503) until it is resolved.
	e.lsn += 0x100
	bad := nats.NewMsg(event.DeleteSubject("main", 0, "public", "customers"))
	bad.Data = []byte("not an event")
	bad.Header.Set(event.HeaderMsgID, event.MsgID("main", e.lsn, 0))
	_, err := e.js.PublishMsg(context.Background(), bad)
	require.NoError(t, err)
	_, lsn5 := e.deleteTx(8)
	require.Eventually(t, func() bool {
		a = e.get(rowsPath("public.customers", `{"id":8}`, "wait_lsn", lsn5.String(), "timeout", "1s"))
		return a.status == http.StatusConflict
	}, 60*time.Second, 100*time.Millisecond)
	require.Contains(t, string(a.body["blockers"]), "quarantine")
	a = e.get(cust)
	require.Equal(t, http.StatusServiceUnavailable, a.status)
	require.Equal(t, "quarantined", a.state)
	require.Contains(t, string(a.body["reasons"]), "quarantined events open")

	require.Equal(t, http.StatusBadRequest, e.get("/v1/rows?table=customers&key=%7B%7D").status)
	require.Equal(t, http.StatusBadRequest, e.get("/v1/rows?table=public.customers&key=42").status)
	require.Equal(t, http.StatusBadRequest, e.get(rowsPath("public.customers", `{"id":7}`, "cursor", "!!")).status)
}

// TestReadAPIToken: with a token, a request without it or with another
// is 401, with it the answer.
func TestReadAPIToken(t *testing.T) {
	t.Parallel()
	e := setup(t, "s3cret-token-of-the-read-api")
	e.deleteTx(42)
	e.startProjector()
	path := rowsPath("public.customers", `{"id":42}`)
	require.Equal(t, http.StatusUnauthorized, e.get(path).status)
	require.Equal(t, http.StatusUnauthorized, e.get(path, "Authorization", "Bearer wrong").status)
	require.Equal(t, http.StatusUnauthorized, e.get(path, "Authorization", "s3cret-token-of-the-read-api").status)
	require.Eventually(t, func() bool {
		return e.get(path, "Authorization", "Bearer s3cret-token-of-the-read-api").status == http.StatusOK
	}, 120*time.Second, 100*time.Millisecond)
}

// wait_lsn past the shared wait limit (held here as a GET /wait in flight
// would) is answered 503 with Retry-After at once; once the place is free,
// the wait is admitted and answers from the waits' own pool.
func TestReadAPIWaitLimit(t *testing.T) {
	t.Parallel()
	e := setup(t, "")
	e.deleteTx(42)
	e.startProjector()
	ctx := context.Background()
	waits, err := status.NewWaitPool(ctx, e.url, 0)
	require.NoError(t, err)
	defer waits.Close()
	limit := status.NewWaitLimiter(1)
	mux := http.NewServeMux()
	Register(mux, Config{DB: e.pool, WaitDB: waits, WaitLimit: limit})
	srv := httptest.NewServer(mux)
	defer srv.Close()
	path := rowsPath("public.customers", `{"id":42}`, "wait_lsn", "0/1", "timeout", "30s")
	get := func() (*http.Response, []byte) {
		res, err := http.Get(srv.URL + path)
		require.NoError(t, err)
		defer res.Body.Close()
		b, err := io.ReadAll(res.Body)
		require.NoError(t, err)
		return res, b
	}

	release, ok := limit.TryAcquire() // a wait in flight
	require.True(t, ok)
	res, body := get()
	require.Equal(t, http.StatusServiceUnavailable, res.StatusCode, string(body))
	require.Equal(t, "1", res.Header.Get("Retry-After"))
	require.Contains(t, string(body), "too many waits")
	release()
	res, body = get()
	require.Equal(t, http.StatusOK, res.StatusCode, string(body))
	require.Contains(t, string(body), `"key":{"id":42}`)
}

// TestReadAPITableRows: /v1/rows without key= lists a table's archived
// rows newest first in cursor pages, bounded by since= and until= on the
// commit time, with the view state headers; an unknown table is 404
// naming it, never an empty 200.
func TestReadAPITableRows(t *testing.T) {
	t.Parallel()
	e := setup(t, "")
	corr1, _ := e.deleteTx(1, 11)
	corr2, _ := e.deleteTx(2)
	corr3, lsn3 := e.deleteTx(3, 31, 32)
	e.startProjector()
	tablePath := func(table string, extra ...string) string {
		q := url.Values{"table": {table}}
		for i := 0; i+1 < len(extra); i += 2 {
			q.Set(extra[i], extra[i+1])
		}
		return "/v1/rows?" + q.Encode()
	}
	var a answer
	require.Eventually(t, func() bool {
		a = e.get(tablePath("public.customers"))
		return a.status == http.StatusOK && a.completeUpTo == lsn3.String()
	}, 120*time.Second, 100*time.Millisecond, "the archive becomes ready")
	require.Equal(t, "ready", a.state)
	keys := func(a answer) []string {
		var out []string
		for _, r := range a.items(t, "rows") {
			b, err := json.Marshal(r["key"])
			require.NoError(t, err)
			out = append(out, fmt.Sprintf("%s %s", r["correlation_id"], b))
		}
		return out
	}
	require.Equal(t, []string{corr3 + ` {"id":3}`, corr2 + ` {"id":2}`, corr1 + ` {"id":1}`}, keys(a), "newest first")
	require.Empty(t, a.next())

	// Cursor pages over the orders: 32, 31 then 11.
	a = e.get(tablePath("public.orders", "limit", "2"))
	require.Equal(t, []string{corr3 + ` {"id":32}`, corr3 + ` {"id":31}`}, keys(a))
	require.NotEmpty(t, a.next())
	a = e.get(tablePath("public.orders", "limit", "2", "cursor", a.next()))
	require.Equal(t, http.StatusOK, a.status)
	require.Equal(t, "ready", a.state)
	require.Equal(t, []string{corr1 + ` {"id":11}`}, keys(a))
	require.Empty(t, a.next())

	// The time range: the commit times are a microsecond per LSN apart
	// (deleteTx), so customer 2's time alone is in [t2, t3).
	rows := e.get(tablePath("public.customers")).items(t, "rows")
	t3, t2 := rows[0]["commit_time"].(string), rows[1]["commit_time"].(string)
	a = e.get(tablePath("public.customers", "since", t2, "until", t3))
	require.Equal(t, []string{corr2 + ` {"id":2}`}, keys(a))
	a = e.get(tablePath("public.customers", "since", t2))
	require.Equal(t, []string{corr3 + ` {"id":3}`, corr2 + ` {"id":2}`}, keys(a))
	a = e.get(tablePath("public.customers", "until", t2))
	require.Equal(t, []string{corr1 + ` {"id":1}`}, keys(a))
	a = e.get(tablePath("public.customers", "since", "2030-01-01T00:00:00Z"))
	require.Equal(t, http.StatusOK, a.status, "a known table with nothing in the range is an empty page")
	require.Empty(t, a.items(t, "rows"))

	// Unknown tables: 404 naming the table, with or without key=.
	a = e.get(tablePath("public.custmers"))
	require.Equal(t, http.StatusNotFound, a.status)
	require.Contains(t, string(a.body["error"]), "public.custmers")
	require.Equal(t, "ready", a.state, "the headers are set on a 404 too")
	a = e.get(rowsPath("nope.customers", `{"id":1}`))
	require.Equal(t, http.StatusNotFound, a.status)
	require.Contains(t, string(a.body["error"]), "nope.customers")
	a = e.get(rowsPath("public.customers", `{"id":999}`))
	require.Equal(t, http.StatusOK, a.status, "a known table without the key: an empty page")
	require.Empty(t, a.items(t, "rows"))

	require.Equal(t, http.StatusBadRequest, e.get(tablePath("public.customers", "since", "yesterday")).status)
	require.Equal(t, http.StatusBadRequest, e.get(tablePath("public.customers", "since", t3, "until", t2)).status)
	require.Equal(t, http.StatusBadRequest, e.get(rowsPath("public.customers", `{"id":1}`, "since", t2)).status)
}

// TestReadAPITableRowsPagesInOrder: a table's listing walked in small
// pages gives every row of the source once, newest first by (commit_lsn,
// seq), across transactions of several rows and commit-time partitions;
// rows of another source name in the archive are not the listing's.
func TestReadAPITableRowsPagesInOrder(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := setup(t, "")
	e.deleteTx(1)
	e.startProjector()
	require.Eventually(t, func() bool {
		return e.get("/v1/rows?table=public.customers").status == http.StatusOK
	}, 120*time.Second, 100*time.Millisecond, "the archive becomes ready")
	// 120 transactions of 3 rows each, a day apart from the 120th back
	// (in a monthly partition and the default one), and rows of another
	// source at LSNs among them.
	_, err := e.pool.Exec(ctx, `
		INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row, identity, correlation_id, xid,
		                             commit_lsn, commit_time, seq, columns)
		SELECT src, 'public', 'bulk', jsonb_build_object('id', g * 10 + s), jsonb_build_object('id', g * 10 + s), 'full',
		       src || ':' || g || ':2/' || to_hex(g * 256), g, ('2/' || to_hex(g * 256))::pg_lsn,
		       timestamptz '2026-11-24 09:00Z' - make_interval(days => 120 - g), s, '[]'
		FROM generate_series(1, 120) g, generate_series(0, 2) s, (VALUES ('main'), ('other')) v(src)
		WHERE src = 'main' OR (g % 3 = 0 AND s < 1) OR (g % 9 = 0)`)
	require.NoError(t, err)
	var want []string
	for g := 120; g >= 1; g-- {
		for s := 2; s >= 0; s-- {
			want = append(want, fmt.Sprintf("2/%X %d", g*256, s))
		}
	}

	var got []string
	path := "/v1/rows?table=public.bulk&limit=7"
	for pages := 0; ; pages++ {
		require.Less(t, pages, 100, "the pages end")
		a := e.get(path)
		require.Equal(t, http.StatusOK, a.status, string(a.body["error"]))
		for _, r := range a.items(t, "rows") {
			require.Equal(t, "main", r["source"])
			got = append(got, fmt.Sprintf("%s %v", r["commit_lsn"], r["seq"]))
		}
		if a.next() == "" {
			break
		}
		path = "/v1/rows?table=public.bulk&limit=7&cursor=" + url.QueryEscape(a.next())
	}
	require.Equal(t, want, got)
}
