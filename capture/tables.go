package capture

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// minServerVersion is PostgreSQL 14: pgoutput with logical decoding
// messages and publish_via_partition_root on every path capture uses.
const minServerVersion = 140000

// checkServerVersion refuses servers older than PostgreSQL 14.
func checkServerVersion(num int) error {
	if num < minServerVersion {
		return configErr("PostgreSQL %d.%d is too old: capture needs PostgreSQL 14 or newer (upgrade the source server)", num/10000, num%10000/100)
	}
	return nil
}

const sqlServerFacts = `
SELECT current_setting('server_version_num')::int, current_setting('wal_level'),
       r.rolreplication OR r.rolsuper, current_user, current_database()
FROM pg_roles r WHERE r.rolname = current_user`

// checkServer verifies version, wal_level and the REPLICATION privilege.
func checkServer(ctx context.Context, pool *pgxpool.Pool) (db string, err error) {
	var (
		version   int
		walLevel  string
		canRepl   bool
		user      string
		currentDB string
	)
	if err := pool.QueryRow(ctx, sqlServerFacts).Scan(&version, &walLevel, &canRepl, &user, &currentDB); err != nil {
		return "", fmt.Errorf("read server settings: %w", err)
	}
	if err := checkServerVersion(version); err != nil {
		return "", err
	}
	if walLevel != "logical" {
		return "", configErr("wal_level is %q but capture needs \"logical\": run ALTER SYSTEM SET wal_level = logical and restart PostgreSQL", walLevel)
	}
	if !canRepl {
		return "", configErr("role %q lacks the REPLICATION privilege: run ALTER ROLE %s WITH REPLICATION as a superuser", user, pgx.Identifier{user}.Sanitize())
	}
	return currentDB, nil
}

// ownSchema reports whether a schema is Epitaph's own: never published,
// so a target that is also the source does not feed itself. Exactly
// epitaph, archive and archive_v<digits> (a version schema); a user's
// archive_vendors is not ours.
func ownSchema(s string) bool {
	if s == "epitaph" || s == "archive" {
		return true
	}
	v, ok := strings.CutPrefix(s, "archive_v")
	return ok && v != "" && strings.Trim(v, "0123456789") == ""
}

func systemSchema(s string) bool {
	return s == "information_schema" || strings.HasPrefix(s, "pg_")
}

// tableInfo is one candidate table and what its deletes would carry.
type tableInfo struct {
	oid         uint32
	schema      string
	name        string
	kind        byte // 'r' or 'p'
	persistence byte
	owned       bool
	// identity is "full", "key", or "" when deletes would fail once the
	// table is published (no key and REPLICA IDENTITY DEFAULT, or NOTHING).
	// For a partitioned table it is the weakest of its leaf partitions.
	identity string
	// notFull are the relations (the table or its leaves) whose replica
	// identity is not FULL, "schema"."name" quoted.
	notFull []string
	// notFullOwned is false when one of notFull is not owned by us.
	notFullOwned bool
}

func (t *tableInfo) qualified() string { return t.schema + "." + t.name }
func (t *tableInfo) sanitized() string { return pgx.Identifier{t.schema, t.name}.Sanitize() }

const sqlTableByName = `
SELECT c.oid, n.nspname, c.relname, c.relkind::text, c.relpersistence::text, pg_has_role(c.relowner, 'USAGE')
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = $1 AND c.relname = $2 AND c.relkind IN ('r', 'p')`

const sqlAllTables = `
SELECT c.oid, n.nspname, c.relname, c.relkind::text, c.relpersistence::text, pg_has_role(c.relowner, 'USAGE')
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.relkind IN ('r', 'p') AND NOT c.relispartition AND c.relpersistence = 'p'
  AND n.nspname NOT IN ('information_schema', 'epitaph', 'archive')
  AND n.nspname NOT LIKE 'pg\_%' AND n.nspname !~ '^archive_v[0-9]+$'
  AND NOT EXISTS (SELECT 1 FROM pg_depend d WHERE d.classid = 'pg_class'::regclass AND d.objid = c.oid AND d.deptype = 'e')
ORDER BY n.nspname, c.relname`

// sqlLeafIdentity returns the replica identity facts of the relations that
// decide what a delete on $1 publishes: the table itself and, for a
// partitioned table, its leaf partitions (whose identity decides what the
// WAL holds; the parent's decides whether pgoutput sends it as a whole row,
// publish_via_partition_root).
const sqlLeafIdentity = `
SELECT n.nspname, c.relname, c.relreplident::text,
  EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisprimary),
  EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisreplident),
  pg_has_role(c.relowner, 'USAGE')
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.oid = $1::oid
   OR c.oid IN (SELECT relid FROM pg_partition_tree($1::oid::regclass) WHERE isleaf AND relid <> $1::oid)`

func scanTables(rows pgx.Rows) ([]*tableInfo, error) {
	var out []*tableInfo
	for rows.Next() {
		var (
			t           tableInfo
			kind, persi string
		)
		if err := rows.Scan(&t.oid, &t.schema, &t.name, &kind, &persi, &t.owned); err != nil {
			return nil, err
		}
		t.kind, t.persistence = kind[0], persi[0]
		out = append(out, &t)
	}
	return out, rows.Err()
}

// loadIdentity fills identity and notFull.
func loadIdentity(ctx context.Context, pool *pgxpool.Pool, t *tableInfo) error {
	rows, err := pool.Query(ctx, sqlLeafIdentity, t.oid)
	if err != nil {
		return fmt.Errorf("read replica identity of %s: %w", t.qualified(), err)
	}
	defer rows.Close()
	t.identity = "full"
	t.notFullOwned = true
	n := 0
	for rows.Next() {
		var (
			schema, name, ident string
			hasPK, hasIdx, own  bool
		)
		if err := rows.Scan(&schema, &name, &ident, &hasPK, &hasIdx, &own); err != nil {
			return fmt.Errorf("read replica identity of %s: %w", t.qualified(), err)
		}
		n++
		id := identityOf(ident, hasPK, hasIdx)
		if id != "full" {
			t.notFull = append(t.notFull, pgx.Identifier{schema, name}.Sanitize())
			if !own {
				t.notFullOwned = false
			}
		}
		t.identity = weakerIdentity(t.identity, id)
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("read replica identity of %s: %w", t.qualified(), err)
	}
	return nil
}

func identityOf(replident string, hasPK, hasReplIdx bool) string {
	switch {
	case replident == "f":
		return "full"
	case replident == "d" && hasPK, replident == "i" && hasReplIdx:
		return "key"
	default:
		return ""
	}
}

func weakerIdentity(a, b string) string {
	rank := map[string]int{"full": 2, "key": 1, "": 0}
	if rank[b] < rank[a] {
		return b
	}
	return a
}

// tableSelection is what capture publishes and what it left out.
type tableSelection struct {
	tables  []*tableInfo
	skipped []string // "schema.table: reason"
	keyOnly []string
	// unsafe are the tables that fit the configuration but whose deletes
	// would fail once published (no usable replica identity on the table or
	// one of its leaves): never in the publication.
	unsafe []*tableInfo
	// madeFull are the relations --set-replica-identity-full changed,
	// "schema"."name".
	madeFull []string
}

// oids are the relations the selection publishes: the tables and, for a
// partitioned table, its leaves are not needed (events name the root).
func (s *tableSelection) oids() []uint32 {
	out := make([]uint32, len(s.tables))
	for i, t := range s.tables {
		out[i] = t.oid
	}
	return out
}

func (s *tableSelection) names() []string {
	out := make([]string, len(s.tables))
	for i, t := range s.tables {
		out[i] = t.qualified()
	}
	return out
}

// selectTables resolves the configured tables (or every eligible one),
// checking identity; with setFull it makes every selected table REPLICA
// IDENTITY FULL.
//
// While streaming (watching), nothing in the catalog is an error: a named
// table that is gone or unlogged is left out, one without usable identity
// (or that cannot be set FULL) is listed in unsafe.
func selectTables(ctx context.Context, pool *pgxpool.Pool, names []string, setFull, watching bool) (*tableSelection, error) {
	sel := &tableSelection{}
	var cands []*tableInfo
	if len(names) == 0 {
		rows, err := pool.Query(ctx, sqlAllTables)
		if err != nil {
			return nil, fmt.Errorf("list tables: %w", err)
		}
		cands, err = scanTables(rows)
		if err != nil {
			return nil, fmt.Errorf("list tables: %w", err)
		}
	} else {
		seen := map[string]bool{}
		for _, n := range names {
			schema, table, err := splitTable(n)
			if err != nil {
				return nil, &ConfigError{Msg: err.Error()}
			}
			if ownSchema(schema) || systemSchema(schema) {
				return nil, configErr("table %s.%s is in a schema capture never publishes (Epitaph's own or a system schema): remove it from EPITAPH_TABLES", schema, table)
			}
			rows, err := pool.Query(ctx, sqlTableByName, schema, table)
			if err != nil {
				return nil, fmt.Errorf("look up table %s.%s: %w", schema, table, err)
			}
			found, err := scanTables(rows)
			if err != nil {
				return nil, fmt.Errorf("look up table %s.%s: %w", schema, table, err)
			}
			if len(found) == 0 && watching {
				continue
			}
			if len(found) == 0 {
				return nil, configErr("table %s.%s does not exist (check EPITAPH_TABLES)", schema, table)
			}
			t := found[0]
			if t.persistence != 'p' && watching {
				sel.skipped = append(sel.skipped, t.qualified()+": unlogged or temporary")
				continue
			}
			if t.persistence != 'p' {
				return nil, configErr("table %s is unlogged or temporary: its deletes are not in the WAL, remove it from EPITAPH_TABLES", t.qualified())
			}
			if !seen[t.qualified()] {
				seen[t.qualified()] = true
				cands = append(cands, t)
			}
		}
	}
	for _, t := range cands {
		if err := loadIdentity(ctx, pool, t); err != nil {
			return nil, err
		}
		if t.identity == "full" {
			sel.tables = append(sel.tables, t)
			continue
		}
		if setFull && !t.notFullOwned && watching {
			if t.identity == "" {
				sel.unsafe = append(sel.unsafe, t)
				sel.skipped = append(sel.skipped, t.qualified()+": no usable replica identity, and the capture role cannot set it FULL (not a member of the owner role)")
				continue
			}
		} else if setFull {
			if !t.notFullOwned {
				return nil, configErr("must own table %s to set REPLICA IDENTITY FULL on it: as a superuser, run GRANT <owner role> TO <capture role> (membership in the owner role is enough), or run ALTER TABLE %s REPLICA IDENTITY FULL as its owner", t.qualified(), t.sanitized())
			}
			for _, rel := range t.notFull {
				if _, err := pool.Exec(ctx, "ALTER TABLE "+rel+" REPLICA IDENTITY FULL"); err != nil {
					return nil, fmt.Errorf("set replica identity full on %s: %w", rel, err)
				}
			}
			sel.madeFull = append(sel.madeFull, t.notFull...)
			t.identity, t.notFull = "full", nil
			sel.tables = append(sel.tables, t)
			continue
		}
		if t.identity == "" {
			if watching {
				sel.unsafe = append(sel.unsafe, t)
				sel.skipped = append(sel.skipped, t.qualified()+": no usable replica identity (add a primary key or use --set-replica-identity-full)")
				continue
			}
			if len(names) > 0 {
				return nil, configErr("table %s has no usable replica identity (no primary key and REPLICA IDENTITY DEFAULT, or NOTHING): its deletes would fail once published. Add a primary key, run ALTER TABLE %s REPLICA IDENTITY FULL, or start with --set-replica-identity-full", t.qualified(), t.sanitized())
			}
			sel.skipped = append(sel.skipped, t.qualified()+": no usable replica identity (add a primary key or use --set-replica-identity-full)")
			continue
		}
		sel.keyOnly = append(sel.keyOnly, t.qualified())
		sel.tables = append(sel.tables, t)
	}
	return sel, nil
}

const (
	sqlPublication       = `SELECT puballtables, pubinsert, pubupdate, pubdelete, pubtruncate, pubviaroot FROM pg_publication WHERE pubname = $1`
	sqlPublicationTables = `
SELECT pr.prrelid FROM pg_publication_rel pr JOIN pg_publication p ON p.oid = pr.prpubid WHERE p.pubname = $1
UNION ALL
SELECT 0 FROM pg_publication_namespace pn JOIN pg_publication p ON p.oid = pn.pnpubid WHERE p.pubname = $1`
	publicationOptions = `publish = 'delete, truncate', publish_via_partition_root = true`
)

// syncPublication creates the publication, or makes an existing one publish
// exactly the selected tables with the right options.
func syncPublication(ctx context.Context, pool *pgxpool.Pool, name string, sel *tableSelection) (changed bool, err error) {
	pub := pgx.Identifier{name}.Sanitize()
	var allTables, ins, upd, del, trunc, viaRoot bool
	err = pool.QueryRow(ctx, sqlPublication, name).Scan(&allTables, &ins, &upd, &del, &trunc, &viaRoot)
	exists := true
	if errors.Is(err, pgx.ErrNoRows) {
		exists = false
	} else if err != nil {
		return false, fmt.Errorf("read publication %s: %w", name, err)
	}
	if exists && allTables {
		return false, configErr("publication %q is FOR ALL TABLES, which would publish tables whose deletes then fail (and Epitaph's own schemas): drop it, or pass another --publication", name)
	}
	current := map[uint32]bool{}
	if exists {
		rows, err := pool.Query(ctx, sqlPublicationTables, name)
		if err != nil {
			return false, fmt.Errorf("read tables of publication %s: %w", name, err)
		}
		for rows.Next() {
			var oid uint32
			if err := rows.Scan(&oid); err != nil {
				rows.Close()
				return false, fmt.Errorf("read tables of publication %s: %w", name, err)
			}
			current[oid] = true
		}
		if err := rows.Err(); err != nil {
			return false, fmt.Errorf("read tables of publication %s: %w", name, err)
		}
	}
	want := map[uint32]bool{}
	var list []string
	for _, t := range sel.tables {
		want[t.oid] = true
		list = append(list, t.sanitized())
		if !current[t.oid] && !t.owned {
			return false, configErr("must own table %s to publish it: as a superuser, run GRANT <owner role of %s> TO <capture role> (membership is enough; ALTER TABLE .. OWNER TO would break the application's migrations), then start again", t.qualified(), t.sanitized())
		}
	}
	sameTables := len(current) == len(want)
	for oid := range current {
		if !want[oid] {
			sameTables = false
		}
	}
	var stmts []string
	switch {
	case !exists && len(list) > 0:
		stmts = append(stmts, "CREATE PUBLICATION "+pub+" FOR TABLE "+strings.Join(list, ", ")+" WITH ("+publicationOptions+")")
	case !exists:
		stmts = append(stmts, "CREATE PUBLICATION "+pub+" WITH ("+publicationOptions+")")
	default:
		if !sameTables {
			if len(list) > 0 {
				stmts = append(stmts, "ALTER PUBLICATION "+pub+" SET TABLE "+strings.Join(list, ", "))
			} else {
				// SET needs at least one table: drop and recreate empty.
				stmts = append(stmts, "DROP PUBLICATION "+pub, "CREATE PUBLICATION "+pub+" WITH ("+publicationOptions+")")
			}
		}
		if ins || upd || !del || !trunc || !viaRoot {
			stmts = append(stmts, "ALTER PUBLICATION "+pub+" SET ("+publicationOptions+")")
		}
	}
	for _, s := range stmts {
		if _, err := pool.Exec(ctx, s); err != nil {
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) && pgErr.Code == "42501" {
				return false, configErr("cannot create or change publication %q: %s (grant CREATE on the database, or have its owner create it FOR TABLE %s WITH (%s))", name, pgErr.Message, strings.Join(list, ", "), publicationOptions)
			}
			return false, fmt.Errorf("sync publication %s: %w", name, err)
		}
	}
	return len(stmts) > 0, nil
}

// publicationTables lists the tables a publication holds, "schema.table".
func publicationTables(ctx context.Context, pool *pgxpool.Pool, name string) ([]string, error) {
	rows, err := pool.Query(ctx, `SELECT schemaname || '.' || tablename FROM pg_publication_tables WHERE pubname = $1 ORDER BY 1`, name)
	if err != nil {
		return nil, fmt.Errorf("read tables of publication %s: %w", name, err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("read tables of publication %s: %w", name, err)
	}
	slices.Sort(out)
	return out, nil
}

func itoa(i int) string { return strconv.Itoa(i) }
