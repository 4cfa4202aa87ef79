package snapshot

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/epitaph-dev/epitaph/event"
)

// createJobsSQL makes one pending job per archived row of a root table in
// the transaction. A transaction that deleted the same key twice (delete,
// re-insert, delete) gets one job, rooted at the first deletion.
const createJobsSQL = `
INSERT INTO %[1]s (correlation_id, source, commit_lsn, root_table, root_key, root_seq,
                   expected_tables, expected_rows)
SELECT DISTINCT ON (r.schema_name, r.table_name, r.key)
       $1, r.source, r.commit_lsn, r.schema_name || '.' || r.table_name, r.key, r.seq, $5, $6
  FROM %[2]s r
 WHERE r.source = $2 AND r.commit_lsn = $3::pg_lsn AND r.verified
   AND r.schema_name || '.' || r.table_name = ANY ($4)
 ORDER BY r.schema_name, r.table_name, r.key, r.seq
ON CONFLICT (correlation_id, root_table, root_key) DO NOTHING`

// recordGroupSQL keeps the commit's roots and counts for transactions that
// counted a root table's rows, for root rows that arrive late.
const recordGroupSQL = `
INSERT INTO %s (correlation_id, source, commit_lsn, roots, expected_tables, expected_rows)
VALUES ($1, $2, $3::pg_lsn, $4, $5, $6)
ON CONFLICT (correlation_id) DO NOTHING`

// lateJobsSQL creates the missing jobs of recorded transactions from the
// root rows now in the archive.
const lateJobsSQL = `
INSERT INTO %[1]s (correlation_id, source, commit_lsn, root_table, root_key, root_seq,
                   expected_tables, expected_rows)
SELECT DISTINCT ON (g.correlation_id, r.schema_name, r.table_name, r.key)
       g.correlation_id, r.source, r.commit_lsn, r.schema_name || '.' || r.table_name, r.key, r.seq,
       g.expected_tables, g.expected_rows
  FROM %[3]s g
  JOIN %[2]s r ON r.source = g.source AND r.commit_lsn = g.commit_lsn AND r.verified
 WHERE g.correlation_id = ANY ($1)
   AND r.schema_name || '.' || r.table_name = ANY (g.roots)
 ORDER BY g.correlation_id, r.schema_name, r.table_name, r.key, r.seq
ON CONFLICT (correlation_id, root_table, root_key) DO NOTHING`

// CreateJobs creates, in the caller's transaction, one pending snapshot job
// per archived row of a root table ("schema.table" in roots) of the
// transaction that commit ends. Call it when applying the commit event,
// after the transaction's rows are in <schema>.rows; the commit's per-table
// counts, less the rows erased or fenced out of the version (Discount), are
// kept as the job's completeness check.
//
// It is idempotent: re-applying the commit creates nothing new. Rows of
// tables not in roots get no job. It returns the number of jobs created.
func CreateJobs(ctx context.Context, tx pgx.Tx, schema string, commit *event.Event, roots []string) (int, error) {
	if commit == nil || commit.Op != event.OpCommit {
		return 0, errors.New("create snapshot jobs: not a commit event")
	}
	if len(roots) == 0 {
		return 0, nil
	}
	fenced, err := loadFenced(ctx, tx, schema, []string{commit.Source}, []string{commit.CommitLSN.String()})
	if err != nil {
		return 0, err
	}
	tables, nrows := fenced[txKey{commit.Source, commit.CommitLSN.String()}].counts(commit)
	expected, err := json.Marshal(tables)
	if err != nil {
		return 0, fmt.Errorf("create snapshot jobs: encode table counts: %w", err)
	}
	q := fmt.Sprintf(createJobsSQL, table(schema, "snapshots"), table(schema, "rows"))
	tag, err := tx.Exec(ctx, q, commit.CorrelationID(), commit.Source, commit.CommitLSN.String(),
		roots, expected, nrows)
	if err != nil {
		return 0, fmt.Errorf("create snapshot jobs for %s: %w", commit.CorrelationID(), err)
	}
	if countsRoot(tables, roots) {
		if _, err := tx.Exec(ctx, fmt.Sprintf(recordGroupSQL, table(schema, "snapshot_groups")),
			commit.CorrelationID(), commit.Source, commit.CommitLSN.String(), roots, expected, nrows); err != nil {
			return 0, fmt.Errorf("record snapshot group %s: %w", commit.CorrelationID(), err)
		}
	}
	return int(tag.RowsAffected()), nil
}

// countsRoot reports whether the commit may have root rows: it counted a
// root table, or it has no counts at all.
func countsRoot(tables map[string]int, roots []string) bool {
	if len(tables) == 0 {
		return true
	}
	for _, r := range roots {
		if tables[r] > 0 {
			return true
		}
	}
	return false
}

// invalidateSQL puts the jobs of the transactions back to pending. It also
// touches jobs that are already pending: the row lock it takes (held until
// the caller commits) keeps a batcher from assembling the job from a set of
// rows that misses the caller's uncommitted ones, and a batcher holding the
// job makes this statement wait until that batch has written its result,
// which is then reset.
const invalidateSQL = `
UPDATE %s
   SET status = 'pending', payload = NULL, completed_at = NULL, failure_reason = NULL,
       retry_count = 0, next_attempt_at = NULL,
       pending_since = CASE WHEN status = 'pending' THEN coalesce(pending_since, now()) ELSE now() END,
       updated_at = now()
 WHERE correlation_id = ANY ($1)`

// Invalidate marks the snapshot jobs of the given transactions (correlation
// ids "<src>:<xid>:<commit_lsn>") for rebuilding, in the caller's
// transaction. The projector calls it when archive rows of a transaction
// are inserted after that transaction's commit was applied (a replayed
// event): complete and failed jobs go back to pending with fresh attempts,
// and the next batch rebuilds them from the new set of rows (so their
// fingerprint changes). A root row that arrived late gets its job now.
// Transactions without jobs or root rows are ignored, so calling it for a
// transaction whose commit is not applied yet is harmless. It returns the
// number of jobs reset or created.
func Invalidate(ctx context.Context, tx pgx.Tx, schema string, correlationIDs []string) (int, error) {
	if len(correlationIDs) == 0 {
		return 0, nil
	}
	tag, err := tx.Exec(ctx, fmt.Sprintf(invalidateSQL, table(schema, "snapshots")), correlationIDs)
	if err != nil {
		return 0, fmt.Errorf("invalidate snapshot jobs: %w", err)
	}
	late, err := tx.Exec(ctx, fmt.Sprintf(lateJobsSQL, table(schema, "snapshots"), table(schema, "rows"),
		table(schema, "snapshot_groups")), correlationIDs)
	if err != nil {
		return 0, fmt.Errorf("create late snapshot jobs: %w", err)
	}
	return int(tag.RowsAffected() + late.RowsAffected()), nil
}
