package snapshot

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// rowQuerier is a pool, a connection or a transaction.
type rowQuerier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// haveTables reports whether every schema has a snapshots table. It is
// asked first (not learnt from an error) so a caller's transaction stays
// usable.
func haveTables(ctx context.Context, db rowQuerier, schemas ...string) (bool, error) {
	for _, s := range schemas {
		var ok bool
		if err := db.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, table(s, "snapshots")).Scan(&ok); err != nil {
			return false, fmt.Errorf("look up %s.snapshots: %w", s, err)
		}
		if !ok {
			return false, nil
		}
	}
	return true, nil
}

// backlogSQL reads the pending jobs only (by the partial index on
// pending_since), not the whole table.
const backlogSQL = `
SELECT count(*), coalesce(extract(epoch FROM now() - min(pending_since)), 0)::float8
  FROM %s WHERE status = 'pending'`

// Backlog returns how many jobs of <schema>.snapshots are pending and how
// long the oldest has waited (since created or invalidated). A schema
// without a snapshots table has none. It reads only the pending jobs, so
// it is cheap enough for every state check.
func Backlog(ctx context.Context, db rowQuerier, schema string) (pending int64, oldest time.Duration, err error) {
	if ok, err := haveTables(ctx, db, schema); err != nil || !ok {
		return 0, 0, err
	}
	var age float64
	err = db.QueryRow(ctx, fmt.Sprintf(backlogSQL, table(schema, "snapshots"))).Scan(&pending, &age)
	if err != nil {
		return 0, 0, fmt.Errorf("read snapshot backlog of %s: %w", schema, err)
	}
	return pending, time.Duration(max(age, 0) * float64(time.Second)), nil
}

// behindSQL counts the jobs of the candidate that are pending or failed
// while the same document (transaction, root table, root key) is complete
// in the other version: what a reader would lose by switching.
//
// A document the candidate has no job for counts too when the candidate
// has not archived its root row yet (the transaction is within its lag):
// switching would take the document from readers altogether. A candidate
// that archived the root row without a job (other snapshot roots) does
// not count: that is an intended difference (compare --ignore snapshots).
const behindSQL = `
SELECT count(*)
  FROM %[2]s l
  LEFT JOIN %[1]s c ON l.correlation_id = c.correlation_id AND l.root_table = c.root_table AND l.root_key = c.root_key
 WHERE l.status = 'complete'
   AND (c.status IN ('pending', 'failed')
        OR (c.correlation_id IS NULL AND NOT EXISTS (SELECT 1 FROM %[3]s r
             WHERE r.source = l.source AND r.commit_lsn = l.commit_lsn AND r.seq = l.root_seq)))`

// Behind counts the documents that are complete in schema than but
// pending or failed in schema candidate: switching readers from than to
// candidate would turn each of them from a document into "pending" or
// "failed". Schemas without a snapshots table have no documents.
func Behind(ctx context.Context, db rowQuerier, candidate, than string) (int64, error) {
	if ok, err := haveTables(ctx, db, candidate, than); err != nil || !ok {
		return 0, err
	}
	var n int64
	err := db.QueryRow(ctx, fmt.Sprintf(behindSQL, table(candidate, "snapshots"), table(than, "snapshots"), table(candidate, "rows"))).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("compare snapshot documents of %s with %s: %w", candidate, than, err)
	}
	return n, nil
}

// DocumentDifference is one document complete in both versions with a
// different content or fingerprint.
type DocumentDifference struct {
	CorrelationID string          `json:"correlation_id"`
	RootTable     string          `json:"root_table"`
	RootKey       json.RawMessage `json:"root_key"`
	// What: payload (the documents differ, meta.archived_at aside) or
	// fingerprint (built from another set of archive rows).
	What string `json:"what"`
}

// diffSQL compares the documents complete in both versions, up to a
// commit LSN bound ($1, NULL: all). archived_at is when each version
// archived the rows, so it is left out of the comparison.
const diffSQL = `
SELECT a.correlation_id, a.root_table, a.root_key,
       CASE WHEN (a.payload #- '{meta,archived_at}') IS DISTINCT FROM (b.payload #- '{meta,archived_at}')
            THEN 'payload' ELSE 'fingerprint' END,
       count(*) OVER ()
  FROM %[1]s a
  JOIN %[2]s b ON b.correlation_id = a.correlation_id AND b.root_table = a.root_table AND b.root_key = a.root_key
 WHERE a.status = 'complete' AND b.status = 'complete'
   AND ($1::pg_lsn IS NULL OR a.commit_lsn <= $1::pg_lsn)
   AND ((a.payload #- '{meta,archived_at}') IS DISTINCT FROM (b.payload #- '{meta,archived_at}')
        OR a.fingerprint IS DISTINCT FROM b.fingerprint)
 ORDER BY a.commit_lsn, a.root_table, a.root_key
 LIMIT $2`

// CompareDocuments compares the documents complete in both schemas a and
// b (commit LSN at or below upTo; "" for all) and returns how many differ
// and the first limit of them. A schema without a snapshots table has no
// documents. It only reads.
func CompareDocuments(ctx context.Context, db interface {
	Querier
	rowQuerier
}, a, b, upTo string, limit int) (int64, []DocumentDifference, error) {
	if ok, err := haveTables(ctx, db, a, b); err != nil || !ok {
		return 0, nil, err
	}
	var bound any
	if upTo != "" {
		bound = upTo
	}
	rows, err := db.Query(ctx, fmt.Sprintf(diffSQL, table(a, "snapshots"), table(b, "snapshots")), bound, limit)
	if err != nil {
		return 0, nil, fmt.Errorf("compare snapshot documents of %s and %s: %w", a, b, err)
	}
	var (
		total int64
		out   []DocumentDifference
	)
	for rows.Next() {
		var d DocumentDifference
		if err := rows.Scan(&d.CorrelationID, &d.RootTable, &d.RootKey, &d.What, &total); err != nil {
			rows.Close()
			return 0, nil, fmt.Errorf("compare snapshot documents of %s and %s: %w", a, b, err)
		}
		out = append(out, d)
	}
	if err := rows.Err(); err != nil {
		return 0, nil, fmt.Errorf("compare snapshot documents of %s and %s: %w", a, b, err)
	}
	return total, out, nil
}
