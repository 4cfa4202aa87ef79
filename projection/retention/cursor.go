package retention

import "github.com/epitaph-dev/epitaph/handler"

// cursorHoldsSQL is, per source table, the smallest cursor position
// (commit_lsn, seq) of the table's cursor handlers (handler.Def.UsesCursor:
// webhooks that batch without revalidation): a cursor handler's pending
// deliveries are the archived rows of its table after its cursor, with no
// row in epitaph.deliveries until they settle, so every row of the table
// after that position is kept, expired or not, as a row with an open
// delivery is. Its claimed batch in flight is after the cursor too. A
// disabled handler holds (its rows wait for it, as a disabled handler's
// queued deliveries do); a revoked one does not (revoking stops its
// pending work), nor a removed one (its handler row is gone, whatever is
// left of its cursor). A handler row that no longer uses a cursor holds
// nothing either, cursor row or not.
//
// A few rows (one per table with cursor handlers), computed once per
// statement in the statement's own snapshot: a handler added meanwhile
// is seen by every statement that sees the rows archived after it. The
// position is compared without the source (the cursor is the projector's
// source's): in a target fed by several sources a table's rows of other
// sources after it are kept too, never fewer.
const cursorHoldsSQL = `
SELECT DISTINCT ON (h.schema_name, h.table_name) h.schema_name, h.table_name, c.commit_lsn, c.seq
FROM epitaph.handlers h JOIN epitaph.handler_cursors c ON c.handler_id = h.id
WHERE ` + handler.CursorHandlerSQL + ` AND h.revoked_at IS NULL
ORDER BY h.schema_name, h.table_name, c.commit_lsn, c.seq`

// cursorKeptSQL is the victims' condition (on a row r) of a statement
// whose cursors CTE is cursorHoldsSQL: r is not after the cursor of its
// table. Probed per row only when there is a cursor handler at all (read
// once, in the statement's snapshot), as the holds are; the probe reads
// the CTE's few rows, never the cursors.
const cursorKeptSQL = `
      AND (NOT (SELECT EXISTS (SELECT 1 FROM cursors))
           OR NOT EXISTS (SELECT 1 FROM cursors k
                          WHERE k.schema_name = r.schema_name AND k.table_name = r.table_name
                            AND (r.commit_lsn, r.seq) > (k.commit_lsn, k.seq)))`

// partitionCursorSQL is partitionKeptSQL's test for a row of the
// partition %[1]s after the cursor of its table: per source of the
// partition (found by a skip scan of its rows_key index, a probe per
// source) and per table with cursor handlers, the first row of the source
// after the cursor's position, found on rows_key. A partition whose
// period is over is normally far behind every cursor: each probe then
// ends at once, on the index.
const partitionCursorSQL = `EXISTS (
        WITH RECURSIVE src AS (
            SELECT min(source) AS source FROM %[1]s
          UNION ALL
            SELECT (SELECT min(o.source) FROM %[1]s o WHERE o.source > s.source) FROM src s WHERE s.source IS NOT NULL)
        SELECT 1 FROM (` + cursorHoldsSQL + `) k CROSS JOIN src s CROSS JOIN LATERAL (
            SELECT 1 FROM %[1]s r WHERE r.source = s.source AND (r.commit_lsn, r.seq) > (k.commit_lsn, k.seq)
              AND r.schema_name = k.schema_name AND r.table_name = k.table_name
            ORDER BY r.commit_lsn, r.seq LIMIT 1) x
        WHERE s.source IS NOT NULL)`
