// Package console is the projector's console for the people who look
// after deleted data: search the live archive (table, key, time range,
// correlation id), see a row with its transaction and snapshot document,
// restore it (the dry run first), erase it with a reason, and retry or
// discard failed deliveries, one, a selection or all matching a filter.
//
// Pages are server-rendered with html/template (every value from the
// archive is escaped) and read without scripts. They show deleted data, so
// with a token (--http-token-file) they need it: "Authorization: Bearer
// <token>", or Basic authentication with the token as the password, which
// a browser asks for by itself. Writes take the token from the Bearer
// header only (a browser never sends that by itself, unlike Basic
// credentials or cookies), refuse requests another site starts (Origin,
// Sec-Fetch-Site) and want a JSON body; the pages' small inline script
// sends them with the token the operator pasted, kept in the tab's
// sessionStorage. Without a token the writes are off (401).
package console

import (
	"bytes"
	"context"
	"embed"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"html/template"
	"log/slog"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/internal/httptoken"
	"github.com/epitaph-dev/epitaph/internal/statuspage"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/erasure"
	"github.com/epitaph-dev/epitaph/projection/status"
	"github.com/epitaph-dev/epitaph/quarantine"
)

// Prefix is where the console is mounted.
const Prefix = "/console/"

// PageSize is the rows of one search page.
const PageSize = 50

// Actor is who the console's writes are recorded as (erasure receipts,
// epitaph.restores).
const Actor = "console"

// Config of the console.
type Config struct {
	// DB is the target database.
	DB *pgxpool.Pool
	// Token guards the console (--http-token-file); nil: reads are open
	// (cmd/projector allows that on a loopback address only) to requests
	// for a loopback host only (httptoken.LoopbackHost; 403 otherwise: DNS
	// rebinding), and writes are off.
	Token *httptoken.Token
	// Source is the source name (archive.rows.source) and SourceURL its
	// database, where restores write; empty SourceURL: restores are off.
	Source, SourceURL string
	// SourceTCPTimeout is the TCP_USER_TIMEOUT of a restore's connection
	// to the source (pgdial.Set); 0 or negative: the system's default.
	SourceTCPTimeout time.Duration
	// Quarantine replays and discards quarantine entries (the status
	// page's actions, statuspage.QuarantineActions); nil: the console
	// lists the entries only.
	Quarantine statuspage.Actions
	// Projection is the archive projection (default "archive").
	Projection string
	Logger     *slog.Logger
}

//go:embed page.html
var pageFS embed.FS

var pages = template.Must(template.New("").Funcs(template.FuncMap{
	"json":   func(v json.RawMessage) string { return string(v) },
	"pretty": prettyJSON,
	"time": func(t *time.Time) string {
		if t == nil {
			return ""
		}
		return t.UTC().Format(time.RFC3339)
	},
	"restoreView": func(v *view, corr, table string, key json.RawMessage, what string) restoreView {
		b, _ := json.Marshal(struct {
			CorrelationID string          `json:"correlation_id"`
			Table         string          `json:"table,omitempty"`
			Key           json.RawMessage `json:"key,omitempty"`
		}{corr, table, key})
		return restoreView{RestoresOn: v.RestoresOn, Body: string(b), What: what}
	},
	"eraseBody": func(r *Row) string {
		b, _ := json.Marshal(struct {
			Table string          `json:"table"`
			Key   json.RawMessage `json:"key"`
		}{r.QualifiedTable(), r.Key})
		return string(b)
	},
	"filterBody": func(action string, f handler.Filter) string {
		var req DeliveriesRequest
		req.Action, req.All = action, true
		req.Filter.HandlerID, req.Filter.State, req.Filter.Table = f.HandlerID, f.State, f.Table
		b, _ := json.Marshal(req)
		return string(b)
	},
	// query builds a link's query string; it is already encoded, and typed
	// so that html/template normalizes it instead of encoding it again.
	"query": func(kv ...string) template.URL {
		q := url.Values{}
		for i := 0; i+1 < len(kv); i += 2 {
			if kv[i+1] != "" {
				q.Set(kv[i], kv[i+1])
			}
		}
		return template.URL(q.Encode()) //nolint:gosec // url.Values.Encode escapes every value
	},
}).ParseFS(pageFS, "page.html"))

// prettyJSON indents without decoding, so numbers keep every digit (int8
// keys beyond 2^53).
func prettyJSON(v json.RawMessage) string {
	var b bytes.Buffer
	if json.Indent(&b, v, "", "  ") != nil {
		return string(v)
	}
	return b.String()
}

// restoreView is the restore section: the request its buttons send.
type restoreView struct {
	RestoresOn bool
	Body, What string
}

// Register adds the console's routes to mux.
func Register(mux interface {
	Handle(pattern string, h http.Handler)
}, cfg Config) {
	if cfg.Projection == "" {
		cfg.Projection = archive.Projection
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	c := &console{cfg: cfg}
	mux.Handle("GET /console/{$}", c.read(c.search))
	mux.Handle("GET /console/tx", c.read(c.transaction))
	mux.Handle("GET /console/row", c.read(c.row))
	mux.Handle("GET /console/restores/{id}", c.read(c.restoreRecord))
	mux.Handle("GET /console/failed", c.read(c.failed))
	mux.Handle("GET /console/holds", c.read(c.holds))
	mux.Handle("POST /console/api/holds", c.write(c.addHold))
	mux.Handle("POST /console/api/holds/remove", c.write(c.removeHold))
	mux.Handle("POST /console/api/quarantine", c.write(c.quarantine))
	mux.Handle("POST /console/api/workers/prune", c.write(c.pruneWorkers))
	mux.Handle("POST /console/api/restore", c.write(c.restore))
	mux.Handle("POST /console/api/erase", c.write(c.erase))
	mux.Handle("POST /console/api/deliveries", c.write(c.deliveries))
}

type console struct{ cfg Config }

// readAuthorized: no token, the Bearer token, or Basic with the token as
// the password (what a browser without scripts can send).
func (c *console) readAuthorized(r *http.Request) bool {
	if c.cfg.Token == nil || c.cfg.Token.Check(r) {
		return true
	}
	if _, pass, ok := r.BasicAuth(); ok {
		return c.cfg.Token.Check(&http.Request{Header: http.Header{"Authorization": {"Bearer " + pass}}})
	}
	return false
}

// view is what every page gets.
type view struct {
	Title        string
	State        string
	CompleteUpTo string
	Reasons      []string
	WritesOn     bool
	RestoresOn   bool
	Error        string
	Data         any
}

func (c *console) read(page func(*http.Request, *view) (string, error)) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Cache-Control", "no-store")
		w.Header().Set("X-Frame-Options", "DENY")
		w.Header().Set("Content-Security-Policy", "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'")
		if c.cfg.Token == nil && !httptoken.LoopbackHost(r) {
			http.Error(w, httptoken.LoopbackOnly, http.StatusForbidden)
			return
		}
		if !c.readAuthorized(r) {
			w.Header().Set("WWW-Authenticate", `Basic realm="epitaph console (the password is the --http-token-file token)", charset="UTF-8"`)
			http.Error(w, "the console shows deleted data: the --http-token-file token is required", http.StatusUnauthorized)
			return
		}
		v := &view{WritesOn: c.cfg.Token != nil, RestoresOn: c.cfg.Token != nil && c.cfg.SourceURL != ""}
		state, st, err := status.ViewState(r.Context(), c.cfg.DB, c.cfg.Projection)
		v.State = state
		if st != nil {
			v.CompleteUpTo, v.Reasons = st.CompleteUpToLSN, st.NotReadyReasons
		}
		code := http.StatusOK
		name, perr := page(r, v)
		var he *httpError
		switch {
		case perr == nil:
		case errors.As(perr, &he):
			code, v.Error = he.status, he.msg
		default:
			code, v.Error = http.StatusServiceUnavailable, "unavailable: "+quarantine.Sanitize(perr)
		}
		if err != nil && v.Error == "" {
			v.Error = "the archive's state is unavailable: " + quarantine.Sanitize(err)
		}
		if name == "" {
			name = "error"
		}
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		w.WriteHeader(code)
		if err := pages.ExecuteTemplate(w, name, v); err != nil {
			c.cfg.Logger.Warn("console: render", "page", name, "err", err)
		}
	})
}

type httpError struct {
	status int
	msg    string
}

func (e *httpError) Error() string { return e.msg }

func fail(status int, format string, args ...any) error {
	return &httpError{status: status, msg: fmt.Sprintf(format, args...)}
}

// Row is an archived row as the pages show it.
type Row struct {
	Source        string          `json:"source"`
	Schema        string          `json:"schema_name"`
	Table         string          `json:"table_name"`
	Key           json.RawMessage `json:"key"`
	Row           json.RawMessage `json:"row"`
	CorrelationID string          `json:"correlation_id"`
	IsRoot        *bool           `json:"is_root"`
	CommitLSN     string          `json:"commit_lsn"`
	CommitTime    *time.Time      `json:"commit_time"`
	Seq           int             `json:"seq"`
	ArchivedAt    *time.Time      `json:"archived_at"`
	ExpiresAt     *time.Time      `json:"expires_at"`
}

// QualifiedTable is schema.table.
func (r Row) QualifiedTable() string { return r.Schema + "." + r.Table }

const rowColumns = `r.source, r.schema_name, r.table_name, r.key, r.row, r.correlation_id, r.is_root, r.commit_lsn::text,
	r.commit_time, r.seq, r.archived_at, r.expires_at`

func scanRows(rows pgx.Rows) ([]Row, error) {
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Row, error) {
		var x Row
		err := r.Scan(&x.Source, &x.Schema, &x.Table, &x.Key, &x.Row, &x.CorrelationID, &x.IsRoot, &x.CommitLSN,
			&x.CommitTime, &x.Seq, &x.ArchivedAt, &x.ExpiresAt)
		return x, err
	})
}

// searchData is the search page.
type searchData struct {
	Table, Key, Since, Until, Corr string
	Searched                       bool
	Rows                           []Row
	Next                           string
}

// searchSQL: newest first, by table (and key, exact JSON), commit time
// range and correlation id; every condition optional but one is asked.
const searchSQL = `SELECT ` + rowColumns + ` FROM archive.rows r
WHERE ($1::text IS NULL OR (r.schema_name = $1 AND r.table_name = $2))
  AND ($3::jsonb IS NULL OR r.key = $3)
  AND ($4::timestamptz IS NULL OR r.commit_time >= $4) AND ($5::timestamptz IS NULL OR r.commit_time < $5)
  AND ($6::text IS NULL OR r.correlation_id = $6)
  AND ($7::pg_lsn IS NULL OR (r.commit_lsn, r.seq, r.source) < ($7::pg_lsn, $8::int, $10::text))
ORDER BY r.commit_lsn DESC, r.seq DESC, r.source DESC
LIMIT $9`

func (c *console) search(r *http.Request, v *view) (string, error) {
	q := r.URL.Query()
	d := &searchData{Table: strings.TrimSpace(q.Get("table")), Key: strings.TrimSpace(q.Get("key")),
		Since: strings.TrimSpace(q.Get("since")), Until: strings.TrimSpace(q.Get("until")), Corr: strings.TrimSpace(q.Get("correlation_id"))}
	v.Title, v.Data = "Search the archive", d
	if d.Table == "" && d.Key == "" && d.Since == "" && d.Until == "" && d.Corr == "" {
		return "search", nil
	}
	d.Searched = true
	a, err := parseSearch(d, q.Get("cursor"))
	if err != nil {
		return "search", err
	}
	schema, table, lsn := a.schema, a.table, a.lsn
	rows, err := c.cfg.DB.Query(r.Context(), searchQuery(a), a.schema, a.table, a.key, a.since, a.until, a.corr, a.lsn, a.seq, PageSize+1, a.source)
	if err != nil {
		return "search", err
	}
	d.Rows, err = scanRows(rows)
	if err != nil {
		return "search", err
	}
	if len(d.Rows) > PageSize {
		d.Rows = d.Rows[:PageSize]
		last := d.Rows[PageSize-1]
		d.Next = encodeCursor(last.CommitLSN, last.Seq, last.Source)
	}
	if len(d.Rows) == 0 && lsn == nil && schema != nil {
		var seen bool
		if err := c.cfg.DB.QueryRow(r.Context(), `SELECT EXISTS (SELECT 1 FROM archive.rows WHERE schema_name = $1 AND table_name = $2)`,
			*schema, *table).Scan(&seen); err != nil {
			return "search", err
		}
		if !seen {
			return "search", fail(http.StatusNotFound, "table %s: the archive holds no row of it (never seen, or all expired or erased)", d.Table)
		}
	}
	return "search", nil
}

// searchArgs are the search's query parameters (nil: unbounded).
type searchArgs struct {
	schema, table, key, corr, lsn, source *string
	since, until                          *time.Time
	seq                                   *int
}

func parseSearch(d *searchData, cursor string) (searchArgs, error) {
	var a searchArgs
	if d.Table != "" {
		s, t, ok := strings.Cut(d.Table, ".")
		if !ok || s == "" || t == "" || strings.Contains(t, ".") {
			return a, fail(http.StatusBadRequest, "table %q: want schema.table", d.Table)
		}
		a.schema, a.table = &s, &t
	}
	if d.Key != "" {
		if d.Table == "" {
			return a, fail(http.StatusBadRequest, "a key needs its table")
		}
		var obj map[string]any
		if json.Unmarshal([]byte(d.Key), &obj) != nil || obj == nil {
			return a, fail(http.StatusBadRequest, `key %q: want a JSON object such as {"id":42}`, d.Key)
		}
		a.key = &d.Key
	}
	if d.Corr != "" {
		a.corr = &d.Corr
	}
	var err error
	if a.since, err = parseTime("since", d.Since); err != nil {
		return a, err
	}
	if a.until, err = parseTime("until", d.Until); err != nil {
		return a, err
	}
	if cursor != "" {
		l, n, src, ok := decodeCursor(cursor)
		if !ok {
			return a, fail(http.StatusBadRequest, "cursor: not one of this page's")
		}
		a.lsn, a.seq, a.source = &l, &n, &src
	}
	return a, nil
}

func parseTime(name, s string) (*time.Time, error) {
	if s == "" {
		return nil, nil
	}
	for _, layout := range []string{time.RFC3339Nano, "2006-01-02T15:04", "2006-01-02"} {
		if t, err := time.Parse(layout, s); err == nil {
			return &t, nil
		}
	}
	return nil, fail(http.StatusBadRequest, "%s %q: want a time such as 2026-11-24T09:00:00Z or 2026-11-24", name, s)
}

func encodeCursor(lsn string, seq int, source string) string {
	return base64.RawURLEncoding.EncodeToString([]byte(lsn + " " + strconv.Itoa(seq) + " " + source))
}

func decodeCursor(s string) (string, int, string, bool) {
	b, err := base64.RawURLEncoding.DecodeString(s)
	if err != nil {
		return "", 0, "", false
	}
	l, rest, ok := strings.Cut(string(b), " ")
	n, src, ok2 := strings.Cut(rest, " ")
	if !ok || !ok2 {
		return "", 0, "", false
	}
	seq, err := strconv.ParseInt(n, 10, 32)
	if err != nil || seq < 0 {
		return "", 0, "", false
	}
	lsn, err := event.ParseLSN(l)
	if err != nil {
		return "", 0, "", false
	}
	return lsn.String(), int(seq), src, true
}

// txData is a transaction: its rows by table and its snapshot documents.
type txData struct {
	CorrelationID string
	CommitTime    *time.Time
	CommitLSN     string
	Rows          int
	// Shown: the rows the page shows when the transaction has more than
	// maxTxRows (0: it shows them all).
	Shown     int
	Tables    []tableRows
	Snapshots []snapshotDoc
	// SnapshotsShown: the documents the page shows when the transaction
	// has more than maxTxSnapshots (0: it shows them all), of
	// SnapshotCount.
	SnapshotsShown, SnapshotCount int
	// Row is the row the page is about (the row page only).
	Row *Row
}

type tableRows struct {
	Table string
	Rows  []Row
}

type snapshotDoc struct {
	ID        int64
	RootTable string
	RootKey   json.RawMessage
	Status    string
	Payload   json.RawMessage
}

// maxTxRows bounds the rows a transaction page shows.
const maxTxRows = 2000

// maxTxSnapshots bounds the snapshot documents a transaction or row page
// shows: a bulk delete of a root table has a document per row, each with
// its descendants.
const maxTxSnapshots = 100

// txSnapshotsSQL reads the first documents of a transaction, the one
// rooted at the page's row ($2, $3; NULL on the transaction's page) first.
const txSnapshotsSQL = `SELECT s.id, s.root_table, s.root_key, s.status, s.payload FROM archive.snapshots s
		WHERE s.correlation_id = $1 ORDER BY (s.root_table = $2 AND s.root_key = $3::jsonb) IS TRUE DESC, s.id LIMIT $4`

// loadTx reads transaction corr for its page, or for the page of its row
// (nil: the transaction's page).
func (c *console) loadTx(ctx context.Context, corr string, row *Row) (*txData, error) {
	rows, err := c.cfg.DB.Query(ctx, `SELECT `+rowColumns+` FROM archive.rows r WHERE r.correlation_id = $1 ORDER BY r.seq LIMIT $2`, corr, maxTxRows+1)
	if err != nil {
		return nil, err
	}
	all, err := scanRows(rows)
	if err != nil {
		return nil, err
	}
	if len(all) == 0 {
		return nil, fail(http.StatusNotFound, "no archived rows of transaction %s (not archived, expired or erased)", corr)
	}
	d := &txData{CorrelationID: corr, CommitTime: all[0].CommitTime, CommitLSN: all[0].CommitLSN, Rows: len(all)}
	if len(all) > maxTxRows {
		// Said, not hidden: the page shows the first rows of the count.
		all = all[:maxTxRows]
		d.Shown = maxTxRows
		if err := c.cfg.DB.QueryRow(ctx, `SELECT count(*) FROM archive.rows r WHERE r.correlation_id = $1`, corr).Scan(&d.Rows); err != nil {
			return nil, err
		}
	}
	idx := map[string]int{}
	for _, r := range all {
		i, ok := idx[r.QualifiedTable()]
		if !ok {
			i = len(d.Tables)
			idx[r.QualifiedTable()] = i
			d.Tables = append(d.Tables, tableRows{Table: r.QualifiedTable()})
		}
		d.Tables[i].Rows = append(d.Tables[i].Rows, r)
	}
	var rootTable, rootKey *string
	if row != nil {
		t, k := row.QualifiedTable(), string(row.Key)
		rootTable, rootKey = &t, &k
	}
	snaps, err := c.cfg.DB.Query(ctx, txSnapshotsSQL, corr, rootTable, rootKey, maxTxSnapshots+1)
	if err != nil {
		if strings.Contains(err.Error(), "42P01") {
			return d, nil // no snapshot roots configured
		}
		return nil, err
	}
	d.Snapshots, err = pgx.CollectRows(snaps, func(r pgx.CollectableRow) (snapshotDoc, error) {
		var s snapshotDoc
		err := r.Scan(&s.ID, &s.RootTable, &s.RootKey, &s.Status, &s.Payload)
		return s, err
	})
	if err != nil || len(d.Snapshots) <= maxTxSnapshots {
		return d, err
	}
	d.Snapshots, d.SnapshotsShown = d.Snapshots[:maxTxSnapshots], maxTxSnapshots
	err = c.cfg.DB.QueryRow(ctx, `SELECT count(*) FROM archive.snapshots s WHERE s.correlation_id = $1`, corr).Scan(&d.SnapshotCount)
	return d, err
}

func (c *console) transaction(r *http.Request, v *view) (string, error) {
	corr := r.URL.Query().Get("correlation_id")
	if corr == "" {
		return "tx", fail(http.StatusBadRequest, "a transaction is named by correlation_id=")
	}
	v.Title = "Transaction " + corr
	d, err := c.loadTx(r.Context(), corr, nil)
	if err != nil {
		return "tx", err
	}
	v.Data = d
	return "tx", nil
}

func (c *console) row(r *http.Request, v *view) (string, error) {
	q := r.URL.Query()
	corr := q.Get("correlation_id")
	seq, err := strconv.Atoi(q.Get("seq"))
	if corr == "" || err != nil || seq < 0 {
		return "row", fail(http.StatusBadRequest, "a row is named by correlation_id= and seq=")
	}
	v.Title = "Row"
	rows, err := c.cfg.DB.Query(r.Context(), `SELECT `+rowColumns+` FROM archive.rows r WHERE r.correlation_id = $1 AND r.seq = $2`, corr, seq)
	if err != nil {
		return "row", err
	}
	found, err := scanRows(rows)
	if err != nil {
		return "row", err
	}
	var row *Row
	if len(found) > 0 {
		row = &found[0]
	}
	d, err := c.loadTx(r.Context(), corr, row)
	if err != nil {
		return "row", err
	}
	d.Row = row
	if d.Row == nil {
		return "row", fail(http.StatusNotFound, "transaction %s has no archived row %d (expired or erased)", corr, seq)
	}
	v.Title = d.Row.QualifiedTable() + " " + string(d.Row.Key)
	v.Data = d
	return "row", nil
}

func (c *console) restoreRecord(r *http.Request, v *view) (string, error) {
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	if err != nil || id <= 0 {
		return "record", fail(http.StatusBadRequest, "restore id %q: want a positive number", r.PathValue("id"))
	}
	v.Title = fmt.Sprintf("Restore %d", id)
	var doc json.RawMessage
	err = c.cfg.DB.QueryRow(r.Context(), `SELECT to_jsonb(x) FROM epitaph.restores x WHERE id = $1`, id).Scan(&doc)
	if errors.Is(err, pgx.ErrNoRows) {
		return "record", fail(http.StatusNotFound, "no restore %d in epitaph.restores", id)
	}
	v.Data = doc
	return "record", err
}

// failedData is the failed work page.
type failedData struct {
	Handlers   []handlerView
	Deliveries []handler.Info
	// Actionable: the deliveries listed that retry and discard apply to
	// (not those listed from the archive), at most MaxSelection.
	Actionable int
	// More: more than MaxSelection match; one action takes MaxSelection.
	More   bool
	Filter handler.Filter
	States []string
	// Quarantine is the open entries (never their message).
	Quarantine []quarantine.Record
	Workers    []workerView
}

// workerView is a row of epitaph.workers; Dead: silent past its lease.
type workerView struct {
	ID        string
	Heartbeat time.Time
	Silent    string
	Dead      bool
}

// handlerView is a handler with its open work: Pending ("at least N"
// when counted up to handler.CursorCountCap), InFlight, Dead and how long
// the oldest pending delivery has waited.
type handlerView struct {
	ID, Name, Table, Kind, Target string
	Pending, OldestPending        string
	InFlight, Dead                int64
	Backlog                       bool
}

// backlogWarnAge is the age of an oldest pending delivery the page flags
// (the EpitaphDeliveryBacklog alert's).
const backlogWarnAge = 30 * time.Minute

// openWork fills v's open work from stats.
func openWork(v handlerView, stats []handler.Stat) handlerView {
	var pending int64
	var atLeast bool
	var oldest float64
	for _, s := range stats {
		if s.HandlerID != v.ID {
			continue
		}
		switch s.State {
		case handler.StatePending:
			pending, atLeast, oldest = s.Count, s.AtLeast, s.OldestSec
		case handler.StateInFlight:
			v.InFlight = s.Count
		case handler.StateDead:
			v.Dead = s.Count
		}
	}
	v.Pending, v.OldestPending = strconv.FormatInt(pending, 10), "-"
	if atLeast {
		v.Pending = "at least " + v.Pending
	}
	if pending > 0 {
		age := time.Duration(oldest * float64(time.Second))
		v.OldestPending, v.Backlog = age.Truncate(time.Second).String(), age > backlogWarnAge
	}
	return v
}

// FailedLimit bounds the deliveries the page lists.
const FailedLimit = 500

func (c *console) failed(r *http.Request, v *view) (string, error) {
	q := r.URL.Query()
	d := &failedData{States: []string{handler.StateDead, handler.StatePending, handler.StateStopped},
		Filter: handler.Filter{HandlerID: q.Get("handler"), State: q.Get("state"), Table: q.Get("table"), Limit: FailedLimit}}
	if d.Filter.State == "" {
		d.Filter.State = handler.StateDead
	}
	v.Title, v.Data = "Failed work", d
	defs, err := handler.List(r.Context(), c.cfg.DB)
	if err != nil {
		return "failed", err
	}
	stats, err := handler.OpenStats(r.Context(), c.cfg.DB)
	if err != nil {
		return "failed", err
	}
	for _, h := range defs {
		d.Handlers = append(d.Handlers, openWork(handlerView{ID: h.ID, Name: h.Name, Table: h.Schema + "." + h.Table, Kind: h.Kind,
			Target: handler.RedactTarget(h.Kind, h.Target)}, stats))
	}
	if d.Filter.HandlerID != "" && !handler.ValidID(d.Filter.HandlerID) {
		return "failed", fail(http.StatusBadRequest, "handler %q: not a handler id", d.Filter.HandlerID)
	}
	f := d.Filter
	// schema.table, as the actions and `deliveries list --table` take it:
	// a bare name would list rows that "all matching" then refuses.
	if s, t, ok := strings.Cut(f.Table, "."); ok {
		f.Schema, f.Table = s, t
	} else if f.Table != "" {
		return "failed", fail(http.StatusBadRequest, "table %q: want schema.table", d.Filter.Table)
	}
	// A cursor handler's pending deliveries are listed from the archive
	// (no row until their batch settles: not selectable).
	if d.Deliveries, err = handler.ListWithCursors(r.Context(), c.cfg.DB, f); err != nil {
		return "failed", err
	}
	// What "all matching" acts on: every queued delivery of the filter (the
	// action's ListDeliveries), up to MaxSelection, not the listed page;
	// counted one further to tell when more match than an action takes.
	af := f
	af.Limit = MaxSelection + 1
	if d.Actionable, err = handler.CountDeliveries(r.Context(), c.cfg.DB, af); err != nil {
		return "failed", err
	}
	if d.Actionable > MaxSelection {
		d.Actionable, d.More = MaxSelection, true
	}
	d.Quarantine, err = quarantine.List(r.Context(), c.cfg.DB, quarantine.Filter{Status: quarantine.StatusOpen, Limit: FailedLimit})
	if err != nil {
		return "failed", err
	}
	rows, err := c.cfg.DB.Query(r.Context(), `SELECT worker_id, heartbeat_at, justify_interval(date_trunc('second', now() - heartbeat_at))::text,
		now() - heartbeat_at > lease_ttl FROM epitaph.workers ORDER BY heartbeat_at DESC, worker_id`)
	if err != nil {
		return "failed", err
	}
	d.Workers, err = pgx.CollectRows(rows, func(r pgx.CollectableRow) (workerView, error) {
		var w workerView
		err := r.Scan(&w.ID, &w.Heartbeat, &w.Silent, &w.Dead)
		return w, err
	})
	return "failed", err
}

func (c *console) holds(r *http.Request, v *view) (string, error) {
	v.Title = "Legal holds"
	hs, err := erasure.ListLegalHolds(r.Context(), c.cfg.DB)
	v.Data = hs
	return "holds", err
}

// tableSearchSQL is searchSQL for a table without a key or correlation id.
// No index orders a table's rows by (commit_lsn, seq, source): searchSQL
// read every row of the table (of the whole archive, when the table holds
// most of it) and sorted them, for every page. Per source, the rows' unique
// key (source, commit_lsn, seq, ...) orders them, so this reads about a
// page per source of it, backwards, and merges: the sources come from
// the same key, one index probe each (a skip scan); the cursor's position
// bounds each source's scan, the exact comparison (its source included)
// filters.
const tableSearchSQL = `WITH RECURSIVE src AS (
    SELECT min(s.source) AS source FROM archive.rows s
  UNION ALL
    SELECT (SELECT min(s.source) FROM archive.rows s WHERE s.source > src.source) FROM src WHERE src.source IS NOT NULL
)
SELECT ` + rowColumns + ` FROM src CROSS JOIN LATERAL (
    SELECT x.source, x.schema_name, x.table_name, x.key, x.row, x.correlation_id, x.is_root, x.commit_lsn,
           x.commit_time, x.seq, x.archived_at, x.expires_at
    FROM archive.rows x
    WHERE x.source = src.source AND x.schema_name = $1 AND x.table_name = $2 AND $3::jsonb IS NULL AND $6::text IS NULL
      AND ($4::timestamptz IS NULL OR x.commit_time >= $4) AND ($5::timestamptz IS NULL OR x.commit_time < $5)
      AND ($7::pg_lsn IS NULL OR ((x.commit_lsn, x.seq) <= ($7::pg_lsn, $8::int)
                                  AND (x.commit_lsn, x.seq, x.source) < ($7::pg_lsn, $8::int, $10::text)))
    ORDER BY x.commit_lsn DESC, x.seq DESC
    LIMIT $9) r
WHERE src.source IS NOT NULL
ORDER BY r.commit_lsn DESC, r.seq DESC, r.source DESC
LIMIT $9`

// searchQuery is the statement of a search: tableSearchSQL for a table
// alone (with or without a time range), searchSQL otherwise (a key or a
// correlation id has its index; a time range alone its own).
func searchQuery(a searchArgs) string {
	if a.schema != nil && a.key == nil && a.corr == nil {
		return tableSearchSQL
	}
	return searchSQL
}
