package capture

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"sync"

	"github.com/jackc/pgx/v5"
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
	// known are the last facts read of each relation that existed then: a
	// relation dropped (or whose key column was renamed) with deletes still
	// in the slot keeps the keys and foreign keys it had. Read by the
	// streamer and filled by the catalog watch too (remember), under mu.
	mu    sync.Mutex
	known map[uint32]tableFacts
	// store keeps the facts on the source across restarts (nil: memory
	// only).
	store *factsStore
}

type tableFacts struct {
	exists bool
	pk     []string
	// replIdx are the columns of the replica identity index
	// (REPLICA IDENTITY USING INDEX), in index order.
	replIdx []string
	refs    []event.Ref
	// generated are the table's generated columns, which pgoutput does not
	// send (before PostgreSQL 18).
	generated []generatedColumn
	// partitioned: a partitioned table published via its root, whose rows
	// come from leaves that may have a weaker replica identity than the
	// root's (pgoutput labels the old tuple by the root's).
	partitioned bool
	// weakLeaves: partitioned, and a leaf is not REPLICA IDENTITY FULL.
	weakLeaves bool
	// indexLeaves: partitioned, and a leaf is REPLICA IDENTITY USING
	// INDEX, whose columns need not be the primary key's.
	indexLeaves bool
	// pkPos are the positions of the primary key columns among the columns
	// pgoutput sends today (not dropped, not generated, attnum order), and
	// ncols how many those are: a key column renamed since a delete was
	// written is still found by position when no column was added or
	// dropped.
	pkPos []int
	ncols int
	// partCols are the columns of the partition keys of every level of a
	// partitioned table's tree (an expression key names none): an UPDATE
	// that changes them moves the row, which pgoutput sends as a delete
	// and an insert whose keys differ in these columns only.
	partCols []string
}

// generatedColumn is a generated column and the column before it, so it is
// listed where the table has it.
type generatedColumn struct {
	name, typ, after string
}

func newCatalog(pool *pgxpool.Pool) *catalog {
	return &catalog{pool: pool, typeNames: map[uint32]string{}, known: map[uint32]tableFacts{}}
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

const sqlRelationFacts = `
WITH cols AS (
  SELECT a.attnum, (row_number() OVER (ORDER BY a.attnum))::int - 1 AS pos
  FROM pg_attribute a WHERE a.attrelid = $1::oid AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = ''
)
SELECT c.relkind = 'p',
  ARRAY(SELECT a.attname FROM pg_index i CROSS JOIN LATERAL unnest(i.indkey::int2[]) WITH ORDINALITY k(attnum, ord)
        JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
        WHERE i.indrelid = c.oid AND i.indisreplident AND c.relreplident = 'i' ORDER BY k.ord),
  ARRAY(SELECT cols.pos FROM pg_index i CROSS JOIN LATERAL unnest(i.indkey::int2[]) WITH ORDINALITY k(attnum, ord)
        JOIN cols ON cols.attnum = k.attnum
        WHERE i.indrelid = c.oid AND i.indisprimary ORDER BY k.ord),
  (SELECT count(*)::int FROM cols),
  c.relkind = 'p' AND EXISTS (SELECT 1 FROM pg_partition_tree(c.oid) t JOIN pg_class l ON l.oid = t.relid
                               WHERE t.isleaf AND l.relreplident <> 'f'),
  c.relkind = 'p' AND EXISTS (SELECT 1 FROM pg_partition_tree(c.oid) t JOIN pg_class l ON l.oid = t.relid
                               WHERE t.isleaf AND l.relreplident = 'i')
FROM pg_class c WHERE c.oid = $1::oid`

// sqlGenerated lists the generated columns, each with the name of the
// column before it (attnum order, dropped columns skipped).
const sqlGenerated = `
SELECT name, typ, COALESCE(after, '') FROM (
  SELECT a.attname AS name, format_type(a.atttypid, a.atttypmod) AS typ, a.attgenerated <> '' AS gen,
         lag(a.attname) OVER (ORDER BY a.attnum) AS after
  FROM pg_attribute a WHERE a.attrelid = $1::oid AND a.attnum > 0 AND NOT a.attisdropped) x
WHERE gen`

// table reads the current keys, foreign keys and generated columns of a
// relation, and returns with them the facts read of it before (zero when
// none): a key dropped or renamed since its deletes were written is still
// known there. A relation dropped since gives the facts last read of it
// as the current ones, or empty ones (the event still carries its columns
// and values).
func (c *catalog) table(ctx context.Context, relID uint32) (cur, before tableFacts, err error) {
	f, err := c.read(ctx, relID)
	if err != nil {
		return f, before, err
	}
	c.mu.Lock()
	before, known := c.known[relID]
	if f.exists {
		c.known[relID] = f
	}
	c.mu.Unlock()
	if !f.exists {
		if !known {
			// Dropped before this capture read it: what an earlier run
			// recorded, if any.
			if kept, ok := c.store.load(ctx, relID); ok {
				before = kept
				c.mu.Lock()
				c.known[relID] = kept
				c.mu.Unlock()
			}
		}
		return before, before, nil
	}
	if !known || !reflect.DeepEqual(before, f) {
		c.store.save(ctx, relID, f)
	}
	return f, before, nil
}

// remember reads the facts of the relations not known yet, so a table
// dropped before its deletes are decoded still has its keys.
func (c *catalog) remember(ctx context.Context, relIDs []uint32) error {
	for _, id := range relIDs {
		c.mu.Lock()
		_, ok := c.known[id]
		c.mu.Unlock()
		if ok {
			continue
		}
		f, err := c.read(ctx, id)
		if err != nil {
			return err
		}
		if f.exists {
			c.mu.Lock()
			c.known[id] = f
			c.mu.Unlock()
			c.store.save(ctx, id, f)
		}
	}
	return nil
}

// sqlPartitionColumns names the columns of the partition keys of every
// partitioned table in $1's tree (names, since attnums differ by level).
const sqlPartitionColumns = `
SELECT coalesce(array_agg(DISTINCT a.attname::text), '{}')
FROM pg_partition_tree($1::oid::regclass) t
JOIN pg_partitioned_table p ON p.partrelid = t.relid
CROSS JOIN LATERAL unnest(p.partattrs::int2[]) AS k(attnum)
JOIN pg_attribute a ON a.attrelid = t.relid AND a.attnum = k.attnum`

func (c *catalog) read(ctx context.Context, relID uint32) (tableFacts, error) {
	var f tableFacts
	err := c.pool.QueryRow(ctx, sqlRelationFacts, relID).Scan(&f.partitioned, &f.replIdx, &f.pkPos, &f.ncols, &f.weakLeaves, &f.indexLeaves)
	if errors.Is(err, pgx.ErrNoRows) {
		return f, nil
	}
	if err != nil {
		return f, fmt.Errorf("read relation %d: %w", relID, err)
	}
	f.exists = true
	if f.partitioned {
		if err := c.pool.QueryRow(ctx, sqlPartitionColumns, relID).Scan(&f.partCols); err != nil {
			return f, fmt.Errorf("read partition keys of relation %d: %w", relID, err)
		}
	}
	rows, err := c.pool.Query(ctx, sqlGenerated, relID)
	if err != nil {
		return f, fmt.Errorf("read generated columns of relation %d: %w", relID, err)
	}
	for rows.Next() {
		var g generatedColumn
		if err := rows.Scan(&g.name, &g.typ, &g.after); err != nil {
			rows.Close()
			return f, fmt.Errorf("read generated columns of relation %d: %w", relID, err)
		}
		f.generated = append(f.generated, g)
	}
	if err := rows.Err(); err != nil {
		return f, fmt.Errorf("read generated columns of relation %d: %w", relID, err)
	}
	rows, err = c.pool.Query(ctx, sqlPrimaryKey, relID)
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
