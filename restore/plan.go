package restore

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/rowsql"
)

// table is one table of a restore as the source's catalog has it now.
type table struct {
	name      string // schema.table
	ident     string // quoted
	generated map[string]bool
	current   []string // its columns now, in order
	rows      []*archived
}

// fk is a foreign key between two tables of the restore.
type fk struct {
	name          string // quoted, schema-qualified
	child, parent string
	deferrable    bool
}

// planned is the order of a restore: tables parents first, rows in that
// order (delete order inside a cycle).
type planned struct {
	tables   []TablePlan
	deferred []string
	byName   map[string]*table
	rows     []*archived
}

func plan(ctx context.Context, tx pgx.Tx, rows []*archived) (*planned, error) {
	p := &planned{byName: map[string]*table{}}
	var names []string
	for _, a := range rows {
		t := p.byName[a.qualified()]
		if t == nil {
			t = &table{name: a.qualified(), ident: pgx.Identifier{a.schema, a.table}.Sanitize()}
			p.byName[t.name] = t
			names = append(names, t.name)
		}
		t.rows = append(t.rows, a)
	}
	sort.Strings(names)
	idents := make([]string, len(names))
	for i, n := range names {
		t := p.byName[n]
		if err := t.loadColumns(ctx, tx); err != nil {
			return nil, err
		}
		idents[i] = t.ident
	}
	fks, err := foreignKeys(ctx, tx, idents)
	if err != nil {
		return nil, err
	}
	for _, scc := range components(names, fks) {
		p.addComponent(scc, fks)
	}
	// Every INSERT is built (and every column type checked) before the
	// source is asked anything about a row.
	for _, a := range p.rows {
		if a.insert, a.args, err = insertSQL(p.byName[a.qualified()], a); err != nil {
			return nil, err
		}
	}
	return p, nil
}

// addComponent appends one strongly connected set of tables: its rows in
// delete order (the order a cascade deleted them: parents first), its
// foreign keys inside the set deferred when they can be.
func (p *planned) addComponent(scc []string, fks []fk) {
	var rows []*archived
	for _, n := range scc {
		t := p.byName[n]
		rows = append(rows, t.rows...)
		p.tables = append(p.tables, t.describe())
	}
	slices.SortStableFunc(rows, func(a, b *archived) int { return a.seq - b.seq })
	p.rows = append(p.rows, rows...)
	for _, f := range fks {
		if f.deferrable && slices.Contains(scc, f.child) && slices.Contains(scc, f.parent) {
			p.deferred = append(p.deferred, f.name)
		}
	}
}

const columnsSQL = `
SELECT a.attname, a.attgenerated <> ''
FROM pg_attribute a
WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY a.attnum`

func (t *table) loadColumns(ctx context.Context, tx pgx.Tx) error {
	var exists bool
	if err := tx.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, t.ident).Scan(&exists); err != nil {
		return fmt.Errorf("look up %s in the source: %w", t.name, err)
	}
	if !exists {
		return cannot("table %s does not exist in the source (dropped or renamed since the delete?)", t.name)
	}
	rows, err := tx.Query(ctx, columnsSQL, t.ident)
	if err != nil {
		return fmt.Errorf("read columns of %s: %w", t.name, err)
	}
	t.generated = map[string]bool{}
	for rows.Next() {
		var name string
		var gen bool
		if err := rows.Scan(&name, &gen); err != nil {
			rows.Close()
			return fmt.Errorf("read columns of %s: %w", t.name, err)
		}
		t.current = append(t.current, name)
		t.generated[name] = gen
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("read columns of %s: %w", t.name, err)
	}
	return nil
}

// describe says what happens to the table's columns.
func (t *table) describe() TablePlan {
	tp := TablePlan{Table: t.name, Rows: len(t.rows), DroppedColumns: []string{}, AddedColumns: []string{}, GeneratedColumns: []string{}}
	archivedCols := map[string]bool{}
	for _, a := range t.rows {
		for _, c := range a.columns {
			archivedCols[c.Name] = true
		}
		for name := range a.row {
			archivedCols[name] = true
		}
	}
	for name := range archivedCols {
		if _, ok := t.generated[name]; !ok {
			tp.DroppedColumns = append(tp.DroppedColumns, name)
		}
	}
	sort.Strings(tp.DroppedColumns)
	for _, name := range t.current {
		switch {
		case t.generated[name]:
			tp.GeneratedColumns = append(tp.GeneratedColumns, name)
		case !archivedCols[name]:
			tp.AddedColumns = append(tp.AddedColumns, name)
		}
	}
	return tp
}

const foreignKeysSQL = `
SELECT pg_catalog.quote_ident(cn.nspname) || '.' || pg_catalog.quote_ident(c.conname),
       ns.nspname || '.' || cs.relname, np.nspname || '.' || cp.relname, c.condeferrable
FROM pg_constraint c
JOIN pg_class cs ON cs.oid = c.conrelid JOIN pg_namespace ns ON ns.oid = cs.relnamespace
JOIN pg_class cp ON cp.oid = c.confrelid JOIN pg_namespace np ON np.oid = cp.relnamespace
JOIN pg_namespace cn ON cn.oid = c.connamespace
WHERE c.contype = 'f' AND c.conrelid = ANY($1::text[]::regclass[]) AND c.confrelid = ANY($1::text[]::regclass[])
ORDER BY 1`

// foreignKeys reads the foreign keys among the tables from the source's
// current catalog (not the archived refs: the schema may have changed).
func foreignKeys(ctx context.Context, tx pgx.Tx, idents []string) ([]fk, error) {
	rows, err := tx.Query(ctx, foreignKeysSQL, idents)
	if err != nil {
		return nil, fmt.Errorf("read foreign keys: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (fk, error) {
		var f fk
		return f, r.Scan(&f.name, &f.child, &f.parent, &f.deferrable)
	})
	if err != nil {
		return nil, fmt.Errorf("read foreign keys: %w", err)
	}
	return out, nil
}

// components returns the strongly connected sets of the tables under
// "child references parent", parents first (Tarjan's algorithm emits a set
// after every set it reaches). Deterministic: tables by name.
func components(names []string, fks []fk) [][]string {
	edges := map[string][]string{}
	for _, f := range fks {
		edges[f.child] = append(edges[f.child], f.parent)
	}
	index, low, onStack := map[string]int{}, map[string]int{}, map[string]bool{}
	var stack []string
	var out [][]string
	var visit func(v string)
	visit = func(v string) {
		index[v], low[v] = len(index), len(index)
		stack = append(stack, v)
		onStack[v] = true
		for _, w := range edges[v] {
			if _, seen := index[w]; !seen {
				visit(w)
				low[v] = min(low[v], low[w])
			} else if onStack[w] {
				low[v] = min(low[v], index[w])
			}
		}
		if low[v] != index[v] {
			return
		}
		var scc []string
		for {
			w := stack[len(stack)-1]
			stack = stack[:len(stack)-1]
			onStack[w] = false
			scc = append(scc, w)
			if w == v {
				break
			}
		}
		sort.Strings(scc)
		out = append(out, scc)
	}
	for _, n := range names {
		if _, seen := index[n]; !seen {
			visit(n)
		}
	}
	return out
}

// conflicts returns the rows whose key exists in the source.
func conflicts(ctx context.Context, tx pgx.Tx, p *planned) ([]RowRef, error) {
	out := []RowRef{}
	for _, a := range p.rows {
		sql, args, err := existsSQL(p.byName[a.qualified()], a)
		if err != nil {
			return nil, err
		}
		if sql == "" {
			continue
		}
		var exists bool
		if err := tx.QueryRow(ctx, sql, args...).Scan(&exists); err != nil {
			return nil, fmt.Errorf("look up %s in the source: %w", a.ref(), err)
		}
		if exists {
			out = append(out, a.ref())
		}
	}
	return out, nil
}

// existsSQL asks whether a row with a's key exists; "" when a has no key
// the source still has columns for.
func existsSQL(t *table, a *archived) (string, []any, error) {
	var key map[string]json.RawMessage
	if err := json.Unmarshal(a.key, &key); err != nil || len(key) == 0 {
		return "", nil, nil //nolint:nilerr // a row without a key is checked by the insert itself
	}
	types := map[string]string{}
	for _, c := range a.columns {
		types[c.Name] = c.Type
	}
	names := make([]string, 0, len(key))
	for name := range key {
		if _, ok := t.generated[name]; !ok || types[name] == "" {
			return "", nil, nil
		}
		names = append(names, name)
	}
	sort.Strings(names)
	var conds []string
	var args []any
	for _, name := range names {
		text, notNull, err := rowsql.ValueText(key[name])
		if err != nil {
			return "", nil, fmt.Errorf("key of %s: %w", a.ref(), err)
		}
		if !notNull {
			return "", nil, nil
		}
		args = append(args, text)
		conds = append(conds, pgx.Identifier{name}.Sanitize()+" = $"+strconv.Itoa(len(args))+"::text::"+types[name]) // checked by rowsql.InsertSQL in plan
	}
	return "SELECT EXISTS (SELECT 1 FROM " + t.ident + " WHERE " + strings.Join(conds, " AND ") + ")", args, nil
}

// insertAll inserts the planned rows in order; with skip, a row whose key
// (or any unique constraint) exists is left alone and counted.
func insertAll(ctx context.Context, tx pgx.Tx, p *planned, skip bool, res *Result) error {
	if len(p.deferred) > 0 {
		if _, err := tx.Exec(ctx, `SET CONSTRAINTS `+strings.Join(p.deferred, ", ")+` DEFERRED`); err != nil {
			return fmt.Errorf("defer constraints %s: %w", strings.Join(p.deferred, ", "), err)
		}
	}
	for _, a := range p.rows {
		sql, args := a.insert, a.args
		if skip {
			sql += " ON CONFLICT DO NOTHING"
		}
		tag, err := tx.Exec(ctx, sql, args...)
		var pg *pgconn.PgError
		switch {
		case errors.As(err, &pg) && pg.Code == "23505":
			// The key was checked free in conflicts: another unique
			// constraint, or a row inserted since by a concurrent writer.
			return &ConflictError{Rows: []RowRef{a.ref()}, Constraint: pg.ConstraintName}
		case err != nil:
			return fmt.Errorf("restore %s: %w", a.ref(), err)
		case tag.RowsAffected() == 0:
			res.Skipped++
		default:
			a.restored = true
			res.Restored++
		}
	}
	if len(p.deferred) > 0 {
		// Check the deferred keys here, to name the failure before COMMIT.
		if _, err := tx.Exec(ctx, `SET CONSTRAINTS ALL IMMEDIATE`); err != nil {
			return fmt.Errorf("restore: deferred foreign keys: %w", err)
		}
	}
	return nil
}

// insertSQL builds the row's INSERT with rowsql.InsertSQL from the
// archived values and the event's column types, leaving out the columns
// the table no longer has and those it generates now.
func insertSQL(t *table, a *archived) (string, []any, error) {
	ev := &event.Event{Op: event.OpDelete, Schema: a.schema, Table: a.table}
	kept := map[string]json.RawMessage{}
	for _, c := range a.columns {
		gen, exists := t.generated[c.Name]
		v, inRow := a.row[c.Name]
		if !exists || gen || !inRow {
			continue
		}
		ev.Columns = append(ev.Columns, c)
		kept[c.Name] = v
	}
	row, err := json.Marshal(kept)
	if err != nil {
		return "", nil, fmt.Errorf("restore %s: %w", a.ref(), err)
	}
	ev.Row = row
	sql, args, err := rowsql.InsertSQL(ev)
	if err != nil {
		return "", nil, fmt.Errorf("restore %s: %w", a.ref(), err)
	}
	return sql, args, nil
}
