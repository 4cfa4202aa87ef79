package snapshot

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// Querier runs a query: a pool, a connection or a transaction.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// Snapshot is one snapshot job and, when complete, its document.
type Snapshot struct {
	CorrelationID string          `json:"correlation_id"`
	RootTable     string          `json:"root_table"`
	RootKey       json.RawMessage `json:"root_key"`
	Status        string          `json:"status"`
	Payload       json.RawMessage `json:"payload,omitempty"`
	Fingerprint   string          `json:"fingerprint,omitempty"`
	RetryCount    int             `json:"retry_count"`
	FailureReason string          `json:"failure_reason,omitempty"`
	CreatedAt     time.Time       `json:"created_at"`
	CompletedAt   *time.Time      `json:"completed_at,omitempty"`
}

const showSQL = `
SELECT correlation_id, root_table, root_key, status, payload, coalesce(fingerprint, ''),
       retry_count, coalesce(failure_reason, ''), created_at, completed_at
  FROM %s
 WHERE correlation_id = $1
 ORDER BY root_table, root_key`

// Show returns the snapshots of one source transaction (correlation id
// "<src>:<xid>:<commit_lsn>"), ordered by root table and key. schema is a
// version schema ("archive_v1") or the reader schema "archive" whose
// snapshots view points at the live version; only the columns of the read
// model are read.
func Show(ctx context.Context, db Querier, schema, correlationID string) ([]Snapshot, error) {
	rows, err := db.Query(ctx, fmt.Sprintf(showSQL, table(schema, "snapshots")), correlationID)
	if err != nil {
		return nil, fmt.Errorf("show snapshots of %s: %w", correlationID, err)
	}
	list, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Snapshot, error) {
		var s Snapshot
		err := r.Scan(&s.CorrelationID, &s.RootTable, &s.RootKey, &s.Status, &s.Payload, &s.Fingerprint,
			&s.RetryCount, &s.FailureReason, &s.CreatedAt, &s.CompletedAt)
		return s, err
	})
	if err != nil {
		return nil, fmt.Errorf("show snapshots of %s: %w", correlationID, err)
	}
	return list, nil
}

// Stats counts the jobs of a snapshots table.
type Stats struct {
	Pending  int64 `json:"pending"`
	Complete int64 `json:"complete"`
	Failed   int64 `json:"failed"`
	// OldestPendingAge is how long the oldest pending job has waited
	// (since it was created or invalidated); 0 when none is pending.
	OldestPendingAge time.Duration `json:"oldest_pending_age"`
}

// Add sums two Stats, keeping the larger oldest pending age.
func (s Stats) Add(o Stats) Stats {
	return Stats{
		Pending: s.Pending + o.Pending, Complete: s.Complete + o.Complete, Failed: s.Failed + o.Failed,
		OldestPendingAge: max(s.OldestPendingAge, o.OldestPendingAge),
	}
}

const statsSQL = `
SELECT count(*) FILTER (WHERE status = 'pending'),
       count(*) FILTER (WHERE status = 'complete'),
       count(*) FILTER (WHERE status = 'failed'),
       coalesce(extract(epoch FROM now() - min(pending_since) FILTER (WHERE status = 'pending')), 0)::float8
  FROM %s`

// GetStats reads the job counts by status and the oldest pending age of
// <schema>.snapshots. It counts the whole table: call it on an interval,
// not per request.
func GetStats(ctx context.Context, db Querier, schema string) (Stats, error) {
	rows, err := db.Query(ctx, fmt.Sprintf(statsSQL, table(schema, "snapshots")))
	if err != nil {
		return Stats{}, fmt.Errorf("read snapshot stats of %s: %w", schema, err)
	}
	s, err := pgx.CollectExactlyOneRow(rows, func(r pgx.CollectableRow) (Stats, error) {
		var (
			s   Stats
			age float64
		)
		err := r.Scan(&s.Pending, &s.Complete, &s.Failed, &age)
		s.OldestPendingAge = time.Duration(max(age, 0) * float64(time.Second))
		return s, err
	})
	if err != nil {
		return Stats{}, fmt.Errorf("read snapshot stats of %s: %w", schema, err)
	}
	return s, nil
}
