package retention

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/epitaph-dev/epitaph/internal/pgquote"
	"github.com/epitaph-dev/epitaph/projection/archive"
)

// dropLockTimeout bounds how long a drop waits for its locks: the
// partition (held by an apply writing to it, a reader, an erasure), the
// holds and the deliveries. Past it the partition is left to the next
// batch, and its rows to the row-by-row delete meanwhile.
const dropLockTimeout = 500 * time.Millisecond

// dropExpiredPartitions drops each partition of the version's rows table
// whose period is over and whose rows are all expired, none under a legal
// hold, none with an open (pending, in flight) delivery and none after the
// cursor of a cursor handler of its table (cursorHoldsSQL): a DROP costs
// milliseconds whatever the partition's size, where deleting its rows
// costs a write per row and leaves the table to vacuum. Each partition is
// decided and dropped in a transaction of its own that first locks it (no
// apply, erasure or reader meanwhile), the holds and the deliveries (no
// new hold, no delivery retried back to open meanwhile), then checks, so
// nothing the check cleared can change before the drop. The cursors are not
// locked: a cursor only moves forward (releasing rows), and a handler
// added meanwhile starts at the archive's horizon and is owed only the
// rows archived after it, which the locked partition cannot receive. With the rows go,
// as with the row-by-row delete, the snapshot documents rooted at them,
// the groups of their transactions (a transaction's rows share its
// commit_time, hence a partition) and their terminal deliveries unless
// another version's archive still holds the row. The default partition is
// never dropped. A rows table that is not partitioned has nothing to drop.
func dropExpiredPartitions(ctx context.Context, cp cleanupParams, vs archive.VersionSchema) error {
	parts, err := archive.Partitions(ctx, cp.pool, vs.Schema)
	if err != nil {
		return err
	}
	now := time.Now()
	for _, p := range parts {
		if p.To == nil || p.To.After(now) {
			continue // the default partition, or a period not over
		}
		if err := dropPartition(ctx, cp, vs, p.Name); err != nil {
			var pg *pgconn.PgError
			if errors.As(err, &pg) && (pg.Code == "55P03" || pg.Code == "40P01") { // lock not available, deadlock
				continue
			}
			return err
		}
	}
	return nil
}

// partitionKeptSQL says why a partition must stay, if it must: a row not
// expired (or never expiring), held, with an open delivery, or after the
// cursor of a cursor handler of its table (a pending delivery too).
const partitionKeptSQL = `
SELECT CASE
    WHEN EXISTS (SELECT 1 FROM %[1]s WHERE expires_at IS NULL) OR EXISTS (SELECT 1 FROM %[1]s WHERE expires_at > now())
        THEN 'unexpired'
    WHEN EXISTS (SELECT 1 FROM epitaph.legal_holds h WHERE EXISTS (
            SELECT 1 FROM %[1]s r WHERE r.schema_name = h.schema_name AND r.table_name = h.table_name
              AND (h.key = r.key OR r.row @> h.match)))
        THEN 'held'
    WHEN EXISTS (SELECT 1 FROM epitaph.deliveries d WHERE d.state IN ('pending', 'in_flight') AND EXISTS (
            SELECT 1 FROM %[1]s r WHERE r.source = d.source AND r.commit_lsn = d.commit_lsn AND r.seq = d.seq))
        THEN 'open delivery'
    WHEN ` + partitionCursorSQL + `
        THEN 'cursor handler'
    ELSE '' END`

func dropPartition(ctx context.Context, p cleanupParams, vs archive.VersionSchema, name string) error {
	all, timeout, res := p.all, p.timeout, p.res
	tbl := archive.Ident(vs.Schema, name)
	return pgx.BeginFunc(ctx, p.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, fmt.Sprintf(`SET LOCAL statement_timeout = %d; SET LOCAL lock_timeout = %d; SET LOCAL jit = off`,
			timeout.Milliseconds(), dropLockTimeout.Milliseconds())); err != nil {
			return fmt.Errorf("drop %s: %w", tbl, err)
		}
		var mine bool
		if err := tx.QueryRow(ctx, cleanupLockSQL, vs.Schema).Scan(&mine); err != nil {
			return fmt.Errorf("cleanup lock of %s: %w", vs.Schema, err)
		}
		if !mine {
			return nil // another cleaner is on this version
		}
		// First without locks: a partition that must stay (rows that
		// never expire, a hold, ...) is never locked exclusively, which
		// would queue its readers and writers behind a long reader for
		// the lock timeout on every batch. Skipping is always safe; a
		// partition cleared here is checked again under the locks.
		var why string
		if err := tx.QueryRow(ctx, fmt.Sprintf(partitionKeptSQL, tbl)).Scan(&why); err != nil {
			return fmt.Errorf("check %s: %w", tbl, err)
		}
		if why != "" {
			return nil
		}
		if _, err := tx.Exec(ctx, `LOCK TABLE `+tbl+` IN ACCESS EXCLUSIVE MODE;
LOCK TABLE epitaph.legal_holds IN SHARE MODE; LOCK TABLE epitaph.deliveries IN SHARE MODE`); err != nil {
			return fmt.Errorf("lock %s: %w", tbl, err)
		}
		if err := tx.QueryRow(ctx, fmt.Sprintf(partitionKeptSQL, tbl)).Scan(&why); err != nil {
			return fmt.Errorf("check %s: %w", tbl, err)
		}
		if why != "" {
			return nil
		}
		byTable := map[string]int{}
		// Grouped by the columns (not their concatenation), so that the
		// scan may be of the (schema_name, table_name, key) index alone.
		rows, err := tx.Query(ctx, `SELECT schema_name || '.' || table_name, count(*)::int FROM `+tbl+` GROUP BY schema_name, table_name`)
		if err != nil {
			return fmt.Errorf("count %s: %w", tbl, err)
		}
		var table string
		var n int
		if _, err := pgx.ForEachRow(rows, []any{&table, &n}, func() error { byTable[table] += n; return nil }); err != nil {
			return fmt.Errorf("count %s: %w", tbl, err)
		}
		var snaps, groups, dels int
		if vs.Snapshots {
			if err := tx.QueryRow(ctx, fmt.Sprintf(`
WITH snaps AS (
    DELETE FROM %[2]s s USING %[1]s r
    WHERE s.correlation_id = r.correlation_id AND s.source = r.source AND s.commit_lsn = r.commit_lsn AND s.root_seq = r.seq
    RETURNING 1
), groups AS (
    DELETE FROM %[3]s g
    WHERE g.correlation_id IN (SELECT correlation_id FROM %[1]s)
      AND NOT EXISTS (SELECT 1 FROM %[4]s o WHERE o.correlation_id = g.correlation_id AND o.tableoid <> %[5]s::regclass)
    RETURNING 1
)
SELECT (SELECT count(*)::int FROM snaps), (SELECT count(*)::int FROM groups)`,
				tbl, archive.Ident(vs.Schema, "snapshots"), archive.Ident(vs.Schema, "snapshot_groups"),
				archive.Ident(vs.Schema, "rows"), pgquote.Literal(tbl))).Scan(&snaps, &groups); err != nil {
				return fmt.Errorf("prune the snapshots of %s: %w", tbl, err)
			}
		}
		var others strings.Builder
		for _, o := range all {
			if o.Schema != vs.Schema {
				fmt.Fprintf(&others, "\n  AND NOT EXISTS (SELECT 1 FROM %s v WHERE v.source = r.source AND v.commit_lsn = r.commit_lsn AND v.seq = r.seq)", archive.Ident(o.Schema, "rows"))
			}
		}
		if err := tx.QueryRow(ctx, `WITH dels AS (
DELETE FROM epitaph.deliveries d USING `+tbl+` r
WHERE d.source = r.source AND d.commit_lsn = r.commit_lsn AND d.seq = r.seq
  AND d.state IN ('done', 'stopped', 'dead')`+others.String()+`
RETURNING 1) SELECT count(*)::int FROM dels`).Scan(&dels); err != nil {
			return fmt.Errorf("delete the deliveries of %s: %w", tbl, err)
		}
		if _, err := tx.Exec(ctx, `DROP TABLE `+tbl); err != nil {
			return fmt.Errorf("drop %s: %w", tbl, err)
		}
		total := 0
		for t, n := range byTable {
			res.ByTable[t] += n
			total += n
		}
		res.Deleted += total
		res.droppedRows += total
		if total > 0 {
			res.ByVersion[vs.Schema] += total
		}
		res.Snapshots += snaps
		res.Groups += groups
		res.Deliveries += dels
		res.Dropped = append(res.Dropped, vs.Schema+"."+name)
		return nil
	})
}
