package projection

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

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

// insertRows is insertRowsCounted returning only the distinct correlation
// ids of the verified rows actually inserted.
func insertRows(ctx context.Context, tx pgx.Tx, schema string, rows []*archiveRow) ([]string, error) {
	inserted, _, err := insertRowsCounted(ctx, tx, schema, rows)
	if err != nil {
		return nil, err
	}
	ids := make([]string, len(inserted))
	for i, t := range inserted {
		ids[i] = t.CorrelationID
	}
	return ids, nil
}

// insertRowsCounted archives rows with archive.InsertRows.
func insertRowsCounted(ctx context.Context, tx pgx.Tx, schema string, rows []*archiveRow) ([]archive.Inserted, int64, error) {
	in := make([]archive.Row, len(rows))
	for i, r := range rows {
		in[i] = archive.Row{Event: r.ev, Image: r.row, ExpiresAt: r.expiresAt, IsRoot: r.isRoot, Verified: !r.pending}
	}
	return archive.InsertRows(ctx, tx, schema, in)
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
