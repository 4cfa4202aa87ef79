package capture

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"

	"github.com/epitaph-dev/epitaph/event"
)

// A partition dropped (DROP TABLE of a leaf) or detached (ALTER TABLE ..
// DETACH PARTITION) takes its rows out of its partitioned table without a
// row change in the WAL: nothing would be published, and readers would
// never learn the rows left. The catalog watch keeps the leaves of every
// published partitioned table; a leaf gone since its last look is written
// into the WAL as a partitionRemovedPrefix message, in a transaction of
// its own, and the stream publishes it as a truncate of the partitioned
// table in that transaction: the rows were removed without deletes, as
// with a TRUNCATE, and the archive records it the same way (a truncate in
// archive.gaps, which readers see and which does not hold readiness).
// Found at the catalog check after the command (the notify guard's signal
// for a DETACH, the catalog poll for a DROP), so its position is a little
// after the command's. The leaves are kept in leavesTable too, so a leaf
// removed while the capture was stopped is found at its next start (and
// recorded then); the message and the leaf's record row go in one
// transaction, so a crash between them records a leaf neither twice nor
// never.
const partitionRemovedPrefix = "epitaph.partition_removed"

// leavesTable keeps, per publication, the published partitioned tables'
// leaves at the capture's last look: a capture started again compares them
// with the catalog. In the capture's own schema; capture uninstall removes
// it.
const leavesTable = stateSchema + ".partition_leaves"

const sqlLeavesTable = `
CREATE SCHEMA IF NOT EXISTS ` + stateSchema + `;
CREATE TABLE IF NOT EXISTS ` + leavesTable + ` (
  publication text NOT NULL,
  relid oid NOT NULL,
  leaf text NOT NULL,
  root_schema text NOT NULL,
  root text NOT NULL,
  PRIMARY KEY (publication, relid))`

// sqlSaveLeaves makes the publication's ($1) record the leaves given
// (relids $2, names $3, their tables' schemas $4 and names $5). A write
// that changes nothing writes nothing.
const sqlSaveLeaves = `
WITH now (relid, leaf, root_schema, root) AS (
  SELECT * FROM unnest($2::oid[], $3::text[], $4::text[], $5::text[])
), gone AS (
  DELETE FROM ` + leavesTable + ` l WHERE l.publication = $1 AND NOT EXISTS (SELECT 1 FROM now WHERE now.relid = l.relid)
)
INSERT INTO ` + leavesTable + ` AS l (publication, relid, leaf, root_schema, root)
SELECT $1, relid, leaf, root_schema, root FROM now
ON CONFLICT (publication, relid) DO UPDATE SET leaf = excluded.leaf, root_schema = excluded.root_schema, root = excluded.root
WHERE (l.leaf, l.root_schema, l.root) IS DISTINCT FROM (excluded.leaf, excluded.root_schema, excluded.root)`

// leafRecord reads and writes leavesTable. Like the facts record, its
// failures never stop the capture: one that cannot be kept warns once,
// and a leaf removed while the capture is stopped is then not seen.
type leafRecord struct {
	readable, writable, warned bool
}

// openLeafRecord makes leavesTable when it is missing and says whether it can be read and written.
func (s *Service) openLeafRecord(ctx context.Context) *leafRecord {
	r := &leafRecord{}
	var exists bool
	err := s.pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, leavesTable).Scan(&exists)
	if err == nil && !exists {
		_, err = s.pool.Exec(ctx, sqlLeavesTable)
		exists = err == nil
	}
	if err == nil && exists {
		r.readable, r.writable, err = tablePrivileges(ctx, s.pool, leavesTable, "INSERT", "UPDATE", "DELETE")
		if err == nil && !r.writable {
			err = fmt.Errorf("permission denied: grant SELECT, INSERT, UPDATE, DELETE ON %s to the capture's role", leavesTable)
		}
	}
	if err != nil || !exists {
		s.warnLeafRecord(r, err)
	}
	return r
}

func (s *Service) warnLeafRecord(r *leafRecord, err error) {
	if r.warned {
		return
	}
	r.warned = true
	if err == nil {
		err = fmt.Errorf("the record is missing")
	}
	s.log.Warn("cannot keep the published partitions on the source (only in memory): a partition dropped or detached while the capture is stopped is not recorded",
		"table", leavesTable, "err", redactErr(err))
}

// loadLeaves reads the recorded leaves (nil when there is no record).
func (s *Service) loadLeaves(ctx context.Context, r *leafRecord) map[uint32]leafOf {
	if !r.readable {
		return nil
	}
	rows, err := s.pool.Query(ctx, `SELECT relid, leaf, root_schema, root FROM `+leavesTable+` WHERE publication = $1`, s.cfg.PublicationName)
	if err != nil {
		s.warnLeafRecord(r, err)
		return nil
	}
	out := map[uint32]leafOf{}
	var oid uint32
	var l leafOf
	if _, err := pgx.ForEachRow(rows, []any{&oid, &l.leaf, &l.schema, &l.root}, func() error {
		out[oid] = l
		return nil
	}); err != nil {
		s.warnLeafRecord(r, err)
		return nil
	}
	return out
}

// saveLeaves makes the record hold leaves.
func (s *Service) saveLeaves(ctx context.Context, r *leafRecord, leaves map[uint32]leafOf) {
	if !r.writable {
		return
	}
	oids := make([]uint32, 0, len(leaves))
	var names, schemas, roots []string
	for oid, l := range leaves {
		oids = append(oids, oid)
		names, schemas, roots = append(names, l.leaf), append(schemas, l.schema), append(roots, l.root)
	}
	if _, err := s.pool.Exec(ctx, sqlSaveLeaves, s.cfg.PublicationName, oids, names, schemas, roots); err != nil {
		s.warnLeafRecord(r, err)
	}
}

// removedLeaf is the content of a partitionRemovedPrefix message.
type removedLeaf struct {
	Schema string `json:"schema"` // the partitioned table's
	Table  string `json:"table"`
	Leaf   string `json:"leaf"` // schema.name of the partition
	How    string `json:"how"`  // "dropped" or "detached"
}

// leafOf is a leaf partition of a published partitioned table.
type leafOf struct {
	leaf         string // schema.name
	schema, root string // the partitioned table
}

// sqlPublishedLeaves lists the leaves of the partitioned tables the
// publication holds ($1), and once with a NULL leaf each such table
// without any (its last partition dropped or detached: still published).
const sqlPublishedLeaves = `
SELECT l.relid, l.leaf, rn.nspname, rc.relname
FROM pg_publication p
JOIN pg_publication_rel pr ON pr.prpubid = p.oid
JOIN pg_class rc ON rc.oid = pr.prrelid AND rc.relkind = 'p'
JOIN pg_namespace rn ON rn.oid = rc.relnamespace
LEFT JOIN LATERAL (
  SELECT t.relid::oid AS relid, quote_ident(ln.nspname) || '.' || quote_ident(lc.relname) AS leaf
  FROM pg_partition_tree(rc.oid) t
  JOIN pg_class lc ON lc.oid = t.relid
  JOIN pg_namespace ln ON ln.oid = lc.relnamespace
  WHERE t.isleaf AND t.relid <> rc.oid) l ON true
WHERE p.pubname = $1`

// trackLeaves reads the published leaves and writes a
// partitionRemovedPrefix message for each leaf of a table still published
// that is gone since the last look: this process's, or at its first, the
// record's (none on a first start ever).
func (s *Service) trackLeaves(ctx context.Context) error {
	if s.leafRec == nil {
		s.leafRec = s.openLeafRecord(ctx)
		s.leaves = s.loadLeaves(ctx, s.leafRec)
	}
	rows, err := s.pool.Query(ctx, sqlPublishedLeaves, s.cfg.PublicationName)
	if err != nil {
		return fmt.Errorf("read the published partitions: %w", err)
	}
	now := map[uint32]leafOf{}
	roots := map[string]bool{} // the published partitioned tables, with or without leaves
	var oid *uint32
	var leaf *string
	var l leafOf
	if _, err := pgx.ForEachRow(rows, []any{&oid, &leaf, &l.schema, &l.root}, func() error {
		roots[l.schema+"."+l.root] = true
		if oid != nil && leaf != nil {
			l.leaf = *leaf
			now[*oid] = l
		}
		return nil
	}); err != nil {
		return fmt.Errorf("read the published partitions: %w", err)
	}
	before := s.leaves
	for oid, l := range before {
		if n, ok := now[oid]; (ok && n.schema == l.schema && n.root == l.root) || !roots[l.schema+"."+l.root] {
			// Still there (a leaf now of another table left this one),
			// or its table is no longer published (dropped, renamed, or
			// removed with a gap of its own).
			continue
		}
		if err := s.recordLeafRemoved(ctx, oid, l); err != nil {
			return err
		}
	}
	if !maps.Equal(before, now) || before == nil {
		s.saveLeaves(ctx, s.leafRec, now)
	}
	s.leaves = now
	return nil
}

// recordLeafRemoved writes the partitionRemovedPrefix message of leaf l
// (oid) of a published table.
func (s *Service) recordLeafRemoved(ctx context.Context, oid uint32, l leafOf) error {
	var exists bool
	if err := s.pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_class WHERE oid = $1)`, oid).Scan(&exists); err != nil {
		return fmt.Errorf("look up partition %s: %w", l.leaf, err)
	}
	how := "dropped"
	if exists {
		how = "detached"
	}
	content, err := json.Marshal(removedLeaf{Schema: l.schema, Table: l.root, Leaf: l.leaf, How: how})
	if err != nil {
		return err
	}
	// The message and the leaf's record row go together.
	err = pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT pg_logical_emit_message(true, $1, $2::text)`, partitionRemovedPrefix, string(content)); err != nil {
			return err
		}
		if s.leafRec.writable {
			_, err := tx.Exec(ctx, `DELETE FROM `+leavesTable+` WHERE publication = $1 AND relid = $2`, s.cfg.PublicationName, oid)
			return err
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("record partition %s %s: %w", l.leaf, how, err)
	}
	s.log.Warn("partition "+how+": its rows left the partitioned table without deletes (not archived); recorded as a truncate of the table",
		"partition", l.leaf, "table", pgx.Identifier{l.schema, l.root}.Sanitize())
	return nil
}

// handleLeafRemoved publishes a partitionRemovedPrefix message as a
// truncate of the partitioned table, in the message's transaction. One
// outside a transaction, malformed, or naming a table the publication
// does not hold is ignored: anyone may write one.
func (st *streamer) handleLeafRemoved(ctx context.Context, m *pglogrepl.LogicalDecodingMessage) error {
	var r removedLeaf
	if err := json.Unmarshal(m.Content, &r); err != nil || r.Schema == "" || r.Table == "" || !m.Transactional || !st.inTx ||
		!st.s.wasPublished(r.Schema+"."+r.Table) {
		st.s.log.Warn("ignored an "+partitionRemovedPrefix+" message", "lsn", event.LSN(m.LSN).String())
		return nil
	}
	_, err := st.publishTruncate(ctx, r.Schema, r.Table, false, false, "truncate "+r.Schema+"."+r.Table+" (partition "+r.How+")")
	return err
}
