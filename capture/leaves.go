package capture

import (
	"context"
	"encoding/json"
	"fmt"

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
// after the command's; a leaf dropped while the capture is stopped is not
// seen.
const partitionRemovedPrefix = "epitaph.partition_removed"

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
// publication holds ($1).
const sqlPublishedLeaves = `
SELECT l.relid::oid, quote_ident(ln.nspname) || '.' || quote_ident(lc.relname), rn.nspname, rc.relname
FROM pg_publication p
JOIN pg_publication_rel pr ON pr.prpubid = p.oid
JOIN pg_class rc ON rc.oid = pr.prrelid AND rc.relkind = 'p'
JOIN pg_namespace rn ON rn.oid = rc.relnamespace
CROSS JOIN LATERAL pg_partition_tree(rc.oid) l
JOIN pg_class lc ON lc.oid = l.relid
JOIN pg_namespace ln ON ln.oid = lc.relnamespace
WHERE p.pubname = $1 AND l.isleaf AND l.relid <> rc.oid`

// trackLeaves reads the published leaves and, unless this is the first
// look, writes a partitionRemovedPrefix message for each leaf of a table
// still published that is gone since the last one.
func (s *Service) trackLeaves(ctx context.Context) error {
	rows, err := s.pool.Query(ctx, sqlPublishedLeaves, s.cfg.PublicationName)
	if err != nil {
		return fmt.Errorf("read the published partitions: %w", err)
	}
	now := map[uint32]leafOf{}
	roots := map[string]bool{}
	var oid uint32
	var l leafOf
	if _, err := pgx.ForEachRow(rows, []any{&oid, &l.leaf, &l.schema, &l.root}, func() error {
		now[oid] = l
		roots[l.schema+"."+l.root] = true
		return nil
	}); err != nil {
		return fmt.Errorf("read the published partitions: %w", err)
	}
	before := s.leaves
	for oid, l := range before {
		if _, ok := now[oid]; ok || !roots[l.schema+"."+l.root] {
			// Still there, or its table is no longer published (dropped,
			// or removed with a gap of its own).
			continue
		}
		if err := s.recordLeafRemoved(ctx, oid, l); err != nil {
			return err
		}
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
	if _, err := s.pool.Exec(ctx, `SELECT pg_logical_emit_message(true, $1, $2::text)`, partitionRemovedPrefix, string(content)); err != nil {
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
