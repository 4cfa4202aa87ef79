// Package readapi is the projector's HTTP read API for support tools: the
// archived versions of a row, the rows of a source transaction, the
// snapshots of a root.
//
//	GET /v1/rows?table=schema.table&key=JSON       every archived version of the row, newest first
//	GET /v1/rows?table=schema.table&since=&until=  the table's archived rows, newest first
//	GET /v1/transactions/{correlation_id}          the transaction's archived rows, in delete order
//	GET /v1/snapshots?table=schema.table&key=JSON  the root's snapshots, newest first
//
// Without key=, /v1/rows lists the table's rows of the source
// (Config.Source) deleted in [since, until)
// (RFC 3339 times, both optional), and answers 404 naming a table the
// archive holds no row of. Each takes limit= (default 100, at most 1000) and cursor= (next_cursor of
// the previous page), and wait_lsn= (with timeout=, default 30s) to read
// its own deletes: the answer waits until the archive is complete up to
// that source LSN (504 when the timeout passes first, 409 when it cannot
// be: a quarantined event or a gap before it). Answers are JSON objects
// whose items carry the reader views' field names ("rows" or "snapshots",
// and "next_cursor"), with headers Epitaph-View-State (ready,
// catching_up, unavailable, quarantined) and Epitaph-Complete-Up-To (the
// source LSN the archive is complete up to). While the live version is
// not ready the answer is 503 with the reasons, never an empty result
// that looks complete (unless wait_lsn was reached: then the answer is
// complete up to it, and the header says the state). Reads go through
// the reader views, so what retention or erasure hides stays hidden.
package readapi

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/httptoken"
	"github.com/epitaph-dev/epitaph/progress"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/status"
	"github.com/epitaph-dev/epitaph/quarantine"
)

// Headers of every answer.
const (
	HeaderViewState    = "Epitaph-View-State"
	HeaderCompleteUpTo = "Epitaph-Complete-Up-To"
)

// Page sizes.
const (
	DefaultLimit = 100
	MaxLimit     = 1000
)

// Config of the read API.
type Config struct {
	// DB is the target database.
	DB progress.DB
	// Token, when set, is the bearer token every request must carry
	// (Authorization: Bearer <token>; --http-token-file). nil: the API is
	// open, which cmd/projector allows on a loopback address only, to
	// requests for a loopback host only (httptoken.LoopbackHost; 403
	// otherwise: DNS rebinding).
	Token *httptoken.Token
	// Projection is the archive projection's name (default "archive").
	Projection string
	// Source is the source name (archive.rows.source) whose rows a
	// table's listing shows (default "main").
	Source string
	// WaitDB, when set, is what wait_lsn polls (a small pool of the
	// waits' own, status.NewWaitPool) instead of DB; WaitLimit bounds the
	// waits at once (503 with Retry-After past it), shared with GET /wait.
	WaitDB    progress.DB
	WaitLimit *status.WaitLimiter
}

// Register adds the read API's routes to mux.
func Register(mux interface {
	Handle(pattern string, h http.Handler)
}, cfg Config) {
	if cfg.Projection == "" {
		cfg.Projection = archive.Projection
	}
	if cfg.Source == "" {
		cfg.Source = "main"
	}
	a := &api{cfg: cfg}
	mux.Handle("GET /v1/rows", a.endpoint(tableKeyOrRange, a.rows))
	mux.Handle("GET /v1/transactions/{correlation_id}", a.endpoint(nil, a.transaction))
	mux.Handle("GET /v1/snapshots", a.endpoint(tableKey, a.snapshots))
}

type api struct{ cfg Config }

// httpError is an answer other than 200, with its JSON body.
type httpError struct {
	status int
	body   map[string]any
}

func (e *httpError) Error() string { return fmt.Sprint(e.body["error"]) }

func fail(status int, format string, args ...any) *httpError {
	return &httpError{status: status, body: map[string]any{"error": fmt.Sprintf(format, args...)}}
}

// page is one answer: the items under their name, and the next cursor.
type page struct {
	name  string
	items []json.RawMessage
	next  string
}

// endpoint wraps a query with authentication, wait_lsn, the view state
// headers and the refusal to answer while the view is not ready.
func (a *api) endpoint(parse func(*http.Request, *request) error, query queryFunc) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Cache-Control", "no-store")
		if a.cfg.Token == nil && !httptoken.LoopbackHost(r) {
			writeJSON(w, http.StatusForbidden, map[string]any{"error": httptoken.LoopbackOnly})
			return
		}
		if !a.authorized(r) {
			w.Header().Set("WWW-Authenticate", `Bearer realm="epitaph"`)
			writeJSON(w, http.StatusUnauthorized, map[string]any{"error": "a bearer token is required (Authorization: Bearer <the --http-token-file token>)"})
			return
		}
		p, err := a.serve(w, r, parse, query)
		var he *httpError
		switch {
		case err == nil:
			body := map[string]any{p.name: p.items, "next_cursor": nil}
			if p.next != "" {
				body["next_cursor"] = p.next
			}
			writeJSON(w, http.StatusOK, body)
		case errors.As(err, &he):
			writeJSON(w, he.status, he.body)
		default:
			writeJSON(w, http.StatusServiceUnavailable, map[string]any{"error": quarantine.Sanitize(err)})
		}
	})
}

func (a *api) authorized(r *http.Request) bool {
	return a.cfg.Token == nil || a.cfg.Token.Check(r)
}

type queryFunc func(context.Context, *http.Request, *request) (*page, error)

func (a *api) serve(w http.ResponseWriter, r *http.Request, parse func(*http.Request, *request) error, query queryFunc) (*page, error) {
	req, err := parseRequest(w, r)
	if err != nil {
		return nil, err
	}
	if parse != nil {
		if err := parse(r, req); err != nil {
			return nil, err
		}
	}
	ctx := r.Context()
	reached := false
	if req.waitLSN != 0 {
		if err := a.wait(ctx, req); err != nil {
			return nil, err
		}
		reached = true
	}
	state, st, err := status.ViewState(ctx, a.cfg.DB, a.cfg.Projection)
	if err != nil {
		req.setHeaders(status.ViewUnavailable, nil)
		return nil, err
	}
	req.setHeaders(state, st)
	if state != status.ViewReady && !reached {
		he := fail(http.StatusServiceUnavailable, "the archive is %s: an answer now could miss rows (check archive.status, or pass wait_lsn=)", state)
		he.body["view_state"] = state
		if st != nil {
			he.body["reasons"] = st.NotReadyReasons
		}
		return nil, he
	}
	return query(ctx, r, req)
}

// wait answers wait_lsn as GET /wait does: 504 on timeout, 409 when the
// archive cannot be complete up to it.
func (a *api) wait(ctx context.Context, req *request) error {
	release, ok := a.cfg.WaitLimit.TryAcquire()
	if !ok {
		req.w.Header().Set("Retry-After", "1")
		return fail(http.StatusServiceUnavailable, "too many waits at once: retry later")
	}
	defer release()
	db := a.cfg.WaitDB
	if db == nil {
		db = a.cfg.DB
	}
	wctx, cancel := context.WithTimeout(ctx, req.timeout)
	defer cancel()
	st, err := status.WaitComplete(wctx, db, a.cfg.Projection, req.waitLSN, 0)
	if st != nil && st.CompleteUpToLSN != "" {
		req.w.Header().Set(HeaderCompleteUpTo, st.CompleteUpToLSN)
	}
	var ie *status.IncompleteError
	var te *status.TimeoutError
	switch {
	case err == nil:
		return nil
	case errors.As(err, &ie):
		names := make([]string, len(ie.Blockers))
		for i, b := range ie.Blockers {
			names[i] = b.String()
		}
		he := fail(http.StatusConflict, "%s", err.Error())
		he.body["blockers"] = names
		return he
	case errors.As(err, &te):
		return fail(http.StatusGatewayTimeout, "%s", err.Error())
	default:
		return err
	}
}

// request is the parsed common parameters.
type request struct {
	w       http.ResponseWriter
	limit   int
	cursor  map[string]any
	waitLSN event.LSN
	timeout time.Duration
	// table= and key= of /v1/rows and /v1/snapshots.
	schema, table, key string
	// since= and until= of /v1/rows without key= (nil: unbounded).
	since, until *time.Time
}

func parseRequest(w http.ResponseWriter, r *http.Request) (*request, error) {
	q := r.URL.Query()
	req := &request{w: w, limit: DefaultLimit, timeout: 30 * time.Second}
	if s := q.Get("limit"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 || n > MaxLimit {
			return nil, fail(http.StatusBadRequest, "limit: want 1..%d", MaxLimit)
		}
		req.limit = n
	}
	if s := q.Get("cursor"); s != "" {
		b, err := base64.RawURLEncoding.DecodeString(s)
		if err != nil || json.Unmarshal(b, &req.cursor) != nil {
			return nil, fail(http.StatusBadRequest, "cursor: not a next_cursor of this API")
		}
		if err := req.validCursor(); err != nil {
			return nil, err
		}
	}
	if s := q.Get("wait_lsn"); s != "" {
		lsn, err := event.ParseLSN(s)
		if err != nil || lsn == 0 {
			return nil, fail(http.StatusBadRequest, "wait_lsn: want a source LSN such as 0/16B3748")
		}
		req.waitLSN = lsn
	}
	if s := q.Get("timeout"); s != "" {
		d, err := time.ParseDuration(s)
		if err != nil || d <= 0 {
			return nil, fail(http.StatusBadRequest, "timeout: want a positive duration such as 10s")
		}
		req.timeout = min(d, status.MaxWaitTimeout)
	}
	return req, nil
}

func (req *request) setHeaders(state string, st *status.Readiness) {
	req.w.Header().Set(HeaderViewState, state)
	if st != nil && st.CompleteUpToLSN != "" {
		req.w.Header().Set(HeaderCompleteUpTo, st.CompleteUpToLSN)
	}
}

// tableKey parses table=schema.table and key=JSON object.
func tableKey(r *http.Request, req *request) error {
	q := r.URL.Query()
	schema, table, ok := strings.Cut(q.Get("table"), ".")
	if !ok || schema == "" || table == "" || strings.Contains(table, ".") {
		return fail(http.StatusBadRequest, "table: want schema.table")
	}
	var obj map[string]any
	if json.Unmarshal([]byte(q.Get("key")), &obj) != nil || obj == nil {
		return fail(http.StatusBadRequest, `key: want a JSON object such as {"id":42}`)
	}
	req.schema, req.table, req.key = schema, table, q.Get("key")
	return nil
}

// tableKeyOrRange parses /v1/rows: table= with key=, or table= with the
// optional time range since= and until=.
func tableKeyOrRange(r *http.Request, req *request) error {
	q := r.URL.Query()
	if q.Has("key") {
		if q.Has("since") || q.Has("until") {
			return fail(http.StatusBadRequest, "since=/until=: list a table without key=, or read one row's versions with key=")
		}
		return tableKey(r, req)
	}
	schema, table, ok := strings.Cut(q.Get("table"), ".")
	if !ok || schema == "" || table == "" || strings.Contains(table, ".") {
		return fail(http.StatusBadRequest, "table: want schema.table")
	}
	req.schema, req.table = schema, table
	for name, dst := range map[string]**time.Time{"since": &req.since, "until": &req.until} {
		if s := q.Get(name); s != "" {
			at, err := time.Parse(time.RFC3339Nano, s)
			if err != nil {
				return fail(http.StatusBadRequest, "%s: want an RFC 3339 time such as 2026-11-24T09:00:00Z", name)
			}
			*dst = &at
		}
	}
	if req.since != nil && req.until != nil && !req.since.Before(*req.until) {
		return fail(http.StatusBadRequest, "since= must be before until=")
	}
	return nil
}

// encodeCursor makes the opaque cursor of the last item.
func encodeCursor(v map[string]any) string {
	b, _ := json.Marshal(v)
	return base64.RawURLEncoding.EncodeToString(b)
}

// collect reads (item, cursor fields...) rows: limit+1 were asked for, so
// a last extra row says there is a next page.
func collect(rows pgx.Rows, name string, limit int, cursorOf func(vals []any) map[string]any) (*page, error) {
	p := &page{name: name, items: []json.RawMessage{}}
	var last []any
	for rows.Next() {
		vals, err := rows.Values()
		if err != nil {
			rows.Close()
			return nil, err
		}
		if len(p.items) == limit {
			p.next = encodeCursor(cursorOf(last))
			break
		}
		item, ok := vals[0].(string) // to_jsonb(..)::text: numbers stay exact
		if !ok {
			rows.Close()
			return nil, fmt.Errorf("read %s: item is %T, not JSON text", name, vals[0])
		}
		p.items = append(p.items, json.RawMessage(item))
		last = vals
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, err
	}
	return p, nil
}

func writeJSON(w http.ResponseWriter, status int, body any) {
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(body)
}

func undefinedTable(err error) bool {
	var pg *pgconn.PgError
	return errors.As(err, &pg) && pg.Code == "42P01"
}
