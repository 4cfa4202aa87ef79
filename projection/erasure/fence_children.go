package erasure

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/snapshot"
)

// A fence with children holds for the whole source transaction, whatever
// its pages: apply keeps every row it leaves out as erased with its
// children in epitaph.erased_parents (the digests of its columns, no
// value), so a child in a later page (or a rebuild's) is found by its
// foreign key's digests; and it erases from the version the rows of the
// transaction that earlier pages archived and that reference it (children
// before their parent), recording those by identity (epitaph.erased_rows)
// and as parents in turn. Those rows were not visible yet: a transaction's
// rows are shown at its commit.

// childRefSQL holds when row c references row p by one of c's foreign keys
// (the events' refs: columns of c equal to ref_columns of p, in order).
const childRefSQL = `jsonb_typeof(c.refs) = 'array' AND EXISTS (
            SELECT 1 FROM jsonb_array_elements(c.refs) f
            WHERE f->>'schema' = p.schema_name AND f->>'table' = p.table_name
              AND (SELECT jsonb_agg(c.row -> x ORDER BY o) FROM jsonb_array_elements_text(f->'columns') WITH ORDINALITY AS a(x, o))
                = (SELECT jsonb_agg(p.row -> y ORDER BY o) FROM jsonb_array_elements_text(f->'ref_columns') WITH ORDINALITY AS b(y, o)))`

// eraseChildrenSQL deletes from one version the rows referencing the given
// rows (same transaction), transitively, and returns them.
const eraseChildrenSQL = `
WITH RECURSIVE p AS (
    SELECT u.source, u.commit_lsn::pg_lsn AS commit_lsn, u.seq, u.schema_name, u.table_name, u.row::jsonb AS row, u.erasure
    FROM unnest($1::text[], $2::text[], $3::int[], $4::text[], $5::text[], $6::text[], $7::bigint[])
         AS u(source, commit_lsn, seq, schema_name, table_name, row, erasure)
  UNION
    SELECT c.source, c.commit_lsn, c.seq, c.schema_name, c.table_name, c.row, p.erasure
    FROM p, LATERAL (
        SELECT c.* FROM %[1]s c
        WHERE c.source = p.source AND c.commit_lsn = p.commit_lsn AND ` + childRefSQL + `
        OFFSET 0) c
)
DELETE FROM %[1]s r USING p
WHERE r.source = p.source AND r.commit_lsn = p.commit_lsn AND r.seq = p.seq
RETURNING r.source, r.commit_lsn::text, r.seq, r.schema_name, r.table_name, r.row, p.erasure, r.correlation_id`

// parentRow is a row erased with its children, to be recorded.
type parentRow struct {
	id      rowIdentity
	table   string // schema.table
	row     json.RawMessage
	erasure int64
	corr    string // set by eraseChildren only
}

// Record keeps parents (rows a page left out as erased with their
// children) and erases the rows of their transactions that earlier pages
// archived into schema and that reference them (with snapshots, taken out
// of their transactions' snapshot counts: snapshot.Discount). It returns
// how many rows it erased from the version.
func (f *FenceSet) Record(ctx context.Context, tx pgx.Tx, schema string, snapshots bool, parents []ErasedWith) (int, error) {
	rows := make([]parentRow, 0, len(parents))
	for _, p := range parents {
		e := p.r.Event()
		row := json.RawMessage(p.r.Image())
		if decodeObject(row) == nil {
			row = e.Key
		}
		rows = append(rows, parentRow{id: rowIdentity{e.Source, e.CommitLSN, e.Seq}, table: e.QualifiedTable(), row: row, erasure: p.id})
	}
	f.mu.Lock()
	key := f.key
	f.mu.Unlock()
	if err := insertErasedParents(ctx, tx, key, rows); err != nil {
		return 0, err
	}
	f.remember(key, rows)
	children, err := eraseChildren(ctx, tx, archive.Ident(schema, "rows"), rows)
	if err != nil || len(children) == 0 {
		return 0, err
	}
	if err := insertErasedParents(ctx, tx, key, children); err != nil {
		return 0, err
	}
	ids := make([]rowIdentity, len(children))
	for i, c := range children {
		ids[i] = c.id
	}
	sources, lsns, seqs := identityArrays(ids)
	erasures := make([]int64, len(children))
	for i, c := range children {
		erasures[i] = c.erasure
	}
	if _, err := tx.Exec(ctx, `INSERT INTO epitaph.erased_rows (source, commit_lsn, seq, erasure_id)
		SELECT * FROM unnest($1::text[], $2::pg_lsn[], $3::int[], $4::bigint[]) ON CONFLICT DO NOTHING`, sources, lsns, seqs, erasures); err != nil {
		return 0, fmt.Errorf("record erased rows: %w", err)
	}
	refs := make([]erasedRef, len(children))
	for i, c := range children {
		refs[i] = erasedRef{id: c.id, table: c.table, corr: c.corr}
	}
	if err := stopCursorDeliveries(ctx, tx, refs); err != nil {
		return 0, err
	}
	if err := eraseDeliveries(ctx, tx, ids, map[string]int{}); err != nil {
		return 0, err
	}
	if snapshots {
		gone := make([]snapshot.FencedRow, len(children))
		for i, c := range children {
			gone[i] = snapshot.FencedRow{CorrelationID: c.corr, Source: c.id.source, CommitLSN: c.id.lsn, Seq: c.id.seq, Table: c.table}
		}
		if _, err := snapshot.Discount(ctx, tx, schema, gone); err != nil {
			return 0, err
		}
	}
	f.remember(key, children)
	f.mu.Lock()
	for _, id := range ids {
		f.rows[id] = true
	}
	f.mu.Unlock()
	return len(children), nil
}

// remember adds rows to the cached erased parents.
func (f *FenceSet) remember(key []byte, rows []parentRow) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.parents == nil {
		f.parents = map[txKey][]erasedParent{}
	}
	if f.rows == nil {
		f.rows = map[rowIdentity]bool{}
	}
	for _, r := range rows {
		k := txKey{r.id.source, r.id.lsn}
		if slices.ContainsFunc(f.parents[k], func(p erasedParent) bool { return p.seq == r.id.seq }) {
			continue // a page applied again (a retry): known already
		}
		cols := map[string]string{}
		for c, v := range decodeObject(r.row) {
			if d, ok := columnDigest(key, r.table, c, v); ok {
				cols[c] = d
			}
		}
		f.parents[k] = append(f.parents[k], erasedParent{table: r.table, seq: r.id.seq, erasure: r.erasure, cols: cols})
	}
}

// insertErasedParents writes the column digests of rows to
// epitaph.erased_parents.
func insertErasedParents(ctx context.Context, tx pgx.Tx, key []byte, rows []parentRow) error {
	var sources, lsns, schemas, tables, cols, digests []string
	var seqs []int32
	var erasures []int64
	for _, r := range rows {
		schema, table, _ := strings.Cut(r.table, ".")
		for c, v := range decodeObject(r.row) {
			d, ok := columnDigest(key, r.table, c, v)
			if !ok {
				continue
			}
			sources, lsns, seqs = append(sources, r.id.source), append(lsns, r.id.lsn.String()), append(seqs, int32(r.id.seq))
			schemas, tables, cols, digests = append(schemas, schema), append(tables, table), append(cols, c), append(digests, d)
			erasures = append(erasures, r.erasure)
		}
	}
	if len(sources) == 0 {
		return nil
	}
	_, err := tx.Exec(ctx, `INSERT INTO epitaph.erased_parents (source, commit_lsn, seq, schema_name, table_name, column_name, digest, erasure_id)
		SELECT * FROM unnest($1::text[], $2::pg_lsn[], $3::int[], $4::text[], $5::text[], $6::text[], $7::text[], $8::bigint[])
		ON CONFLICT DO NOTHING`, sources, lsns, seqs, schemas, tables, cols, digests, erasures)
	if err != nil {
		return fmt.Errorf("record erased parents: %w", err)
	}
	return nil
}

// eraseChildren deletes from the rows table the rows referencing parents
// (transitively, same transaction) and returns them.
func eraseChildren(ctx context.Context, tx pgx.Tx, table string, parents []parentRow) ([]parentRow, error) {
	var sources, lsns, schemas, tables, rowsJSON []string
	var seqs []int32
	var erasures []int64
	for _, p := range parents {
		schema, name, _ := strings.Cut(p.table, ".")
		sources, lsns, seqs = append(sources, p.id.source), append(lsns, p.id.lsn.String()), append(seqs, int32(p.id.seq))
		schemas, tables, rowsJSON, erasures = append(schemas, schema), append(tables, name), append(rowsJSON, string(p.row)), append(erasures, p.erasure)
	}
	rows, err := tx.Query(ctx, fmt.Sprintf(eraseChildrenSQL, table), sources, lsns, seqs, schemas, tables, rowsJSON, erasures)
	if err != nil {
		return nil, fmt.Errorf("erase children archived by earlier pages: %w", err)
	}
	var out []parentRow
	var c parentRow
	var lsn, schema, name string
	_, err = pgx.ForEachRow(rows, []any{&c.id.source, &lsn, &c.id.seq, &schema, &name, &c.row, &c.erasure, &c.corr}, func() error {
		l, err := event.ParseLSN(lsn)
		if err != nil {
			return err
		}
		c.id.lsn, c.table = l, schema+"."+name
		out = append(out, c)
		c.row = nil
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("erase children archived by earlier pages: %w", err)
	}
	return out, nil
}
