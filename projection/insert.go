package projection

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"
	"unsafe"

	"github.com/jackc/pgx/v5"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/projection/archive"
)

// archiveRow is one delete event ready to insert.
type archiveRow struct {
	item      *item
	ev        *event.Event
	row       json.RawMessage // the row image (from the event or its object)
	expiresAt *time.Time
	isRoot    *bool // known when the whole transaction is in the page
	// pending: the row's transaction is not verified yet (its commit is in
	// a later page); inserted invisible, made visible at the commit.
	pending bool
}

// Event and Image make an archiveRow a row the erasure fences judge.
func (r *archiveRow) Event() *event.Event    { return r.ev }
func (r *archiveRow) Image() json.RawMessage { return r.row }

// insertRowsSQL names no conflict target: the rows table's unique key is
// (source, commit_lsn, seq) in an unpartitioned table (an earlier
// release's) and (source, commit_lsn, seq, commit_time) in a partitioned
// one; an event applied twice conflicts on either (it has one commit_time),
// and the table has no other unique index.
const insertRowsSQL = `
WITH ins AS (
INSERT INTO %s.rows (source, schema_name, table_name, key, row, identity, correlation_id, xid,
                     commit_lsn, commit_time, seq, expires_at, refs, columns, is_root, verified, text_values)
SELECT u.source, u.schema_name, u.table_name, u.key::jsonb, u.row::jsonb, u.identity, u.correlation_id, u.xid,
       u.commit_lsn::pg_lsn, u.commit_time, u.seq, u.expires_at, u.refs::jsonb, u.columns::jsonb, u.is_root, u.verified,
       u.text_values::jsonb
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[], $8::bigint[],
            $9::text[], $10::timestamptz[], $11::int[], $12::timestamptz[], $13::text[], $14::text[], $15::boolean[],
            $16::boolean[], $17::text[])
     AS u(source, schema_name, table_name, key, row, identity, correlation_id, xid,
          commit_lsn, commit_time, seq, expires_at, refs, columns, is_root, verified, text_values)
ON CONFLICT DO NOTHING
RETURNING correlation_id, archived_at, verified
)
SELECT correlation_id, count(*), max(archived_at) FROM ins WHERE verified GROUP BY correlation_id
UNION ALL
SELECT NULL, epitaph.erasure_epoch(), NULL` // erasure fences: the erasure counter, read under the erasure lock

func nullableJSON(b json.RawMessage) *string {
	if len(b) == 0 {
		return nil
	}
	s := string(b)
	return &s
}

// stageRowsAbove is the image size from which a row goes to Postgres on
// its own (stageImages) rather than in the statement's arrays.
const stageRowsAbove = 1 << 20

// insertStagedRowsSQL is insertRowsSQL taking the images of staged rows
// from the session's staging table (their array element is NULL).
var insertStagedRowsSQL = strings.NewReplacer(
	"u.row::jsonb,", "COALESCE(u.row, st.row)::jsonb,",
	"$16::boolean[], $17::text[])\n", "$16::boolean[], $17::text[]) WITH ORDINALITY\n",
	"verified, text_values)\nON CONFLICT", "verified, text_values, ord)\n"+
		"     LEFT JOIN pg_temp.epitaph_staged_rows st ON st.ord = u.ord\nON CONFLICT",
).Replace(insertRowsSQL)

// stageImages sends the large images of rows (at the indexes staged) to a
// temporary table of the session, each as the one parameter of its own
// statement, handed to the connection as it is: the pgx array encoding of
// insertRowsSQL would copy a row twice (its parameter buffer and the
// message), this copies it once (the message), so a row of S bytes costs
// the projector about 2*S. Rows go at commit (and with a rolled-back
// savepoint).
func stageImages(ctx context.Context, tx pgx.Tx, rows []*archiveRow, staged []int) error {
	if _, err := tx.Exec(ctx, `CREATE TEMP TABLE IF NOT EXISTS epitaph_staged_rows (ord bigint PRIMARY KEY, row text NOT NULL) ON COMMIT DELETE ROWS;
DELETE FROM pg_temp.epitaph_staged_rows`); err != nil {
		return fmt.Errorf("stage large row images: %w", err)
	}
	pc := tx.Conn().PgConn()
	for _, i := range staged {
		res := pc.ExecParams(ctx, `INSERT INTO pg_temp.epitaph_staged_rows (ord, row) VALUES ($1::bigint, $2::text)`,
			[][]byte{strconv.AppendInt(nil, int64(i+1), 10), rows[i].row}, nil, nil, nil).Read()
		if res.Err != nil {
			return fmt.Errorf("stage the image of row %d of %s.%s (%d bytes): %w", rows[i].ev.Seq, rows[i].ev.Schema, rows[i].ev.Table, len(rows[i].row), res.Err)
		}
	}
	return nil
}

// imageText is a row image as the statement's text parameter without a
// copy: the string shares the image's bytes, which nothing changes while
// the statement is sent (a large row is one copy fewer).
func imageText(b json.RawMessage) *string {
	if len(b) == 0 {
		return nil
	}
	s := unsafe.String(unsafe.SliceData(b), len(b))
	return &s
}

// insertRows writes rows with one set-based statement and returns the
// distinct correlation ids of the verified rows actually inserted. Idempotent: a row
// already archived (same source, commit_lsn, seq) is left as it is.
func insertRows(ctx context.Context, tx pgx.Tx, schema string, rows []*archiveRow) ([]string, error) {
	inserted, _, err := insertRowsCounted(ctx, tx, schema, rows)
	if err != nil {
		return nil, err
	}
	ids := make([]string, len(inserted))
	for i, t := range inserted {
		ids[i] = t.correlationID
	}
	return ids, nil
}

// insertedTx is what one insert archived of a transaction: how many rows,
// and the archived_at they got (the inserting transaction's now()).
type insertedTx struct {
	correlationID string
	rows          int
	archivedAt    time.Time
}

// insertRowsCounted is insertRows saying, per transaction, how many
// verified rows were actually inserted and with which archived_at (rows
// of transactions not verified yet are not counted), and the erasure
// counter the statement read (erasure.FenceSet).
func insertRowsCounted(ctx context.Context, tx pgx.Tx, schema string, rows []*archiveRow) ([]insertedTx, int64, error) {
	n := len(rows)
	var (
		sources, schemas, tables, idents, corrs, lsns = make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]string, n)
		keys, images, refs, cols                      = make([]*string, n), make([]*string, n), make([]*string, n), make([]*string, n)
		texts                                         = make([]*string, n)
		xids                                          = make([]int64, n)
		times, expires                                = make([]*time.Time, n), make([]*time.Time, n)
		seqs                                          = make([]int32, n)
		roots                                         = make([]*bool, n)
		verified                                      = make([]bool, n)
	)
	var enc schemaEncoder
	var staged []int
	for i, r := range rows {
		e := r.ev
		sources[i], schemas[i], tables[i], idents[i] = e.Source, e.Schema, e.Table, e.Identity
		corrs[i], lsns[i], xids[i], seqs[i] = e.CorrelationID(), e.CommitLSN.String(), e.XID, int32(e.Seq)
		keys[i], texts[i] = nullableJSON(e.Key), textValues(r.row)
		if len(r.row) > stageRowsAbove {
			staged = append(staged, i)
		} else {
			images[i] = imageText(r.row)
		}
		if !e.CommitTime.IsZero() {
			t := e.CommitTime
			times[i] = &t
		}
		expires[i] = r.expiresAt
		roots[i] = r.isRoot
		verified[i] = !r.pending
		var err error
		if refs[i], err = enc.refs(e.Refs); err != nil {
			return nil, 0, err
		}
		if cols[i], err = enc.columns(e.Columns); err != nil {
			return nil, 0, err
		}
	}
	query := insertRowsSQL
	if len(staged) > 0 {
		if err := stageImages(ctx, tx, rows, staged); err != nil {
			return nil, 0, err
		}
		query = insertStagedRowsSQL
	}
	res, err := tx.Query(ctx, fmt.Sprintf(query, archive.Ident(schema)),
		sources, schemas, tables, keys, images, idents, corrs, xids, lsns, times, seqs, expires, refs, cols, roots, verified, texts)
	if err != nil {
		return nil, 0, fmt.Errorf("insert %d archive rows into %s: %w", n, schema, err)
	}
	// The statement returns each transaction once (not a row per row),
	// and one row without a transaction: the erasure counter.
	var epoch int64
	var inserted []insertedTx
	for res.Next() {
		var t insertedTx
		var corr *string
		var at *time.Time
		if err := res.Scan(&corr, &t.rows, &at); err != nil {
			res.Close()
			return nil, 0, fmt.Errorf("insert %d archive rows into %s: %w", n, schema, err)
		}
		if corr == nil {
			epoch = int64(t.rows)
			continue
		}
		t.correlationID, t.archivedAt = *corr, *at
		inserted = append(inserted, t)
	}
	if err := res.Err(); err != nil {
		return nil, 0, fmt.Errorf("insert %d archive rows into %s: %w", n, schema, err)
	}
	return inserted, epoch, nil
}

// schemaEncoder encodes the refs and columns of rows as JSON, reusing the
// previous encoding while consecutive rows carry the same ones (rows of a
// table in a page almost always do): they are the same for every row of a
// table, and encoding them again for each row was a visible share of the
// apply's CPU.
type schemaEncoder struct {
	lastRefs []event.Ref
	refsJSON *string
	lastCols []event.Column
	colsJSON *string
}

// refFields must stay event.Ref field for field (the conversion below does
// not compile otherwise), so that the comparison in refs sees every field.
type refFields struct {
	Columns       []string
	Schema, Table string
	RefColumns    []string
}

var _ = refFields(event.Ref{})

func (c *schemaEncoder) refs(v []event.Ref) (*string, error) {
	if len(v) == 0 {
		return nil, nil
	}
	if c.refsJSON != nil && slices.EqualFunc(v, c.lastRefs, func(a, b event.Ref) bool {
		return a.Schema == b.Schema && a.Table == b.Table && slices.Equal(a.Columns, b.Columns) && slices.Equal(a.RefColumns, b.RefColumns)
	}) {
		return c.refsJSON, nil
	}
	b, err := json.Marshal(v)
	if err != nil {
		return nil, fmt.Errorf("encode refs: %w", err)
	}
	c.lastRefs, c.refsJSON = v, nullableJSON(b)
	return c.refsJSON, nil
}

func (c *schemaEncoder) columns(v []event.Column) (*string, error) {
	if len(v) == 0 {
		return nil, nil
	}
	if c.colsJSON != nil && slices.Equal(v, c.lastCols) {
		return c.colsJSON, nil
	}
	b, err := json.Marshal(v)
	if err != nil {
		return nil, fmt.Errorf("encode columns: %w", err)
	}
	c.lastCols, c.colsJSON = v, nullableJSON(b)
	return c.colsJSON, nil
}

// markRootsSQL sets is_root for every row of the given transactions: a row
// is not a root when another row of the same transaction is its parent by
// one of the foreign keys in its refs (all key columns non-null and equal
// to the parent's referenced columns). It runs when the commit event is
// applied, when every row of the transaction is archived.
//
// It must stay linear in the transaction's size whatever the planner
// believes: the CTEs have no statistics, and the archive's commit_lsn is
// nearly unique, so a 50,000-row transaction is estimated at one row. A
// join of the children with their parents (or of the rows with the
// non-roots) then became a nested loop over two materialized CTEs: 50,000 x
// 43,000 join-filter evaluations, 40-290 s. So children and parents are not
// joined: they are sorted together by their key (a window per key tells a
// child whether a parent with another seq exists), and the decision per row
// is an aggregate over the rows and the non-roots. The only join left is
// the UPDATE's own, by primary key.
const markRootsSQL = `
WITH tx AS MATERIALIZED (
    SELECT commit_lsn, seq, schema_name, table_name, row, refs, is_root
    FROM %[1]s.rows WHERE source = $1 AND commit_lsn = ANY($2::pg_lsn[])
), undecided AS MATERIALIZED (
    SELECT commit_lsn, seq, row, refs FROM tx WHERE NOT $3 OR is_root IS NULL
), child AS MATERIALIZED (
    SELECT t.commit_lsn, t.seq, f->>'schema' AS s, f->>'table' AS tb, f->'ref_columns' AS rc,
           (SELECT jsonb_agg(t.row -> c ORDER BY o)
            FROM jsonb_array_elements_text(f->'columns') WITH ORDINALITY AS x(c, o)) AS k,
           (jsonb_typeof(t.row) <> 'object' OR (SELECT COALESCE(bool_and(t.row ? c), true)
            FROM jsonb_array_elements_text(f->'columns') AS x(c))) AS has
    FROM undecided t
    CROSS JOIN LATERAL jsonb_array_elements(CASE WHEN jsonb_typeof(t.refs) = 'array' THEN t.refs ELSE '[]'::jsonb END) AS f
), wanted AS (
    SELECT DISTINCT commit_lsn, s, tb, rc FROM child
), parent AS (
    SELECT w.commit_lsn, w.s, w.tb, w.rc, t.seq,
           (SELECT jsonb_agg(t.row -> c ORDER BY o)
            FROM jsonb_array_elements_text(w.rc) WITH ORDINALITY AS x(c, o)) AS k,
           (jsonb_typeof(t.row) <> 'object' OR (SELECT COALESCE(bool_and(t.row ? c), true)
            FROM jsonb_array_elements_text(w.rc) AS x(c))) AS has
    FROM wanted w JOIN tx t ON t.commit_lsn = w.commit_lsn AND t.schema_name = w.s AND t.table_name = w.tb
), blind AS MATERIALIZED (
    SELECT DISTINCT commit_lsn, s, tb, rc FROM parent WHERE NOT has
), keyed AS (
    SELECT commit_lsn, s, tb, rc, k, seq AS cseq, NULL::integer AS pseq
    FROM child WHERE has AND k IS NOT NULL AND NOT (k @> '[null]'::jsonb)
    UNION ALL
    SELECT commit_lsn, s, tb, rc, k, NULL::integer, seq FROM parent WHERE k IS NOT NULL
), flagged AS (
    SELECT commit_lsn, cseq, min(pseq) OVER w AS lo, max(pseq) OVER w AS hi
    FROM keyed
    WINDOW w AS (PARTITION BY commit_lsn, s, tb, rc, k)
), decision AS (
    SELECT commit_lsn, seq,
           CASE WHEN bool_or(root IS FALSE) THEN false WHEN bool_or(root IS NULL) THEN NULL ELSE true END AS root
    FROM (SELECT commit_lsn, seq, true AS root FROM undecided
          UNION ALL
          SELECT commit_lsn, cseq, false FROM flagged
          WHERE cseq IS NOT NULL AND lo IS NOT NULL AND (lo <> cseq OR hi <> cseq)
          UNION ALL
          SELECT commit_lsn, seq, NULL::boolean FROM child WHERE NOT has
          UNION ALL
          SELECT c.commit_lsn, c.seq, NULL::boolean FROM child c
          JOIN blind b ON b.commit_lsn = c.commit_lsn AND b.s = c.s AND b.tb = c.tb AND b.rc = c.rc
          WHERE c.has AND c.k IS NOT NULL AND NOT (c.k @> '[null]'::jsonb)) d
    GROUP BY commit_lsn, seq
)
UPDATE %[1]s.rows r SET is_root = d.root
FROM decision d
WHERE r.source = $1 AND r.commit_lsn = ANY($2::pg_lsn[])
  AND r.commit_lsn = d.commit_lsn AND r.seq = d.seq
  AND r.is_root IS DISTINCT FROM d.root`

// markRoots decides is_root for the rows of the given transactions; with
// onlyUndecided it leaves rows already decided on insert alone.
func markRoots(ctx context.Context, tx pgx.Tx, schema, source string, commits []event.LSN, onlyUndecided bool) error {
	if len(commits) == 0 {
		return nil
	}
	lsns := make([]string, len(commits))
	for i, l := range commits {
		lsns[i] = l.String()
	}
	if _, err := tx.Exec(ctx, fmt.Sprintf(markRootsSQL, archive.Ident(schema)), source, lsns, onlyUndecided); err != nil {
		return fmt.Errorf("mark roots of %d transactions in %s: %w", len(commits), schema, err)
	}
	return nil
}
