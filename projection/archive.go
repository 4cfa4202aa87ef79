package projection

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/pgquote"
)

// ReaderSchema is the reader-facing schema: views onto the live version.
const ReaderSchema = "archive"

// ArchiveSchema is the schema of version n of the archive: archive_v<n>.
func ArchiveSchema(n int) string { return fmt.Sprintf("archive_v%d", n) }

func ident(parts ...string) string { return pgx.Identifier(parts).Sanitize() }

// archiveDDL creates the archive table of one version. Idempotent.
//
// is_root is NULL until the transaction's commit event has been applied
// (the transaction is not complete yet), then true for a row that no other
// row of the same transaction is a parent of by the events' foreign keys;
// it stays NULL where that cannot be told: a key-only row whose image lacks
// a column of its foreign key, or whose would-be parents' images lack the
// referenced columns (and no other parent is known).
//
// text_values keeps, only for the columns where storing the row as jsonb
// changes a value, the event's exact text of it (see textValues): with
// columns (the event's column types) it makes the archived row restore to
// the deleted one, equal by row::text, without the stream. NULL for almost
// every row.
//
// verified is false while the row's transaction has not been verified
// against its signed commit (a transaction spanning pages, applied before
// its commit arrives); archive.rows shows only verified rows, so readers
// see whole, authenticated transactions.
func archiveDDL(schema string) string {
	s := ident(schema)
	return `
CREATE SCHEMA IF NOT EXISTS ` + s + `;
CREATE TABLE IF NOT EXISTS ` + s + `.rows (
    source         text        NOT NULL,
    schema_name    text        NOT NULL,
    table_name     text        NOT NULL,
    key            jsonb,
    row            jsonb,
    identity       text,
    correlation_id text        NOT NULL,
    is_root        boolean,
    xid            bigint,
    commit_lsn     pg_lsn      NOT NULL,
    commit_time    timestamptz,
    seq            integer     NOT NULL,
    archived_at    timestamptz NOT NULL DEFAULT now(),
    expires_at     timestamptz,
    refs           jsonb,
    columns        jsonb,
    PRIMARY KEY (source, commit_lsn, seq)
);
CREATE INDEX IF NOT EXISTS rows_table_key_idx ON ` + s + `.rows (schema_name, table_name, key);
CREATE INDEX IF NOT EXISTS rows_correlation_idx ON ` + s + `.rows (correlation_id);
CREATE INDEX IF NOT EXISTS rows_commit_time_idx ON ` + s + `.rows (commit_time);
CREATE INDEX IF NOT EXISTS rows_expires_at_idx ON ` + s + `.rows (expires_at) WHERE expires_at IS NOT NULL;
-- erase --match and hold --match: JSON containment on the row (erase.go).
CREATE INDEX IF NOT EXISTS rows_row_match_idx ON ` + s + `.rows USING gin (row jsonb_path_ops);
DO $$ BEGIN
    -- Not ALTER TABLE .. IF NOT EXISTS: that takes an exclusive lock even
    -- when the column exists, and this runs whenever version states change
    -- (readers of archive.rows deadlocked with it).
    IF NOT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = ` + pgquote.Literal(s+".rows") + `::regclass
                   AND attname = 'verified' AND NOT attisdropped) THEN
        ALTER TABLE ` + s + `.rows ADD COLUMN verified boolean NOT NULL DEFAULT true;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = ` + pgquote.Literal(s+".rows") + `::regclass
                   AND attname = 'text_values' AND NOT attisdropped) THEN
        ALTER TABLE ` + s + `.rows ADD COLUMN text_values jsonb;
    END IF;
END $$;
` + gapsDDL(s)
}

// gapsDDL creates the version's gaps table (DESIGN section 6): what the
// archive is known to miss; and pending_truncates, where a truncate of a
// transaction not verified yet waits for its commit (trust.go). partition is NULL for a gap that concerns every
// partition (a loss upstream, published to each of them, is one row); the
// unique index makes the partitions that apply its copies record it once.
func gapsDDL(s string) string {
	return `
CREATE TABLE IF NOT EXISTS ` + s + `.gaps (id bigserial PRIMARY KEY, kind text NOT NULL
  CHECK (kind IN ('lost_upstream','removed_from_stream','truncate')), schema_name text, table_name text,
  partition int, from_lsn pg_lsn, to_lsn pg_lsn, from_seq bigint, to_seq bigint,
  detected_at timestamptz NOT NULL DEFAULT now(), acknowledged_at timestamptz, ack_reason text);
CREATE UNIQUE INDEX IF NOT EXISTS gaps_source_wide_idx ON ` + s + `.gaps
  (kind, COALESCE(schema_name, ''), COALESCE(table_name, ''), from_lsn, to_lsn) WHERE partition IS NULL;
CREATE TABLE IF NOT EXISTS ` + s + `.pending_truncates (partition int NOT NULL, commit_lsn pg_lsn NOT NULL,
  seq int NOT NULL, schema_name text NOT NULL, table_name text NOT NULL, PRIMARY KEY (partition, commit_lsn, seq));
`
}

// statusView says, for the reader, whether the archive can be trusted
// (statusQuery, readiness.go) for every version of the archive projection.
var statusView = statusViewPrefix + statusQuery(`v.projection = 'archive'`)

const statusViewPrefix = `CREATE OR REPLACE VIEW archive.status AS`

// PointViews re-points the reader views of schema "archive" (archive.rows,
// archive.gaps, and archive.snapshots when that version has a snapshots table) at
// archive_v<version>, inside tx: readers see the old or the new version,
// never a mix and never a missing view. It takes the version lock (held to
// the end of tx, re-entrant), so a worker re-pointing the views from the
// versions it read cannot undo a caller that changed the states itself.
func PointViews(ctx context.Context, tx pgx.Tx, version int) error {
	if err := LockVersions(ctx, tx); err != nil {
		return err
	}
	schema := ArchiveSchema(version)
	if _, err := tx.Exec(ctx, `CREATE SCHEMA IF NOT EXISTS archive`); err != nil {
		return fmt.Errorf("create schema archive: %w", err)
	}
	for _, table := range []string{"rows", "snapshots", "gaps"} {
		var exists bool
		if err := tx.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, ident(schema, table)).Scan(&exists); err != nil {
			return fmt.Errorf("look up %s.%s: %w", schema, table, err)
		}
		if !exists {
			if _, err := tx.Exec(ctx, `DROP VIEW IF EXISTS `+ident(ReaderSchema, table)); err != nil {
				return fmt.Errorf("drop view archive.%s: %w", table, err)
			}
			continue
		}
		comment := fmt.Sprintf("live version: %s. Check archive.status before trusting an empty result.", schema)
		query := `SELECT * FROM ` + ident(schema, table)
		switch table {
		case "rows":
			// trust.go: rows of unverified transactions stay invisible;
			// retention.go: expired rows are hidden at once, also while a
			// hold or an open delivery keeps them. The comment says so, so a
			// view made before is re-pointed once.
			query += ` WHERE verified AND (expires_at IS NULL OR expires_at > now())`
			comment = fmt.Sprintf("live version: %s (verified, unexpired rows only). Check archive.status before trusting an empty result.", schema)
		case "snapshots":
			// A document expires with its root row.
			query = `SELECT s.* FROM ` + ident(schema, table) + ` s WHERE NOT EXISTS (SELECT 1 FROM ` + ident(schema, "rows") +
				` r WHERE r.source = s.source AND r.commit_lsn = s.commit_lsn AND r.seq = s.root_seq AND r.expires_at <= now())`
			comment = fmt.Sprintf("live version: %s (documents of unexpired roots only). Check archive.status before trusting an empty result.", schema)
		}
		current, err := viewCurrent(ctx, tx, ident(ReaderSchema, table), comment, ident(schema, table))
		if err != nil {
			return err
		}
		if current {
			continue
		}
		if err := replaceView(ctx, tx, ident(ReaderSchema, table), query); err != nil {
			return fmt.Errorf("point view archive.%s at %s: %w", table, schema, err)
		}
		if _, err := tx.Exec(ctx, `COMMENT ON VIEW `+ident(ReaderSchema, table)+` IS `+pgquote.Literal(comment)); err != nil {
			return fmt.Errorf("comment view archive.%s: %w", table, err)
		}
	}
	sum := sha256.Sum256([]byte(statusView))
	comment := "Is the archive ready, and complete up to where? (definition " + hex.EncodeToString(sum[:6]) + ")"
	current, err := viewCurrent(ctx, tx, "archive.status", comment, "")
	if err != nil || current {
		return err
	}
	if err := replaceView(ctx, tx, "archive.status", strings.TrimPrefix(statusView, statusViewPrefix)); err != nil {
		return fmt.Errorf("create view archive.status: %w", err)
	}
	if _, err := tx.Exec(ctx, `COMMENT ON VIEW archive.status IS `+pgquote.Literal(comment)); err != nil {
		return fmt.Errorf("comment view archive.status: %w", err)
	}
	return nil
}

// viewCurrent reports whether view exists with the given comment (which
// names what it shows) and, when table is set, the same columns as table:
// then it is left alone. Readers never fail because of the projector: a
// projector starting up must not replace (lock) reader views that already
// show the live version; this looks only at the catalogs.
func viewCurrent(ctx context.Context, tx pgx.Tx, view, comment, table string) (bool, error) {
	var current bool
	err := tx.QueryRow(ctx, `
		SELECT COALESCE(obj_description(to_regclass($1), 'pg_class') = $2, false)
		   AND ($3 = '' OR (SELECT array_agg(attname::text ORDER BY attnum) FROM pg_attribute
		                    WHERE attrelid = to_regclass($1) AND attnum > 0 AND NOT attisdropped)
		                 = (SELECT array_agg(attname::text ORDER BY attnum) FROM pg_attribute
		                    WHERE attrelid = to_regclass($3) AND attnum > 0 AND NOT attisdropped))`,
		view, comment, table).Scan(&current)
	if err != nil {
		return false, fmt.Errorf("look up view %s: %w", view, err)
	}
	return current, nil
}

// replaceView re-points a view in place when the columns allow it (so views
// that depend on it survive), else drops and recreates it.
func replaceView(ctx context.Context, tx pgx.Tx, view, query string) error {
	sp, err := tx.Begin(ctx)
	if err != nil {
		return err
	}
	if _, err := sp.Exec(ctx, `CREATE OR REPLACE VIEW `+view+` AS `+query); err == nil {
		return sp.Commit(ctx)
	}
	if err := sp.Rollback(ctx); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, `DROP VIEW IF EXISTS `+view); err != nil {
		return err
	}
	_, err = tx.Exec(ctx, `CREATE VIEW `+view+` AS `+query)
	return err
}

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
ON CONFLICT (source, commit_lsn, seq) DO NOTHING
RETURNING correlation_id, archived_at, verified
)
SELECT correlation_id, count(*), max(archived_at) FROM ins WHERE verified GROUP BY correlation_id
UNION ALL
SELECT NULL, epitaph.erasure_epoch(), NULL` // fence.go: the erasure counter, read under the erasure lock

func nullableJSON(b json.RawMessage) *string {
	if len(b) == 0 {
		return nil
	}
	s := string(b)
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
// counter the statement read (fence.go).
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
	for i, r := range rows {
		e := r.ev
		sources[i], schemas[i], tables[i], idents[i] = e.Source, e.Schema, e.Table, e.Identity
		corrs[i], lsns[i], xids[i], seqs[i] = e.CorrelationID(), e.CommitLSN.String(), e.XID, int32(e.Seq)
		keys[i], images[i], texts[i] = nullableJSON(e.Key), nullableJSON(r.row), textValues(r.row)
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
	res, err := tx.Query(ctx, fmt.Sprintf(insertRowsSQL, ident(schema)),
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
	if _, err := tx.Exec(ctx, fmt.Sprintf(markRootsSQL, ident(schema)), source, lsns, onlyUndecided); err != nil {
		return fmt.Errorf("mark roots of %d transactions in %s: %w", len(commits), schema, err)
	}
	return nil
}

// Gap is one row of a version's gaps table (archive.gaps for the live
// version): a range the archive is known to miss. Nil fields are unknown or
// not specific (Schema and Table nil: every table; Partition nil: every
// partition).
type Gap struct {
	ID             int64      `json:"id"`
	Kind           string     `json:"kind"`
	Schema         *string    `json:"schema_name"`
	Table          *string    `json:"table_name"`
	Partition      *int       `json:"partition"`
	FromLSN        *event.LSN `json:"from_lsn"`
	ToLSN          *event.LSN `json:"to_lsn"`
	FromSeq        *int64     `json:"from_seq"`
	ToSeq          *int64     `json:"to_seq"`
	DetectedAt     time.Time  `json:"detected_at"`
	AcknowledgedAt *time.Time `json:"acknowledged_at"`
	AckReason      *string    `json:"ack_reason"`
}

// Blocking reports whether the gap keeps the archive from being complete
// (lost_upstream and removed_from_stream do until acknowledged; a truncate
// is informational).
func (g Gap) Blocking() bool {
	return g.Kind != event.GapTruncate && g.AcknowledgedAt == nil
}

const insertGapSQL = `
INSERT INTO %s.gaps (kind, schema_name, table_name, partition, from_lsn, to_lsn, from_seq, to_seq)
VALUES ($1, $2, $3, $4, $5::text::pg_lsn, $6::text::pg_lsn, $7, $8)
ON CONFLICT (kind, COALESCE(schema_name, ''), COALESCE(table_name, ''), from_lsn, to_lsn) WHERE partition IS NULL
DO NOTHING`

// insertGap records g in the gaps table of schema, inside tx (the apply
// transaction that met it, so a gap is recorded exactly when the partition
// moves past it). A gap without a partition (one that concerns every
// partition) is recorded once however many partitions meet a copy of it.
func insertGap(ctx context.Context, tx pgx.Tx, schema string, g Gap) error {
	lsn := func(l *event.LSN) *string {
		if l == nil {
			return nil
		}
		s := l.String()
		return &s
	}
	if _, err := tx.Exec(ctx, fmt.Sprintf(insertGapSQL, ident(schema)),
		g.Kind, g.Schema, g.Table, g.Partition, lsn(g.FromLSN), lsn(g.ToLSN), g.FromSeq, g.ToSeq); err != nil {
		return fmt.Errorf("record %s gap in %s: %w", g.Kind, schema, err)
	}
	return nil
}
