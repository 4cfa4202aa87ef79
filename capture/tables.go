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
       r.rolreplication OR r.rolsuper
         OR coalesce((SELECT pg_has_role(current_user, g.oid, 'MEMBER') FROM pg_roles g WHERE g.rolname = 'rds_replication'), false),
       current_user, current_database()
FROM pg_roles r WHERE r.rolname = current_user`

// checkServer verifies version, wal_level and the REPLICATION privilege:
// the attribute, or on Amazon RDS and Aurora membership in rds_replication,
// which grants it there.
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
		return "", configErr("role %q lacks the REPLICATION privilege: run ALTER ROLE %s WITH REPLICATION as a superuser (on Amazon RDS and Aurora: GRANT rds_replication TO %s)", user, pgx.Identifier{user}.Sanitize(), pgx.Identifier{user}.Sanitize())
	}
	return currentDB, nil
}

// ownSchema reports whether a schema is Epitaph's own: never published,
// so a target that is also the source does not feed itself. Exactly
// epitaph, archive, epitaph_capture (the capture's record of the replica
// identities it changed) and archive_v<digits> (a version schema); a user's
// archive_vendors is not ours.
func ownSchema(s string) bool {
	if s == "epitaph" || s == "archive" || s == stateSchema {
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
	// unlogged are the leaf partitions that are unlogged, "schema.name":
	// their deletes are not in the WAL.
	unlogged []string
	// virtual: the table (or a leaf) has a virtual generated column
	// (PostgreSQL 18), which no publication can send: with REPLICA
	// IDENTITY FULL its DELETEs fail ("Replica identity must not contain
	// unpublished generated columns") once it is published.
	virtual bool
}

// noIdentity says why t has no usable replica identity, and the way out.
func (t *tableInfo) noIdentity() string {
	if t.virtual {
		return "no usable replica identity: REPLICA IDENTITY FULL with a virtual generated column, which no publication sends, would make its DELETEs fail (use a primary key and REPLICA IDENTITY DEFAULT, with --allow-key-only)"
	}
	return "no usable replica identity (add a primary key or use --set-replica-identity-full)"
}

func (t *tableInfo) qualified() string { return t.schema + "." + t.name }
func (t *tableInfo) sanitized() string { return pgx.Identifier{t.schema, t.name}.Sanitize() }

// member is t as a publication's table list names it: an ordinary table
// ONLY, since without it PostgreSQL adds its inheritance children too (not
// necessarily selected, and an ADD TABLE of a parent whose child is already
// a member fails). A partitioned table's partitions are published through
// it either way.
func (t *tableInfo) member() string {
	if t.kind == 'r' {
		return "ONLY " + t.sanitized()
	}
	return t.sanitized()
}

const sqlTableByName = `
SELECT c.oid, n.nspname, c.relname, c.relkind::text, c.relpersistence::text, pg_has_role(c.relowner, 'USAGE')
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = $1 AND c.relname = $2 AND c.relkind IN ('r', 'p')`

const sqlAllTables = `
SELECT c.oid, n.nspname, c.relname, c.relkind::text, c.relpersistence::text, pg_has_role(c.relowner, 'USAGE')
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.relkind IN ('r', 'p') AND NOT c.relispartition AND c.relpersistence = 'p'
  AND n.nspname NOT IN ('information_schema', 'epitaph', 'archive', 'epitaph_capture')
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
  pg_has_role(c.relowner, 'USAGE'), c.relpersistence <> 'p',
  EXISTS (SELECT 1 FROM pg_attribute a WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = 'v')
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
			schema, name, ident                   string
			hasPK, hasIdx, own, unlogged, virtual bool
		)
		if err := rows.Scan(&schema, &name, &ident, &hasPK, &hasIdx, &own, &unlogged, &virtual); err != nil {
			return fmt.Errorf("read replica identity of %s: %w", t.qualified(), err)
		}
		n++
		if unlogged {
			t.unlogged = append(t.unlogged, schema+"."+name)
		}
		id := identityOf(ident, hasPK, hasIdx)
		if virtual {
			t.virtual = true
			if id == "full" {
				id = "" // its DELETEs fail once published
			}
		}
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
	// pub is the publication the identities makeFull changes are recorded
	// under (capture uninstall puts them back).
	pub string
}

// partitioned are the selected partitioned tables, "schema.table".
func (s *tableSelection) partitioned() []string {
	var out []string
	for _, t := range s.tables {
		if t.kind == 'p' {
			out = append(out, t.qualified())
		}
	}
	return out
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

// unloggedPartition names, in tableSelection.skipped, an unlogged leaf of
// a published partitioned table.
const unloggedPartition = ": unlogged partition of "

// selectTables resolves the configured tables (or every eligible one),
// checking identity; with setFull it makes every selected table REPLICA
// IDENTITY FULL, recording what it was under publication pub.
//
// While streaming (watching), nothing in the catalog is an error: a named
// table that is gone or unlogged is left out, one without usable identity
// (or that cannot be set FULL) is listed in unsafe.
func selectTables(ctx context.Context, pool *pgxpool.Pool, pub string, names []string, setFull, watching bool) (*tableSelection, error) {
	sel := &tableSelection{pub: pub}
	var cands []*tableInfo
	var err error
	if len(names) == 0 {
		rows, err := pool.Query(ctx, sqlAllTables)
		if err != nil {
			return nil, fmt.Errorf("list tables: %w", err)
		}
		cands, err = scanTables(rows)
		if err != nil {
			return nil, fmt.Errorf("list tables: %w", err)
		}
	} else if cands, err = sel.namedTables(ctx, pool, names, watching); err != nil {
		return nil, err
	}
	for _, t := range cands {
		if err := loadIdentity(ctx, pool, t); err != nil {
			return nil, err
		}
		if err := sel.add(ctx, pool, t, setFull, watching, len(names) > 0); err != nil {
			return nil, err
		}
		for _, leaf := range t.unlogged {
			sel.skipped = append(sel.skipped, leaf+unloggedPartition+t.qualified()+": its deletes are not in the WAL and are not captured")
		}
	}
	return sel, nil
}

// namedTables looks up the configured tables, each once; while watching, a
// table gone is left out and one unlogged is listed in skipped.
func (sel *tableSelection) namedTables(ctx context.Context, pool *pgxpool.Pool, names []string, watching bool) ([]*tableInfo, error) {
	var cands []*tableInfo
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
	return cands, nil
}

// add puts a candidate whose identity is loaded in the selection: published
// (made FULL first with setFull), key-only, or skipped (unsafe while
// watching); named says the tables were configured by name, where a table
// without usable identity is an error.
func (sel *tableSelection) add(ctx context.Context, pool *pgxpool.Pool, t *tableInfo, setFull, watching, named bool) error {
	if t.identity == "full" {
		sel.tables = append(sel.tables, t)
		return nil
	}
	if setFull && !t.notFullOwned && watching {
		if t.identity == "" {
			sel.unsafe = append(sel.unsafe, t)
			sel.skipped = append(sel.skipped, t.qualified()+": no usable replica identity, and the capture role cannot set it FULL (not a member of the owner role)")
			return nil
		}
	} else if setFull {
		blocker, err := columnListBlocker(ctx, pool, t, sel.pub)
		if err != nil {
			return err
		}
		if blocker == "" {
			return sel.makeFull(ctx, pool, t)
		}
		if !watching {
			return configErr("cannot set REPLICA IDENTITY FULL on %s (--set-replica-identity-full): %s, so the application's UPDATEs and DELETEs would fail (PostgreSQL refuses a replica identity a publication does not send whole); change that, or leave the table out of EPITAPH_TABLES", t.qualified(), blocker)
		}
		sel.skipped = append(sel.skipped, t.qualified()+": not set FULL: "+blocker)
		if t.identity == "" {
			sel.unsafe = append(sel.unsafe, t)
			return nil
		}
	}
	if t.identity == "" {
		if watching {
			sel.unsafe = append(sel.unsafe, t)
			sel.skipped = append(sel.skipped, t.qualified()+": "+t.noIdentity())
			return nil
		}
		if named {
			return configErr("table %s has no usable replica identity (no primary key and REPLICA IDENTITY DEFAULT, or NOTHING): its deletes would fail once published. Add a primary key, run ALTER TABLE %s REPLICA IDENTITY FULL, or start with --set-replica-identity-full", t.qualified(), t.sanitized())
		}
		sel.skipped = append(sel.skipped, t.qualified()+": "+t.noIdentity())
		return nil
	}
	sel.keyOnly = append(sel.keyOnly, t.qualified())
	sel.tables = append(sel.tables, t)
	return nil
}

// sqlColumnListBlocker finds a publication other than $2 that publishes
// the table $1, one of its leaves or one of its ancestors with a column
// list leaving out a column, with updates or deletes: once the table is
// REPLICA IDENTITY FULL, PostgreSQL refuses its UPDATEs and DELETEs.
// PostgreSQL 15+ (column lists).
const sqlColumnListBlocker = `
WITH rels AS (SELECT $1::oid::regclass AS relid
              UNION SELECT relid FROM pg_partition_tree($1::oid::regclass)
              UNION SELECT relid FROM pg_partition_ancestors($1::oid::regclass))
SELECT format('publication %I publishes %s with a column list', p.pubname, pr.prrelid::regclass)
FROM pg_publication_rel pr JOIN pg_publication p ON p.oid = pr.prpubid JOIN rels ON rels.relid = pr.prrelid
WHERE pr.prattrs IS NOT NULL AND p.pubname <> $2 AND (p.pubdelete OR p.pubupdate)
  AND EXISTS (SELECT 1 FROM pg_attribute a WHERE a.attrelid = pr.prrelid AND a.attnum > 0
              AND NOT a.attisdropped AND a.attgenerated = '' AND NOT a.attnum = ANY (pr.prattrs::int2[]))
ORDER BY p.pubname LIMIT 1`

// sqlGeneratedBlocker finds a publication other than $2 that publishes the
// table $1, one of its leaves or one of its ancestors (by name, by schema
// or all tables, without a column list) with updates or deletes but not
// its stored generated columns: once it is REPLICA IDENTITY FULL,
// PostgreSQL 18 refuses its UPDATEs and DELETEs ("Replica identity must
// not contain unpublished generated columns").
const sqlGeneratedBlocker = `
WITH rels AS (SELECT $1::oid::regclass AS relid
              UNION SELECT relid FROM pg_partition_tree($1::oid::regclass)
              UNION SELECT relid FROM pg_partition_ancestors($1::oid::regclass))
SELECT format('publication %I publishes %s without its stored generated columns (publish_generated_columns)', p.pubname, r.relid)
FROM pg_publication p CROSS JOIN rels r JOIN pg_class c ON c.oid = r.relid
WHERE p.pubname <> $2 AND (p.pubdelete OR p.pubupdate) AND to_jsonb(p) ->> 'pubgencols' IS DISTINCT FROM 's'
  AND EXISTS (SELECT 1 FROM pg_attribute a WHERE a.attrelid = $1::oid AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = 's')
  AND (p.puballtables
       OR EXISTS (SELECT 1 FROM pg_publication_rel pr WHERE pr.prpubid = p.oid AND pr.prrelid = r.relid AND pr.prattrs IS NULL)
       OR EXISTS (SELECT 1 FROM pg_publication_namespace pn WHERE pn.pnpubid = p.oid AND pn.pnnspid = c.relnamespace))
ORDER BY p.pubname LIMIT 1`

// columnListBlocker says why t cannot be made REPLICA IDENTITY FULL
// without breaking the application's DELETEs ("" when nothing stops it).
func columnListBlocker(ctx context.Context, pool *pgxpool.Pool, t *tableInfo, pub string) (string, error) {
	if t.virtual {
		return "it has a virtual generated column, which no publication sends (PostgreSQL 18: \"Replica identity must not contain unpublished generated columns\")", nil
	}
	var version int
	if err := pool.QueryRow(ctx, `SELECT current_setting('server_version_num')::int`).Scan(&version); err != nil {
		return "", fmt.Errorf("read server version: %w", err)
	}
	if version < 150000 {
		return "", nil // no column lists before PostgreSQL 15
	}
	var why string
	err := pool.QueryRow(ctx, sqlColumnListBlocker, t.oid, pub).Scan(&why)
	if errors.Is(err, pgx.ErrNoRows) && version >= 180000 {
		err = pool.QueryRow(ctx, sqlGeneratedBlocker, t.oid, pub).Scan(&why)
	}
	if errors.Is(err, pgx.ErrNoRows) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("read publications of %s: %w", t.qualified(), err)
	}
	return why, nil
}

// makeFull sets REPLICA IDENTITY FULL on t's relations that are not,
// recording what they were, and selects it.
func (sel *tableSelection) makeFull(ctx context.Context, pool *pgxpool.Pool, t *tableInfo) error {
	if !t.notFullOwned {
		return configErr("must own table %s to set REPLICA IDENTITY FULL on it: as a superuser, run GRANT <owner role> TO <capture role> (membership in the owner role is enough), or run ALTER TABLE %s REPLICA IDENTITY FULL as its owner", t.qualified(), t.sanitized())
	}
	for _, rel := range t.notFull {
		if err := setFullRecorded(ctx, pool, sel.pub, rel); err != nil {
			return err
		}
	}
	sel.madeFull = append(sel.madeFull, t.notFull...)
	t.identity, t.notFull = "full", nil
	sel.tables = append(sel.tables, t)
	return nil
}

const (
	// sqlPublication also says whether the server has schema publications
	// (FOR TABLES IN SCHEMA, pg_publication_namespace: PostgreSQL 15+).
	sqlPublication = `SELECT puballtables, pubinsert, pubupdate, pubdelete, pubtruncate, pubviaroot,
       current_setting('server_version_num')::int >= 150000, coalesce(to_jsonb(p) ->> 'pubgencols', '')
FROM pg_publication p WHERE pubname = $1`
	// PostgreSQL 14: tables only, never filtered.
	sqlPublicationTables14 = `
SELECT pr.prrelid, false FROM pg_publication_rel pr JOIN pg_publication p ON p.oid = pr.prpubid WHERE p.pubname = $1`
	// PostgreSQL 15+: a table with a row filter or a column list is
	// reported as such (a row filter drops the deletes of the rows it
	// leaves out; a column list narrower than a FULL identity makes the
	// application's DELETEs fail), and a schema of the publication counts
	// as oid 0, a member nobody wants: SET TABLE replaces both.
	sqlPublicationTables = `
SELECT pr.prrelid, pr.prqual IS NOT NULL OR pr.prattrs IS NOT NULL
FROM pg_publication_rel pr JOIN pg_publication p ON p.oid = pr.prpubid WHERE p.pubname = $1
UNION ALL
SELECT 0, false FROM pg_publication_namespace pn JOIN pg_publication p ON p.oid = pn.pnpubid WHERE p.pubname = $1`
	publicationOptions = `publish = 'delete, truncate', publish_via_partition_root = true`
)

// syncPublication creates the publication, or makes an existing one publish
// exactly the selected tables with the right options.
func syncPublication(ctx context.Context, pool *pgxpool.Pool, name string, sel *tableSelection) (changed bool, err error) {
	pub := pgx.Identifier{name}.Sanitize()
	cur, err := readPublication(ctx, pool, name)
	if err != nil {
		return false, err
	}
	want := map[uint32]bool{}
	var list []string
	for _, t := range sel.tables {
		want[t.oid] = true
		list = append(list, t.member())
		if !cur.tables[t.oid] && !t.owned {
			return false, configErr("must own table %s to publish it: as a superuser, run GRANT <owner role of %s> TO <capture role> (membership is enough; ALTER TABLE .. OWNER TO would break the application's migrations), then start again", t.qualified(), t.sanitized())
		}
	}
	// opts are the options the publication needs, all of them named in
	// the refusal: a publication made as it says is then accepted.
	stmts, opts := cur.statements(pub, list, want), publicationOptions
	if gen, err := hasGeneratedColumnsOption(ctx, pool); err != nil {
		return false, err
	} else if gen {
		opts = publicationOptions + ", " + generatedOption
		stmts = cur.statementsWith(pub, list, want, opts,
			cur.ins || cur.upd || !cur.del || !cur.trunc || !cur.root || cur.gencols != "s")
	}
	for _, s := range stmts {
		if _, err := pool.Exec(ctx, s); err != nil {
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) && pgErr.Code == "42501" {
				return false, configErr("cannot create or change publication %q: %s (grant CREATE on the database, or have its owner create it FOR TABLE %s WITH (%s))", name, pgErr.Message, strings.Join(list, ", "), opts)
			}
			return false, fmt.Errorf("sync publication %s: %w", name, err)
		}
	}
	return len(stmts) > 0, nil
}

// publicationState is an existing publication as the catalog has it.
type publicationState struct {
	exists                     bool
	ins, upd, del, trunc, root bool            // its options
	gencols                    string          // pubgencols (PostgreSQL 18+): "s" publishes stored generated columns
	tables                     map[uint32]bool // relation oids it holds (0: a schema)
	filtered                   bool            // a table has a row filter or a column list
}

// readPublication reads the publication name; one FOR ALL TABLES is a
// ConfigError.
func readPublication(ctx context.Context, pool *pgxpool.Pool, name string) (*publicationState, error) {
	st := &publicationState{exists: true, tables: map[uint32]bool{}}
	var allTables, schemas bool
	err := pool.QueryRow(ctx, sqlPublication, name).Scan(&allTables, &st.ins, &st.upd, &st.del, &st.trunc, &st.root, &schemas, &st.gencols)
	if errors.Is(err, pgx.ErrNoRows) {
		st.exists = false
		return st, nil
	} else if err != nil {
		return nil, fmt.Errorf("read publication %s: %w", name, err)
	}
	if allTables {
		return nil, configErr("publication %q is FOR ALL TABLES, which would publish tables whose deletes then fail (and Epitaph's own schemas): drop it, or pass another --publication", name)
	}
	q := sqlPublicationTables
	if !schemas {
		q = sqlPublicationTables14
	}
	rows, err := pool.Query(ctx, q, name)
	if err != nil {
		return nil, fmt.Errorf("read tables of publication %s: %w", name, err)
	}
	for rows.Next() {
		var (
			oid      uint32
			filtered bool
		)
		if err := rows.Scan(&oid, &filtered); err != nil {
			rows.Close()
			return nil, fmt.Errorf("read tables of publication %s: %w", name, err)
		}
		st.tables[oid] = true
		st.filtered = st.filtered || filtered
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read tables of publication %s: %w", name, err)
	}
	return st, nil
}

// statements are what makes the publication pub (as st has it) publish
// exactly list (the tables, sanitized; want their oids) with
// publicationOptions: none when it does.
func (st *publicationState) statements(pub string, list []string, want map[uint32]bool) []string {
	return st.statementsWith(pub, list, want, publicationOptions, st.ins || st.upd || !st.del || !st.trunc || !st.root)
}

// statementsWith is statements for a publication with options opts;
// reopt says its current options differ from them.
func (st *publicationState) statementsWith(pub string, list []string, want map[uint32]bool, opts string, reopt bool) []string {
	if !st.exists && len(list) > 0 {
		return []string{"CREATE PUBLICATION " + pub + " FOR TABLE " + strings.Join(list, ", ") + " WITH (" + opts + ")"}
	}
	if !st.exists {
		return []string{"CREATE PUBLICATION " + pub + " WITH (" + opts + ")"}
	}
	sameTables := len(st.tables) == len(want) && !st.filtered
	for oid := range st.tables {
		if !want[oid] {
			sameTables = false
		}
	}
	var stmts []string
	if !sameTables {
		if len(list) > 0 {
			stmts = append(stmts, "ALTER PUBLICATION "+pub+" SET TABLE "+strings.Join(list, ", "))
		} else {
			// SET needs at least one table: drop and recreate empty.
			stmts = append(stmts, "DROP PUBLICATION "+pub, "CREATE PUBLICATION "+pub+" WITH ("+opts+")")
		}
	}
	if reopt {
		stmts = append(stmts, "ALTER PUBLICATION "+pub+" SET ("+opts+")")
	}
	return stmts
}

// generatedOption makes pgoutput send the stored generated columns'
// values (PostgreSQL 18+), so a deleted row is archived as it was, not
// with values computed again.
const generatedOption = `publish_generated_columns = stored`

// hasGeneratedColumnsOption reports whether the server has
// publish_generated_columns (PostgreSQL 18+).
func hasGeneratedColumnsOption(ctx context.Context, pool *pgxpool.Pool) (bool, error) {
	var ok bool
	if err := pool.QueryRow(ctx, `SELECT current_setting('server_version_num')::int >= 180000`).Scan(&ok); err != nil {
		return false, fmt.Errorf("read server version: %w", err)
	}
	return ok, nil
}

// movesOptions are those of the moves publication (movesPublication): the
// inserts of the partitioned tables only, via their roots, so that a row an
// UPDATE moves to another partition (a delete and an insert in the WAL) is
// recognised as a move and not archived.
const movesOptions = `publish = 'insert', publish_via_partition_root = true`

// movesPublication names the publication that sends the inserts of the
// partitioned tables name publishes, within PostgreSQL's 63 bytes.
func movesPublication(name string) string {
	const suffix = "_moves"
	if len(name)+len(suffix) > 63 {
		name = name[:63-len(suffix)]
	}
	return name + suffix
}

// syncMovesPublication makes the moves publication of name hold exactly the
// partitioned tables of sel; created reports it did not exist before.
func syncMovesPublication(ctx context.Context, pool *pgxpool.Pool, name string, sel *tableSelection) (created bool, err error) {
	moves := movesPublication(name)
	cur, err := readPublication(ctx, pool, moves)
	if err != nil {
		return false, err
	}
	want := map[uint32]bool{}
	var list []string
	for _, t := range sel.tables {
		if t.kind == 'p' {
			want[t.oid] = true
			list = append(list, t.sanitized())
		}
	}
	opts, reopt := movesOptions, !cur.ins || cur.upd || cur.del || cur.trunc || !cur.root
	// pgoutput refuses a table two publications publish with different
	// publish_generated_columns: the same as the publication's.
	if gen, err := hasGeneratedColumnsOption(ctx, pool); err != nil {
		return false, err
	} else if gen {
		opts, reopt = opts+", "+generatedOption, reopt || cur.gencols != "s"
	}
	for _, s := range cur.statementsWith(pgx.Identifier{moves}.Sanitize(), list, want, opts, reopt) {
		if _, err := pool.Exec(ctx, s); err != nil {
			return false, fmt.Errorf("sync publication %s: %w", moves, err)
		}
	}
	return !cur.exists, nil
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
