package archive

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"
	"unsafe"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/epitaph-dev/epitaph/event"
)

// Row is one delete event to archive.
type Row struct {
	Event     *event.Event
	Image     json.RawMessage // the row image (from the event or its object)
	ExpiresAt *time.Time
	IsRoot    *bool // known when the whole transaction is in hand; else decided at its commit
	// Verified: the row's transaction is verified. A row of one that is
	// not yet (its commit is in a later page) is inserted invisible and
	// made visible at the commit.
	Verified bool
}

// insertRowsSQL takes each row's refs and columns as an index into $18
// and $19, the distinct ones of the statement (NULL for none): they are
// the same for every row of a table, and Postgres parsing the same JSON
// once per row was a visible share of the apply's CPU.
//
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
       u.commit_lsn::pg_lsn, u.commit_time, u.seq, u.expires_at, ($18::jsonb[])[u.refs], ($19::jsonb[])[u.columns], u.is_root, u.verified,
       u.text_values::jsonb
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[], $8::bigint[],
            $9::text[], $10::timestamptz[], $11::int[], $12::timestamptz[], $13::int[], $14::int[], $15::boolean[],
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

// StageRowsAbove is the image size from which a row goes to Postgres on
// its own (stageImages) rather than in the statement's arrays.
const StageRowsAbove = 1 << 20

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
func stageImages(ctx context.Context, tx pgx.Tx, rows []Row, staged []int) error {
	if _, err := tx.Exec(ctx, `CREATE TEMP TABLE IF NOT EXISTS epitaph_staged_rows (ord bigint PRIMARY KEY, row text NOT NULL) ON COMMIT DELETE ROWS;
DELETE FROM pg_temp.epitaph_staged_rows`); err != nil {
		return fmt.Errorf("stage large row images: %w", err)
	}
	pc := tx.Conn().PgConn()
	for _, i := range staged {
		res := pc.ExecParams(ctx, `INSERT INTO pg_temp.epitaph_staged_rows (ord, row) VALUES ($1::bigint, $2::text)`,
			[][]byte{strconv.AppendInt(nil, int64(i+1), 10), rows[i].Image}, nil, nil, nil).Read()
		if res.Err != nil {
			return fmt.Errorf("stage the image of row %d of %s.%s (%d bytes): %w", rows[i].Event.Seq, rows[i].Event.Schema, rows[i].Event.Table, len(rows[i].Image), res.Err)
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

// Inserted is what one InsertRows archived of one source transaction.
type Inserted struct {
	CorrelationID string
	Rows          int       // the verified rows actually inserted
	ArchivedAt    time.Time // the inserting transaction's now()
}

// InsertRows writes rows into the rows table of schema with one set-based
// statement. Idempotent: a row already archived (same source, commit_lsn,
// seq) is left as it is. It returns, per source transaction, how many
// verified rows were actually inserted and with which archived_at (rows
// of transactions not verified yet are not counted), and the erasure
// counter the statement read (package projection/erasure's fences).
func InsertRows(ctx context.Context, tx pgx.Tx, schema string, rows []Row) ([]Inserted, int64, error) {
	n := len(rows)
	var (
		sources, schemas, tables, idents, corrs, lsns = make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]string, n)
		keys, images                                  = make([]*string, n), make([]*string, n)
		refs, cols                                    = make([]*int32, n), make([]*int32, n)
		texts                                         = make([]*string, n)
		xids                                          = make([]int64, n)
		times, expires                                = make([]*time.Time, n), make([]*time.Time, n)
		seqs                                          = make([]int32, n)
		roots                                         = make([]*bool, n)
		verified                                      = make([]bool, n)
	)
	var enc schemaEncoder
	var refsSet, colsSet jsonSet
	var staged []int
	for i, r := range rows {
		e := r.Event
		sources[i], schemas[i], tables[i], idents[i] = e.Source, e.Schema, e.Table, e.Identity
		corrs[i], lsns[i], xids[i], seqs[i] = e.CorrelationID(), e.CommitLSN.String(), e.XID, int32(e.Seq)
		keys[i], texts[i] = nullableJSON(e.Key), textValues(r.Image)
		if len(r.Image) > StageRowsAbove {
			staged = append(staged, i)
		} else {
			images[i] = imageText(r.Image)
		}
		if !e.CommitTime.IsZero() {
			t := e.CommitTime
			times[i] = &t
		}
		expires[i] = r.ExpiresAt
		roots[i] = r.IsRoot
		verified[i] = r.Verified
		rj, err := enc.refs(e.Refs)
		if err != nil {
			return nil, 0, err
		}
		cj, err := enc.columns(e.Columns)
		if err != nil {
			return nil, 0, err
		}
		refs[i], cols[i] = refsSet.index(rj), colsSet.index(cj)
	}
	query := insertRowsSQL
	if len(staged) > 0 {
		if err := stageImages(ctx, tx, rows, staged); err != nil {
			return nil, 0, err
		}
		query = insertStagedRowsSQL
	}
	query = fmt.Sprintf(query, Ident(schema))
	args := []any{sources, schemas, tables, keys, images, idents, corrs, xids, lsns, times, seqs, expires, refs, cols, roots, verified, texts,
		refsSet.values, colsSet.values}
	// Plainly first, in a savepoint: almost every page is new rows, and
	// ON CONFLICT's speculative insertion (a probe of the unique key before
	// each row, a lock and a second WAL record for each) cost a tenth or
	// more of Postgres's CPU per row. A page holding a row already archived
	// fails with a unique violation and goes again with ON CONFLICT DO
	// NOTHING, so the result is the same.
	sp, err := tx.Begin(ctx)
	if err != nil {
		return nil, 0, fmt.Errorf("insert %d archive rows into %s: savepoint: %w", n, schema, err)
	}
	inserted, epoch, err := runInsert(ctx, sp, strings.Replace(query, onConflict, "", 1), args)
	if err == nil {
		if err := sp.Commit(ctx); err != nil {
			return nil, 0, fmt.Errorf("insert %d archive rows into %s: release savepoint: %w", n, schema, err)
		}
		return inserted, epoch, nil
	}
	if rbErr := sp.Rollback(ctx); rbErr != nil || !uniqueViolation(err) {
		return nil, 0, fmt.Errorf("insert %d archive rows into %s: %w", n, schema, err)
	}
	if inserted, epoch, err = runInsert(ctx, tx, query, args); err != nil {
		return nil, 0, fmt.Errorf("insert %d archive rows into %s: %w", n, schema, err)
	}
	return inserted, epoch, nil
}

// onConflict is the clause insertRowsSQL and insertStagedRowsSQL have once.
const onConflict = "ON CONFLICT DO NOTHING\n"

func uniqueViolation(err error) bool {
	var pg *pgconn.PgError
	return errors.As(err, &pg) && pg.Code == "23505"
}

// runInsert runs one of the insert statements and reads what it returns:
// each transaction once (not a row per row), and one row without a
// transaction: the erasure counter.
func runInsert(ctx context.Context, tx pgx.Tx, query string, args []any) ([]Inserted, int64, error) {
	res, err := tx.Query(ctx, query, args...)
	if err != nil {
		return nil, 0, err
	}
	defer res.Close()
	var epoch int64
	var inserted []Inserted
	for res.Next() {
		var t Inserted
		var corr *string
		var at *time.Time
		if err := res.Scan(&corr, &t.Rows, &at); err != nil {
			return nil, 0, err
		}
		if corr == nil {
			epoch = int64(t.Rows)
			continue
		}
		t.CorrelationID, t.ArchivedAt = *corr, *at
		inserted = append(inserted, t)
	}
	if err := res.Err(); err != nil {
		return nil, 0, err
	}
	return inserted, epoch, nil
}

// jsonSet numbers the distinct JSON texts of a statement from 1 (Postgres
// array subscripts), for a statement that takes them once and each row's
// as its number.
type jsonSet struct {
	values []string
	seen   map[string]int32
	last   *string // the text of the previous index call, and its number
	lastN  int32
}

// index is the number of s in the set, adding it if new; nil for nil.
func (j *jsonSet) index(s *string) *int32 {
	if s == nil {
		return nil
	}
	if s != j.last {
		n, ok := j.seen[*s]
		if !ok {
			if j.seen == nil {
				j.seen = map[string]int32{}
			}
			j.values = append(j.values, *s)
			n = int32(len(j.values))
			j.seen[*s] = n
		}
		j.last, j.lastN = s, n
	}
	n := j.lastN
	return &n
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
