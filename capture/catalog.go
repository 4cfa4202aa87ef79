package capture

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/epitaph-dev/epitaph/event"
)

// catalog answers questions about the source's current catalog on a normal
// connection: column type names and a table's primary key and foreign keys.
// Results are cached; table facts are refreshed whenever pgoutput sends a
// new Relation message (which it does after any change to the table).
type catalog struct {
	pool *pgxpool.Pool
	// typeNames are the names pgoutput sent in Type messages, a fallback
	// for a type dropped since.
	typeNames map[uint32]string
}

type tableFacts struct {
	pk   []string
	refs []event.Ref
}

func newCatalog(pool *pgxpool.Pool) *catalog {
	return &catalog{pool: pool, typeNames: map[uint32]string{}}
}

const sqlFormatTypes = `
SELECT format_type(t.oid, t.mod) FROM unnest($1::oid[], $2::int[]) WITH ORDINALITY t(oid, mod, ord) ORDER BY t.ord`

// typeNames returns format_type(oid, typmod) for each column: e.g.
// "numeric(12,2)", "text[]", "public.mood" (the pool's search_path is
// pg_catalog only, so every other type is schema-qualified). It is asked
// again for every Relation message, so a renamed type is seen.
func (c *catalog) typeNamesOf(ctx context.Context, oids []uint32, mods []int32) ([]string, error) {
	rows, err := c.pool.Query(ctx, sqlFormatTypes, oids, mods)
	if err != nil {
		return nil, fmt.Errorf("format column types: %w", err)
	}
	var out []string
	for rows.Next() {
		var n *string
		if err := rows.Scan(&n); err != nil {
			rows.Close()
			return nil, fmt.Errorf("format column types: %w", err)
		}
		name := ""
		if n != nil {
			name = *n
		}
		i := len(out)
		if name == "" || name == "???" || name[0] == '-' {
			fb, ok := c.typeNames[oids[i]]
			if !ok {
				return nil, fmt.Errorf("format column types: type %d no longer exists", oids[i])
			}
			name = fb
		}
		out = append(out, name)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("format column types: %w", err)
	}
	if len(out) != len(oids) {
		return nil, fmt.Errorf("format column types: got %d names for %d columns", len(out), len(oids))
	}
	return out, nil
}

const sqlPrimaryKey = `
SELECT a.attname
FROM pg_index i
JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY (i.indkey)
WHERE i.indrelid = $1::oid AND i.indisprimary
ORDER BY array_position(i.indkey::int2[], a.attnum)`

// sqlForeignKeys lists the table's own foreign keys (not the per-partition
// copies Postgres makes when the referenced table is partitioned).
const sqlForeignKeys = `
SELECT n.nspname, r.relname,
  ARRAY(SELECT a.attname FROM unnest(c.conkey) WITH ORDINALITY k(attnum, ord)
        JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = k.attnum ORDER BY k.ord),
  ARRAY(SELECT a.attname FROM unnest(c.confkey) WITH ORDINALITY k(attnum, ord)
        JOIN pg_attribute a ON a.attrelid = c.confrelid AND a.attnum = k.attnum ORDER BY k.ord)
FROM pg_constraint c
JOIN pg_class r ON r.oid = c.confrelid
JOIN pg_namespace n ON n.oid = r.relnamespace
WHERE c.conrelid = $1::oid AND c.contype = 'f' AND c.conparentid = 0
ORDER BY c.conname`

// table reads the current primary key and foreign keys of a relation. A
// relation dropped since gives empty facts (the event still carries its
// columns and values).
func (c *catalog) table(ctx context.Context, relID uint32) (tableFacts, error) {
	var f tableFacts
	rows, err := c.pool.Query(ctx, sqlPrimaryKey, relID)
	if err != nil {
		return f, fmt.Errorf("read primary key of relation %d: %w", relID, err)
	}
	for rows.Next() {
		var n string
		if err := rows.Scan(&n); err != nil {
			rows.Close()
			return f, fmt.Errorf("read primary key of relation %d: %w", relID, err)
		}
		f.pk = append(f.pk, n)
	}
	if err := rows.Err(); err != nil {
		return f, fmt.Errorf("read primary key of relation %d: %w", relID, err)
	}
	rows, err = c.pool.Query(ctx, sqlForeignKeys, relID)
	if err != nil {
		return f, fmt.Errorf("read foreign keys of relation %d: %w", relID, err)
	}
	for rows.Next() {
		var r event.Ref
		if err := rows.Scan(&r.Schema, &r.Table, &r.Columns, &r.RefColumns); err != nil {
			rows.Close()
			return f, fmt.Errorf("read foreign keys of relation %d: %w", relID, err)
		}
		f.refs = append(f.refs, r)
	}
	if err := rows.Err(); err != nil {
		return f, fmt.Errorf("read foreign keys of relation %d: %w", relID, err)
	}
	return f, nil
}
