package capture

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/pgquote"
)

// tableGap is the content of an event.PrefixGap message.
type tableGap struct {
	Schema string `json:"schema"`
	Table  string `json:"table"`
	Reason string `json:"reason"`
}

// msgPartitionTruncate warns of what PostgreSQL never sends: a partitioned
// table is published via its root, and pgoutput then leaves out a TRUNCATE
// of one of its partitions (not of the table itself) altogether. (A
// partition dropped or detached is noticed by the catalog watch:
// leaves.go.)
const msgPartitionTruncate = "TRUNCATE of a single partition of these partitioned tables is NOT captured: PostgreSQL does not send it when publishing via the root, so nothing is published and the rows are not archived; truncate the partitioned table itself (a truncate event), or DELETE"

const reasonLostIdentity = "removed from the publication: it lost its usable replica identity (no primary key and REPLICA IDENTITY DEFAULT, NOTHING, or a leaf partition without one), so its deletes would fail; its deletes are not captured until it is added again"

// kickCatalog asks the catalog watch for a check now (a Relation message
// says a published table changed). It never blocks.
func (s *Service) kickCatalog() {
	select {
	case s.catalogKick <- struct{}{}:
	default:
	}
}

// notifyGuard reports whether the capture installs the notify DDL guard,
// whose signals it follows.
func (s *Service) notifyGuard() bool {
	return s.cfg.InstallDDLGuard && s.cfg.DDLGuardMode != DDLGuardInline
}

// abortCatalogCheck cancels the catalog check running, if any: the notify
// guard's LISTEN was lost, and what took it most likely took the
// connection the check waits on, where it would wait for the source's TCP
// timeout (the pool hands out a connection used under a second ago
// without a ping), holding up the checks the LISTEN's return asks for.
// The watch checks again at once.
func (s *Service) abortCatalogCheck() {
	if cancel := s.catalogAbort.Load(); cancel != nil {
		(*cancel)()
	}
}

// catalogRetry is how soon a failed catalog check is tried again with the
// notify guard.
const catalogRetry = time.Second

// watchCatalog follows the source's tables while streaming: every
// CatalogPoll, after every Relation message and at every signal of the
// notify DDL guard it runs reconcile. With a negative CatalogPoll it only
// runs on the notify guard's signals (and without that guard not at all).
func (s *Service) watchCatalog(ctx context.Context) {
	defer s.bgWG.Done()
	var tick <-chan time.Time
	switch {
	case s.cfg.CatalogPoll >= 0:
		t := time.NewTicker(s.cfg.CatalogPoll)
		defer t.Stop()
		tick = t.C
	case !s.notifyGuard():
		return
	}
	failing := false
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick:
		case <-s.catalogKick:
		}
		cctx, cancel := context.WithCancel(ctx)
		s.catalogAbort.Store(&cancel)
		err := s.reconcileIfChanged(cctx)
		s.catalogAbort.Store(nil)
		aborted := cctx.Err() != nil
		cancel()
		switch {
		case err != nil && ctx.Err() != nil:
			return
		case err != nil && aborted:
			s.log.Info("catalog check abandoned: the source connection it waited on most likely died with the DDL guard's LISTEN; checking again")
			s.kickCatalog()
		case err != nil:
			s.m.catalogErrors.Inc()
			if _, ok := outage(err); !ok && !failing { // an outage has the stream loop's line
				s.log.Warn("catalog check failed; retrying at the next poll", "err", redactErr(err))
			} else {
				s.log.Debug("catalog check failed; retrying", "err", redactErr(err))
			}
			failing = true
			if s.notifyGuard() {
				// The guard's signal is spent: a table left for a lock held
				// elsewhere is tried again soon, not only at the next poll.
				time.AfterFunc(catalogRetry, s.kickCatalog)
			}
		default:
			failing = false
		}
	}
}

// sqlCatalogFingerprint sums up, in one query, everything reconcile's
// decisions depend on: the tables and partitions (kind, persistence,
// owner, replica identity), their primary key and replica identity
// indexes, the publication's tables and role memberships. Equal
// fingerprints: nothing to do, so the poll stays cheap on a catalog of
// thousands of tables.
const sqlCatalogFingerprint = `
SELECT md5(COALESCE((
  SELECT string_agg(c.oid::text || c.relkind::text || c.relpersistence::text || c.relreplident::text || c.relowner::text
                    || c.relispartition::text || c.relnamespace::text || c.relname, ',' ORDER BY c.oid)
  FROM pg_class c WHERE c.relkind IN ('r', 'p')), '') || '|' || COALESCE((
  SELECT string_agg(i.indexrelid::text || i.indrelid::text || i.indisprimary::text || i.indisreplident::text, ',' ORDER BY i.indexrelid)
  FROM pg_index i WHERE i.indisprimary OR i.indisreplident), '') || '|' || COALESCE((
  SELECT string_agg(pr.prrelid::text, ',' ORDER BY pr.prrelid)
  FROM pg_publication_rel pr JOIN pg_publication p ON p.oid = pr.prpubid WHERE p.pubname = $1), '') || '|' || COALESCE((
  SELECT string_agg(m.roleid::text || '>' || m.member::text, ',' ORDER BY m.roleid, m.member) FROM pg_auth_members m), ''))`

// reconcileIfChanged runs reconcile when the catalog's fingerprint moved
// since the last reconcile that succeeded.
func (s *Service) reconcileIfChanged(ctx context.Context) error {
	var fp string
	if err := s.pool.QueryRow(ctx, sqlCatalogFingerprint, s.cfg.PublicationName).Scan(&fp); err != nil {
		return fmt.Errorf("read catalog fingerprint: %w", err)
	}
	if fp == s.catalogFP {
		return nil
	}
	if err := s.reconcile(ctx); err != nil {
		return err
	}
	// The fingerprint from before: a change made while reconcile ran (or by
	// it) moves the next one, so the next poll looks again.
	s.catalogFP = fp
	return nil
}

// reconcile applies the publication rules to the catalog as it is now: a
// table or partition that fits the configuration and is safe is published
// (set FULL first with --set-replica-identity-full); a published table that
// is no longer safe is removed, with a gap recorded at that point of the
// WAL, so the application's DELETEs never fail. It only adds and removes:
// what the publication holds beyond that was settled at start.
func (s *Service) reconcile(ctx context.Context) error {
	cfg := &s.cfg
	sel, err := selectTables(ctx, s.pool, cfg.PublicationName, cfg.Tables, cfg.SetReplicaIdentityFull, true)
	if err != nil {
		return err
	}
	if len(sel.madeFull) > 0 {
		s.log.Info("set REPLICA IDENTITY FULL (--set-replica-identity-full)", "tables", sel.madeFull)
		s.m.madeFull.Add(float64(len(sel.madeFull)))
	}
	for _, sk := range sel.skipped {
		if strings.Contains(sk, unloggedPartition) && s.warnedOwner(sk) {
			s.log.Warn("table not captured", "table", sk)
		}
		if strings.Contains(sk, ": not set FULL: ") && s.warnedOwner("column list "+sk) {
			s.log.Warn("table not set REPLICA IDENTITY FULL: another publication publishes it with a column list, and FULL would make the application's UPDATEs and DELETEs fail", "table", sk)
		}
	}
	current, members, err := publicationMembers(ctx, s.pool, cfg.PublicationName)
	if err != nil {
		return err
	}
	if h := s.hooks; h != nil && h.afterMembers != nil {
		h.afterMembers()
	}
	pub := pgx.Identifier{cfg.PublicationName}.Sanitize()
	var busy []string                // tables whose change waited too long for a lock: the next poll tries again
	removedHere := map[string]bool{} // tables this reconcile removed (with their gap)
	for _, t := range sel.unsafe {
		if !current[t.oid] {
			continue
		}
		if err := removeTable(ctx, s.pool, pub, t, reasonLostIdentity); err != nil {
			if lockBusy(err) {
				busy = append(busy, t.qualified())
				continue
			}
			return err
		}
		removedHere[t.qualified()] = true
		s.m.tablesRemoved.Inc()
		s.log.Warn("table removed from the publication: it lost its usable replica identity, so its deletes would fail; a gap is recorded and it is added again once it has one (a primary key, or REPLICA IDENTITY FULL)",
			"table", t.qualified(), "relations", t.notFull)
	}
	added, err := s.addNewTables(ctx, pub, sel, current)
	if err != nil {
		return err
	}
	busy = append(busy, added...)
	if len(busy) > 0 {
		// Not remembered as known: the next poll handles them as new, gap
		// included.
		return fmt.Errorf("publication %s not changed for %s: another transaction (a prepared one, or a long migration) holds a lock it needs; retrying",
			cfg.PublicationName, strings.Join(busy, ", "))
	}
	if err := s.addMoves(ctx, sel); err != nil {
		return err
	}
	if err := s.cat.remember(ctx, sel.oids()); err != nil {
		return err
	}
	pubTables, err := publicationTables(ctx, s.pool, cfg.PublicationName)
	if err != nil {
		return err
	}
	// A table the publication held when this reconcile began and someone
	// else removed while it ran is still "published at the last look": the
	// next reconcile, which adds it again, then records its gap (read only
	// now, it would look new to the publication, and get none).
	for _, m := range members {
		if !removedHere[m] && !slices.Contains(pubTables, m) {
			pubTables = append(pubTables, m)
		}
	}
	slices.Sort(pubTables)
	s.mu.Lock()
	s.sel, s.pubTables = sel, pubTables
	s.mu.Unlock()
	s.m.withoutFull.Set(float64(len(sel.keyOnly)))
	return s.trackLeaves(ctx)
}

// sqlCatalogLockTimeout bounds the wait of the capture's own publication
// changes for a lock: a prepared transaction may hold the publication for
// hours, and the catalog poll must keep serving every other table.
const sqlCatalogLockTimeout = "SET LOCAL lock_timeout = '2s'"

// lockBusy reports whether err is a lock wait that timed out.
func lockBusy(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "55P03"
}

// addNewTables adds the selected tables the publication lacks (current);
// busy lists those whose add waited too long for a lock.
func (s *Service) addNewTables(ctx context.Context, pub string, sel *tableSelection, current map[uint32]bool) (busy []string, err error) {
	for _, t := range sel.tables {
		if current[t.oid] {
			continue
		}
		if s.cfg.RefuseKeyOnly && t.identity != "full" {
			if s.warnedOwner("key-only " + t.qualified()) {
				s.log.Warn("new table not captured: it is not REPLICA IDENTITY FULL, its deletes would carry only the key", "table", t.qualified(),
					"fix", "ALTER TABLE "+t.sanitized()+" REPLICA IDENTITY FULL, or restart the capture with --set-replica-identity-full or --allow-key-only")
			}
			continue
		}
		if !t.owned {
			if s.warnedOwner(t.qualified()) {
				s.log.Warn("new table not captured: the capture role is not a member of its owner role", "table", t.qualified(),
					"fix", "GRANT <owner role of "+t.sanitized()+"> TO <capture role>")
			}
			continue
		}
		// The same table (oid) in the publication at the last look: removed
		// since by someone else.
		knew := s.knewTable(t.oid)
		removed := knew && s.wasPublished(t.qualified())
		lost, err := addTable(ctx, s.pool, pub, t, !knew, removed)
		if err != nil {
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) && (pgErr.Code == "42P01" || pgErr.Code == "42710") {
				continue // dropped meanwhile, or added meanwhile (the DDL guard)
			}
			if lockBusy(err) {
				busy = append(busy, t.qualified())
				continue
			}
			return busy, fmt.Errorf("add %s to publication %s: %w", t.qualified(), s.cfg.PublicationName, err)
		}
		switch {
		case removed:
			s.log.Warn("table was removed from the publication by someone else: its deletes while it was out are not captured; a gap naming it is recorded",
				"table", t.qualified())
		case lost > 0:
			s.log.Warn("new table had deletes before it was published: they are not captured; a gap naming it is recorded",
				"table", t.qualified(), "deleted_rows", lost)
		}
		s.m.tablesAdded.Inc()
		s.log.Info("table added to the publication: its deletes are captured from now on", "table", t.qualified(), "identity", t.identity)
		if t.kind == 'p' {
			s.log.Warn(msgPartitionTruncate, "tables", []string{t.qualified()})
		}
	}
	return busy, nil
}

// warnedOwner reports whether a warning about table is due (once per
// table); a key of its own ("key-only " + table) makes another warning once.
func (s *Service) warnedOwner(table string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ownerWarned == nil {
		s.ownerWarned = map[string]bool{}
	}
	if s.ownerWarned[table] {
		return false
	}
	s.ownerWarned[table] = true
	return true
}

// sqlDeletedBefore counts the rows deleted from a table (and its
// partitions) as the server's statistics have them: they reach the
// statistics up to seconds after the deleting transaction, and count
// aborted deletes too.
const sqlDeletedBefore = `
SELECT coalesce(sum(pg_stat_get_tuples_deleted(r.relid)), 0)::bigint
FROM (SELECT $1::oid::regclass AS relid UNION SELECT relid FROM pg_partition_tree($1::oid::regclass)) r`

const reasonDeletedBefore = "deleted before it was published: rows were deleted from this new table before the catalog poll added it to the publication, and those deletes are not captured"

const reasonRemovedElsewhere = "removed from the publication by someone else: its deletes from the removal until the catalog poll added it again are not captured"

// addTable adds t to the publication pub. For a table new to the capture
// (fresh) it also reads how many rows the statistics say were deleted from
// it and, when any were, writes a gap naming it in the same transaction:
// a new table's deletes before it was published are never silent. A table
// the publication had and someone else removed (removed) gets a gap
// whatever the statistics say: they cannot tell when it was out.
func addTable(ctx context.Context, pool *pgxpool.Pool, pub string, t *tableInfo, fresh, removed bool) (lost int64, err error) {
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, sqlCatalogLockTimeout); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, "ALTER PUBLICATION "+pub+" ADD TABLE "+t.member()); err != nil {
			return err
		}
		reason := reasonRemovedElsewhere
		if !removed {
			if !fresh {
				return nil
			}
			if err := tx.QueryRow(ctx, sqlDeletedBefore, t.oid).Scan(&lost); err != nil {
				return err
			}
			if lost == 0 {
				return nil
			}
			reason = reasonDeletedBefore
		}
		content, err := json.Marshal(tableGap{Schema: t.schema, Table: t.name, Reason: reason})
		if err != nil {
			return err
		}
		_, err = tx.Exec(ctx, `SELECT pg_logical_emit_message(true, $1, $2::text)`, event.PrefixGap, string(content))
		return err
	})
	return lost, err
}

// wasPublished reports whether the publication had the table (schema.name)
// at the capture's last look at it (start, or the last catalog check).
func (s *Service) wasPublished(table string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Contains(s.pubTables, table)
}

// knewTable reports whether the capture's last selection held the table
// (published, refused or unsafe): one it knew is not new, and its deletes
// before were accounted for (captured, or a gap when it was removed).
func (s *Service) knewTable(oid uint32) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.sel == nil {
		return false
	}
	for _, t := range s.sel.tables {
		if t.oid == oid {
			return true
		}
	}
	for _, t := range s.sel.unsafe {
		if t.oid == oid {
			return true
		}
	}
	return false
}

// addMoves adds the partitioned tables the publication holds and its
// moves publication lacks (new ones, or added by the DDL guard) to the
// latter, so their rows moved by an UPDATE are recognised.
func (s *Service) addMoves(ctx context.Context, sel *tableSelection) error {
	name := s.cfg.PublicationName
	inPub, err := publicationOIDs(ctx, s.pool, name)
	if err != nil {
		return err
	}
	inMoves, err := publicationOIDs(ctx, s.pool, movesPublication(name))
	if err != nil {
		return err
	}
	moves := pgx.Identifier{movesPublication(name)}.Sanitize()
	for _, t := range sel.tables {
		if t.kind != 'p' || !inPub[t.oid] || inMoves[t.oid] {
			continue
		}
		err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, sqlCatalogLockTimeout); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, "ALTER PUBLICATION "+moves+" ADD TABLE "+t.sanitized())
			return err
		})
		if err != nil {
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) && (pgErr.Code == "42P01" || pgErr.Code == "42710" || pgErr.Code == "42704" || pgErr.Code == "42501") {
				continue // dropped meanwhile, added meanwhile, no moves publication, or not ours to change (logged at start)
			}
			return fmt.Errorf("add %s to publication %s: %w", t.qualified(), movesPublication(name), err)
		}
	}
	return nil
}

// publicationMembers is publicationOIDs with the members' names
// ("schema.table"), read in the same statement.
func publicationMembers(ctx context.Context, pool *pgxpool.Pool, name string) (map[uint32]bool, []string, error) {
	rows, err := pool.Query(ctx, `SELECT pr.prrelid, n.nspname || '.' || c.relname
		FROM pg_publication_rel pr JOIN pg_publication p ON p.oid = pr.prpubid
		JOIN pg_class c ON c.oid = pr.prrelid JOIN pg_namespace n ON n.oid = c.relnamespace
		WHERE p.pubname = $1`, name)
	if err != nil {
		return nil, nil, fmt.Errorf("read tables of publication %s: %w", name, err)
	}
	oids := map[uint32]bool{}
	var names []string
	var oid uint32
	var member string
	if _, err := pgx.ForEachRow(rows, []any{&oid, &member}, func() error {
		oids[oid] = true
		names = append(names, member)
		return nil
	}); err != nil {
		return nil, nil, fmt.Errorf("read tables of publication %s: %w", name, err)
	}
	return oids, names, nil
}

func publicationOIDs(ctx context.Context, pool *pgxpool.Pool, name string) (map[uint32]bool, error) {
	oids, _, err := publicationMembers(ctx, pool, name)
	return oids, err
}

// removeTable drops t from the publication and writes the gap message in
// the same transaction: the gap is in the WAL exactly when the removal is.
func removeTable(ctx context.Context, pool *pgxpool.Pool, pub string, t *tableInfo, reason string) error {
	content, err := json.Marshal(tableGap{Schema: t.schema, Table: t.name, Reason: reason})
	if err != nil {
		return fmt.Errorf("encode gap of %s: %w", t.qualified(), err)
	}
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, sqlCatalogLockTimeout); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, "ALTER PUBLICATION "+pub+" DROP TABLE "+t.sanitized()); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `SELECT pg_logical_emit_message(true, $1, $2::text)`, event.PrefixGap, string(content))
		return err
	})
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && (pgErr.Code == "42P01" || pgErr.Code == "42704") {
		return nil // dropped, or removed meanwhile (the DDL guard)
	}
	if err != nil {
		return fmt.Errorf("remove %s from publication %s: %w", t.qualified(), pub, err)
	}
	return nil
}

// guardTriggerName is the event trigger of the DDL guard of a publication.
func guardTriggerName(pub string) string { return "epitaph_ddl_guard_" + pub }

func guardFunction(pub string) string {
	return pgx.Identifier{"epitaph", "ddl_guard_" + pub}.Sanitize()
}

// sqlDDLGuard is the DDL guard's function: at the end of a DDL command that
// can change what the publication may hold (the event trigger's tags,
// guardTags) it applies reconcile's rules to the tables that command
// touched (%[1]s: the publication's name as a literal; %[2]s: the
// configured tables as a text[] literal, NULL for every safe table; %[3]s:
// set FULL, true or false; %[4]s the gap message prefix and %[5]s its
// reason, as literals; %[6]s the function; %[7]s: whether a table that is
// not FULL may be added, true or false). SECURITY DEFINER: the
// application's role may not own the publication.
//
// It runs inside the application's transaction, so it must never make that
// DDL fail, wait or take measurably longer:
//   - it looks only at the tables of the command (their partition root, an
//     index's table; after DROP INDEX, the tables left with a replica
//     identity index that is gone), first by reading the catalogs only:
//     no lock on a table or the publication, no subtransaction, no
//     setting changed, and queries with scalar parameters whose plans stay
//     cached for the session (a query taking an array, or whose custom
//     plan can leave out a branch, is planned anew at every call, which
//     cost more than the rest of the guard). Most DDL returns there;
//   - only with a table to change (or a partitioned table, whose leaves are
//     locked to be listed) does it enter a block that catches every error
//     (a WARNING; a lock given up, a NOTICE) with lock_timeout set to
//     guardLockTimeout for the block alone: a lock another session or a
//     prepared transaction holds (the publication, after it changed it in
//     a transaction still open) is given up at once, and the table is left
//     to the capture's catalog poll. The application's lock_timeout is put
//     back at the end of the block.
//
// A table it leaves is published by the catalog poll once the lock is
// gone, with a gap naming it when rows were deleted from it before.
const sqlDDLGuard = `
CREATE OR REPLACE FUNCTION %[6]s() RETURNS event_trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog AS $guard$
DECLARE
  v_pub     constant text    := %[1]s;
  wanted    constant text[]  := %[2]s;
  set_full  constant boolean := %[3]s;
  key_ok    constant boolean := %[7]s;
  targets oid[];
  seen oid[] := '{}';
  x oid;
  leaf oid;
  leaves oid[];
  c record;
  l record;
  unsafe boolean;
  all_full boolean;
  saved_timeout text;
BEGIN
  IF current_setting('epitaph.ddl_guard_running', true) = 'on' THEN
    RETURN;
  END IF;
  -- Until a table needs a change: reading only, no lock taken, no
  -- subtransaction, no setting changed. Most DDL returns from here. Every
  -- query has scalar parameters and no branch a parameter could remove,
  -- so its plan stays cached for the session.
  IF TG_TAG = 'DROP INDEX' THEN
    -- A replica identity index dropped: the tables left without it.
    targets := ARRAY(
      SELECT COALESCE(pg_partition_root(r.oid), r.oid) FROM pg_class r
      WHERE r.relreplident = 'i' AND r.relkind IN ('r', 'p')
        AND NOT EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = r.oid AND i.indisreplident));
  ELSE
    targets := ARRAY(
      SELECT COALESCE(pg_partition_root(s.relid), s.relid)
      FROM (SELECT COALESCE((SELECT i.indrelid FROM pg_index i WHERE i.indexrelid = d.objid), d.objid) AS relid
            FROM pg_event_trigger_ddl_commands() d WHERE d.classid = 'pg_class'::regclass) s);
  END IF;
  FOREACH x IN ARRAY targets LOOP
    -- A table and its index, or two partitions of one root: once.
    CONTINUE WHEN x = ANY (seen);
    seen := seen || x;
    SELECT r.relkind, r.relreplident, n.nspname, r.relname,
           r.relkind IN ('r', 'p') AND NOT r.relispartition AND r.relpersistence = 'p'
             AND n.nspname NOT IN ('information_schema', 'epitaph', 'archive', 'epitaph_capture')
             AND n.nspname NOT LIKE 'pg\_%%' AND n.nspname !~ '^archive_v[0-9]+$' AS eligible,
           -- Not EXISTS: the planner may hash a whole small catalog for it
           -- at every call.
           (SELECT true FROM pg_publication_rel pr WHERE pr.prrelid = r.oid AND pr.prpubid = p.oid LIMIT 1) IS NOT NULL AS published,
           CASE r.relreplident
             -- FULL with a virtual generated column (PostgreSQL 18), which no
             -- publication sends: its DELETEs would fail once published.
             WHEN 'f' THEN (SELECT true FROM pg_attribute a WHERE a.attrelid = r.oid AND a.attnum > 0 AND NOT a.attisdropped
                             AND a.attgenerated = 'v' LIMIT 1) IS NOT NULL
             WHEN 'd' THEN (SELECT true FROM pg_index i WHERE i.indrelid = r.oid AND i.indisprimary LIMIT 1) IS NULL
             WHEN 'i' THEN (SELECT true FROM pg_index i WHERE i.indrelid = r.oid AND i.indisreplident LIMIT 1) IS NULL
             ELSE true END AS unsafe
      INTO c
      FROM pg_class r JOIN pg_namespace n ON n.oid = r.relnamespace
      CROSS JOIN (SELECT p.oid FROM pg_publication p WHERE p.pubname = v_pub) p
      WHERE r.oid = x;
    -- Not found: no such table, or no publication.
    CONTINUE WHEN NOT FOUND OR NOT c.eligible;
    CONTINUE WHEN NOT c.published AND wanted IS NOT NULL AND NOT ((c.nspname || '.' || c.relname) = ANY (wanted));
    -- A partitioned table's leaves are read below, under lock_timeout
    -- (listing them locks them).
    CONTINUE WHEN c.relkind = 'r'
      AND NOT ((set_full AND c.relreplident <> 'f') OR (c.unsafe AND c.published)
               OR (NOT c.unsafe AND NOT c.published AND (key_ok OR c.relreplident = 'f')));
    CONTINUE WHEN EXISTS (SELECT 1 FROM pg_depend d WHERE d.classid = 'pg_class'::regclass AND d.objid = x AND d.deptype = 'e');
    unsafe := c.unsafe;
    all_full := c.relreplident = 'f';
    IF saved_timeout IS NULL THEN
      saved_timeout := current_setting('lock_timeout');
    END IF;
    BEGIN
      -- A lock held elsewhere is given up at once and the table left to
      -- the capture's catalog poll; the application's lock_timeout is put
      -- back at the end (a failed block puts it back itself).
      PERFORM set_config('lock_timeout', '` + guardLockTimeout + `', true);
      IF c.relkind = 'p' OR set_full THEN
        -- ONLY: an inheritance parent's children are candidates of their own.
        IF c.relkind = 'p' THEN
          leaves := x || ARRAY(SELECT pt.relid FROM pg_partition_tree(x) pt WHERE pt.isleaf);
        ELSE
          leaves := ARRAY[x];
        END IF;
        unsafe := false;
        all_full := true;
        FOREACH leaf IN ARRAY leaves LOOP
          SELECT rn.nspname, r.relname, r.relreplident,
                 EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = r.oid AND i.indisprimary) AS has_pk,
                 EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = r.oid AND i.indisreplident) AS has_idx,
                 -- PostgreSQL 18: no publication sends a virtual generated
                 -- column, so FULL would make the table's DELETEs fail.
                 EXISTS (SELECT 1 FROM pg_attribute a WHERE a.attrelid = r.oid AND a.attnum > 0
                          AND NOT a.attisdropped AND a.attgenerated = 'v') AS has_virtual
            INTO l
            FROM pg_class r JOIN pg_namespace rn ON rn.oid = r.relnamespace WHERE r.oid = leaf;
          CONTINUE WHEN NOT FOUND;
          IF l.relreplident <> 'f' AND set_full AND NOT l.has_virtual THEN
            BEGIN
              -- The guard's own ALTER TABLE runs it again: it returns at once.
              PERFORM set_config('epitaph.ddl_guard_running', 'on', true);
              -- Recorded first, for capture uninstall: never FULL without it.
              INSERT INTO epitaph_capture.replica_identity (publication, relid, relation, identity, index_name)
              VALUES (v_pub, leaf, format('%%I.%%I', l.nspname, l.relname), l.relreplident,
                      (SELECT ic.relname FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid
                        WHERE i.indrelid = leaf AND i.indisreplident))
              ON CONFLICT (publication, relid) DO NOTHING;
              EXECUTE format('ALTER TABLE %%I.%%I REPLICA IDENTITY FULL', l.nspname, l.relname);
              PERFORM set_config('epitaph.ddl_guard_running', 'off', true);
              RAISE NOTICE 'epitaph: set REPLICA IDENTITY FULL on %%.%% (--set-replica-identity-full)', l.nspname, l.relname;
              CONTINUE;
            EXCEPTION WHEN lock_not_available THEN
              RAISE NOTICE 'epitaph: %%.%% is in use by another transaction: REPLICA IDENTITY FULL is left to the capture', l.nspname, l.relname;
            WHEN OTHERS THEN
              RAISE WARNING 'epitaph: could not set REPLICA IDENTITY FULL on %%.%%: %%', l.nspname, l.relname, SQLERRM;
            END;
          END IF;
          IF NOT ((l.relreplident = 'f' AND NOT l.has_virtual) OR (l.relreplident = 'd' AND l.has_pk) OR (l.relreplident = 'i' AND l.has_idx)) THEN
            unsafe := true;
          END IF;
          IF l.relreplident <> 'f' THEN
            all_full := false;
          END IF;
        END LOOP;
      END IF;
      IF unsafe AND c.published THEN
        EXECUTE format('ALTER PUBLICATION %%I DROP TABLE %%I.%%I', v_pub, c.nspname, c.relname);
        PERFORM pg_logical_emit_message(true, %[4]s,
          json_build_object('schema', c.nspname, 'table', c.relname, 'reason', %[5]s)::text);
        RAISE WARNING 'epitaph: %%.%% removed from publication %%: it has no usable replica identity, its deletes would fail (a gap is recorded)', c.nspname, c.relname, v_pub;
      ELSIF NOT unsafe AND NOT c.published AND (key_ok OR all_full) THEN
        EXECUTE format('ALTER PUBLICATION %%I ADD TABLE %%s%%I.%%I', v_pub,
          CASE WHEN c.relkind = 'r' THEN 'ONLY ' ELSE '' END, c.nspname, c.relname);
      END IF;
      PERFORM set_config('lock_timeout', saved_timeout, true);
    EXCEPTION WHEN lock_not_available THEN
      IF unsafe AND c.published THEN
        RAISE WARNING 'epitaph: %%.%% has no usable replica identity but publication %% is in use by another transaction: its DELETEs fail until the capture''s catalog poll removes it, once that transaction ends', c.nspname, c.relname, v_pub;
      ELSE
        RAISE NOTICE 'epitaph: publication %% or %%.%% is in use by another transaction: %%.%% is left to the capture''s catalog poll', v_pub, c.nspname, c.relname, c.nspname, c.relname;
      END IF;
    WHEN OTHERS THEN
      -- The application's DDL never fails because of the guard.
      RAISE WARNING 'epitaph: DDL guard could not update publication %% for %%.%%: %%', v_pub, c.nspname, c.relname, SQLERRM;
    END;
  END LOOP;
END
$guard$`

// guardLockTimeout is the guard's lock_timeout: the least PostgreSQL
// takes, so a lock held elsewhere is given up at once (NOWAIT).
const guardLockTimeout = "1ms"

// guardTags are the commands the guard runs after: the ones that create a
// table, change a table's key, identity, partitions, schema or name, or
// drop an index (a replica identity index). Any other DDL pays nothing.
var guardTags = []string{"CREATE TABLE", "CREATE TABLE AS", "SELECT INTO", "ALTER TABLE", "DROP INDEX"}

// guardChannel is the channel the notify guard of a publication signals on
// (at most 63 bytes, as PostgreSQL's identifiers: a longer one would make
// pg_notify fail, and with it the application's DDL).
func guardChannel(pub string) string {
	ch := "epitaph_ddl_" + pub
	if len(ch) <= 63 {
		return ch
	}
	sum := sha256.Sum256([]byte(pub))
	return "epitaph_ddl_" + hex.EncodeToString(sum[:16])
}

// guardMessagePrefix is the transactional logical message the notify guard
// writes instead of a notification when the server allows prepared
// transactions (a transaction that ran NOTIFY cannot be prepared): the
// capture decodes it once the transaction commits and checks the catalog.
const guardMessagePrefix = "epitaph.ddl"

// sqlNotifyGuard is the notify guard's function (%[1]s: the function;
// %[2]s: the channel, %[3]s: the message prefix, as literals): it only
// signals the capture, which checks the catalog once the DDL's transaction
// has committed. It reads no catalog, takes no lock and changes nothing,
// so the application's DDL cannot wait or fail on it.
//
// A notification is sent at commit and delivered once the transaction is
// visible; but a transaction that ran NOTIFY cannot be prepared, so with
// prepared transactions enabled (max_prepared_transactions above 0) it
// writes a transactional logical message instead, which the capture
// decodes from its slot at the commit (or COMMIT PREPARED).
//
// SECURITY DEFINER (writing a logical message needs the REPLICATION
// attribute) with every name schema-qualified instead of a SET search_path
// clause, which would cost a setting saved and restored at every call: the
// application's search_path cannot put a function or operator of its own
// in place of these (pg_temp is never searched for either).
const sqlNotifyGuard = `
CREATE OR REPLACE FUNCTION %[1]s() RETURNS event_trigger
LANGUAGE plpgsql SECURITY DEFINER AS $guard$
BEGIN
  IF pg_catalog.current_setting('max_prepared_transactions') OPERATOR(pg_catalog.=) '0' THEN
    PERFORM pg_catalog.pg_notify(%[2]s, '');
  ELSE
    PERFORM pg_catalog.pg_logical_emit_message(true, %[3]s, '');
  END IF;
END
$guard$`

// InstallDDLGuard (re)creates the DDL guard of cfg's publication in the
// mode cfg.DDLGuardMode (notify when empty): its function in schema
// epitaph and an event trigger on ddl_command_end, replacing the other
// mode's. It needs a superuser (event triggers do).
func InstallDDLGuard(ctx context.Context, pool *pgxpool.Pool, cfg *Config) error {
	var super bool
	if err := pool.QueryRow(ctx, `SELECT rolsuper FROM pg_roles WHERE rolname = current_user`).Scan(&super); err != nil {
		return fmt.Errorf("install DDL guard: %w", err)
	}
	if !super {
		return configErr("--install-ddl-guard needs a superuser (event triggers do): run the capture once as a superuser with it, or leave it off and rely on the catalog poll (--catalog-poll)")
	}
	var fn string
	stmts := []string{"CREATE SCHEMA IF NOT EXISTS epitaph"}
	switch cfg.DDLGuardMode {
	case DDLGuardNotify, "":
		fn = fmt.Sprintf(sqlNotifyGuard, guardFunction(cfg.PublicationName), pgquote.Literal(guardChannel(cfg.PublicationName)),
			pgquote.Literal(guardMessagePrefix))
	case DDLGuardInline:
		var err error
		if fn, err = inlineGuard(cfg); err != nil {
			return err
		}
		if cfg.SetReplicaIdentityFull {
			stmts = append(stmts, sqlIdentityTable) // where the guard records what it sets FULL
		}
	default:
		return &ConfigError{Msg: fmt.Sprintf("DDL guard mode %q: use %s or %s", cfg.DDLGuardMode, DDLGuardNotify, DDLGuardInline)}
	}
	trigger := pgx.Identifier{guardTriggerName(cfg.PublicationName)}.Sanitize()
	var tags []string
	for _, tag := range guardTags {
		tags = append(tags, pgquote.Literal(tag))
	}
	tagList := strings.Join(tags, ", ")
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		for _, stmt := range append(stmts,
			// One function per publication whatever the mode: the mode
			// installed last replaces the other's.
			fn,
			"DROP EVENT TRIGGER IF EXISTS "+trigger,
			"CREATE EVENT TRIGGER "+trigger+" ON ddl_command_end WHEN TAG IN ("+tagList+") EXECUTE FUNCTION "+guardFunction(cfg.PublicationName)+"()",
		) {
			if _, err := tx.Exec(ctx, stmt); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("install DDL guard: %w", err)
	}
	return nil
}

// inlineGuard is the inline guard's function for cfg.
func inlineGuard(cfg *Config) (string, error) {
	wanted := "NULL"
	if len(cfg.Tables) > 0 {
		var names []string
		for _, n := range cfg.Tables {
			schema, table, err := splitTable(n)
			if err != nil {
				return "", &ConfigError{Msg: err.Error()}
			}
			names = append(names, schema+"."+table)
		}
		slices.Sort(names)
		// A text[] constant: no query at every call.
		quoted := make([]string, len(names))
		for i, n := range names {
			quoted[i] = `"` + strings.NewReplacer(`\`, `\\`, `"`, `\"`).Replace(n) + `"`
		}
		wanted = pgquote.Literal("{"+strings.Join(quoted, ",")+"}") + "::text[]"
	}
	return fmt.Sprintf(sqlDDLGuard, pgquote.Literal(cfg.PublicationName), wanted, fmt.Sprint(cfg.SetReplicaIdentityFull),
		pgquote.Literal(event.PrefixGap), pgquote.Literal(reasonLostIdentity), guardFunction(cfg.PublicationName),
		fmt.Sprint(!cfg.RefuseKeyOnly)), nil
}
