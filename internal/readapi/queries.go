package readapi

import (
	"context"
	"math"
	"net/http"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/epitaph-dev/epitaph/event"
)

// The lookups, each behind an index of the version tables (the tests
// EXPLAIN them): rows_table_key_idx, rows_correlation_idx,
// snapshots_root_idx. Items are to_jsonb of the view's row, so they carry
// the view's field names.
const (
	rowsSQL = `
SELECT to_jsonb(r)::text, r.commit_lsn::text, r.seq, r.source FROM archive.rows r
WHERE r.schema_name = $1 AND r.table_name = $2 AND r.key = $3::jsonb
  AND ($4::pg_lsn IS NULL OR (r.commit_lsn, r.seq, r.source) < ($4::pg_lsn, $5::int, COALESCE($7::text, '')))
ORDER BY r.commit_lsn DESC, r.seq DESC, r.source DESC
LIMIT $6`
	// tableRowsSQL lists a table's rows deleted in [since, until). No
	// index of (schema_name, table_name) orders them; with the source
	// fixed, the rows' unique key (source, commit_lsn, seq, ...) does, so
	// a page of a table with many rows reads about a page of that index
	// instead of sorting all of the table's rows (for a table with few,
	// the planner still takes rows_table_key_idx and sorts).
	tableRowsSQL = `
SELECT to_jsonb(r)::text, r.commit_lsn::text, r.seq FROM archive.rows r
WHERE r.source = $1 AND r.schema_name = $2 AND r.table_name = $3
  AND ($4::timestamptz IS NULL OR r.commit_time >= $4) AND ($5::timestamptz IS NULL OR r.commit_time < $5)
  AND ($6::pg_lsn IS NULL OR (r.commit_lsn, r.seq) < ($6::pg_lsn, $7::int))
ORDER BY r.commit_lsn DESC, r.seq DESC
LIMIT $8`
	// tableSeenSQL: whether the archive holds any row of the table (what
	// retention or erasure removed does not count).
	tableSeenSQL   = `SELECT EXISTS (SELECT 1 FROM archive.rows WHERE schema_name = $1 AND table_name = $2)`
	transactionSQL = `
SELECT to_jsonb(r)::text, r.seq FROM archive.rows r
WHERE r.correlation_id = $1 AND r.seq > $2
ORDER BY r.seq
LIMIT $3`
	// transactionKeySQL is transactionSQL for a correlation id that names
	// its source and commit LSN (all of them do): by rows_correlation_idx a
	// page read every row of the transaction and sorted them, for every
	// page (a bulk delete of a million rows read a million rows per page);
	// with (source, commit_lsn) fixed the rows' unique key
	// (source, commit_lsn, seq, ...) reads them in seq order from the
	// cursor on, about a page.
	transactionKeySQL = `
SELECT to_jsonb(r)::text, r.seq FROM archive.rows r
WHERE r.source = $4 AND r.commit_lsn = $5::pg_lsn AND r.correlation_id = $1 AND r.seq > $2
ORDER BY r.seq
LIMIT $3`
	// snapshotsSQL pages a root's documents by their transaction
	// (commit_lsn, source: a root has one document per transaction), which
	// every version shares: a version's row ids are its own (a rebuilt one
	// numbers its documents in the order it made them), so a cursor by id
	// read after a promotion or rollback repeated or skipped documents.
	snapshotsSQL = `
SELECT to_jsonb(s)::text, s.commit_lsn::text, s.source FROM archive.snapshots s
WHERE s.root_table = $1 AND s.root_key = $2::jsonb
  AND ($3::pg_lsn IS NULL OR (s.commit_lsn, s.source) < ($3::pg_lsn, COALESCE($5::text, '')))
ORDER BY s.commit_lsn DESC, s.source DESC
LIMIT $4`
)

// cursorString and cursorInt read a cursor field (nil when absent).
func (req *request) cursorString(name string) *string {
	if s, ok := req.cursor[name].(string); ok {
		return &s
	}
	return nil
}

func (req *request) cursorInt(name string) *int64 {
	if f, ok := req.cursor[name].(float64); ok {
		n := int64(f)
		return &n
	}
	return nil
}

// validCursor refuses a cursor whose fields the queries cannot take: an
// LSN pg_lsn does not read, a seq beyond int4, an id beyond 2^53.
func (req *request) validCursor() error {
	bad := fail(http.StatusBadRequest, "cursor: not a next_cursor of this API")
	if s := req.cursorString("commit_lsn"); s != nil {
		lsn, err := event.ParseLSN(*s)
		if err != nil {
			return bad
		}
		req.cursor["commit_lsn"] = lsn.String()
	}
	if v, ok := req.cursor["seq"]; ok {
		f, isNum := v.(float64)
		if !isNum || f != math.Trunc(f) || f < -1 || f > math.MaxInt32 {
			return bad
		}
	}
	if v, ok := req.cursor["id"]; ok {
		f, isNum := v.(float64)
		if !isNum || f != math.Trunc(f) || f < 0 || f > 1<<53 {
			return bad
		}
	}
	return nil
}

func (a *api) rows(ctx context.Context, _ *http.Request, req *request) (*page, error) {
	lsn := req.cursorString("commit_lsn")
	cursorOf := func(v []any) map[string]any { return map[string]any{"commit_lsn": v[1], "seq": v[2]} }
	var res pgx.Rows
	var err error
	if req.key != "" {
		cursorOf = func(v []any) map[string]any { return map[string]any{"commit_lsn": v[1], "seq": v[2], "source": v[3]} }
		res, err = a.cfg.DB.Query(ctx, rowsSQL, req.schema, req.table, req.key, lsn, req.cursorInt("seq"), req.limit+1, req.cursorString("source"))
	} else {
		res, err = a.cfg.DB.Query(ctx, tableRowsSQL, a.cfg.Source, req.schema, req.table, req.since, req.until, lsn, req.cursorInt("seq"), req.limit+1)
	}
	if err != nil {
		return nil, err
	}
	p, err := collect(res, "rows", req.limit, cursorOf)
	if err != nil || len(p.items) > 0 || lsn != nil {
		return p, err
	}
	// An empty first page: say so when the table itself is unknown (a
	// typo in table= must not look like "nothing was deleted").
	var seen bool
	if err := a.cfg.DB.QueryRow(ctx, tableSeenSQL, req.schema, req.table).Scan(&seen); err != nil {
		return nil, err
	}
	if !seen {
		return nil, fail(http.StatusNotFound, "table %s.%s: the archive holds no row of it (never seen, or all expired or erased)", req.schema, req.table)
	}
	return p, nil
}

func (a *api) transaction(ctx context.Context, r *http.Request, req *request) (*page, error) {
	corr := r.PathValue("correlation_id")
	after := int64(-1)
	if n := req.cursorInt("seq"); n != nil {
		after = *n
	}
	sql, args := transactionQuery(corr, after, req.limit+1)
	res, err := a.cfg.DB.Query(ctx, sql, args...)
	if err != nil {
		return nil, err
	}
	p, err := collect(res, "rows", req.limit, func(v []any) map[string]any { return map[string]any{"seq": v[1]} })
	if err != nil {
		return nil, err
	}
	if len(p.items) == 0 && after < 0 {
		return nil, fail(http.StatusNotFound, "no archived rows of transaction %s (not archived, expired or erased)", corr)
	}
	return p, nil
}

func (a *api) snapshots(ctx context.Context, _ *http.Request, req *request) (*page, error) {
	res, err := a.cfg.DB.Query(ctx, snapshotsSQL, req.schema+"."+req.table, req.key, req.cursorString("commit_lsn"), req.limit+1,
		req.cursorString("source"))
	var p *page
	if err == nil {
		p, err = collect(res, "snapshots", req.limit, func(v []any) map[string]any { return map[string]any{"commit_lsn": v[1], "source": v[2]} })
	}
	if undefinedTable(err) {
		return nil, fail(http.StatusNotFound, "no snapshots: the projector keeps none (--snapshot-roots)")
	}
	return p, err
}

// transactionQuery is the statement of a page of transaction corr: its
// rows after seq after, at most limit.
func transactionQuery(corr string, after int64, limit int) (string, []any) {
	// "<source>:<xid>:<commit_lsn>" (event.CorrelationID), read from the
	// right: the LSN and the xid hold no colon.
	l, rest, ok := strings.Cut(reverse(corr), ":")
	_, src, ok2 := strings.Cut(rest, ":")
	if lsn, err := event.ParseLSN(reverse(l)); ok && ok2 && err == nil && src != "" {
		return transactionKeySQL, []any{corr, after, limit, reverse(src), lsn.String()}
	}
	return transactionSQL, []any{corr, after, limit}
}

func reverse(s string) string {
	b := []byte(s)
	slices.Reverse(b)
	return string(b)
}
