package snapshot

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/epitaph-dev/epitaph/internal/pgquote"
)

// Job statuses.
const (
	StatusPending  = "pending"
	StatusComplete = "complete"
	StatusFailed   = "failed"
)

// snapshotsDDL creates <schema>.snapshots. The first columns are the read
// model (docs/projector.md, archive.snapshots); the rest are the job machinery:
//   - source, commit_lsn: the transaction, matching the archive rows' primary
//     key prefix so a group is read by index (its jobs are found by
//     correlation_id, the unique index's prefix);
//   - root_seq: the archive row the document is rooted at;
//   - expected_tables / expected_rows: the commit event's counts less the
//     rows erased or fenced out of the version (snapshot_fenced), the
//     completeness check;
//   - next_attempt_at: NULL means due now (new or invalidated jobs), a time
//     means a retry waits until then;
//   - pending_since: when the job last became pending (creation or
//     invalidation), for the oldest-pending-age metric.
//
// snapshot_groups remembers, per transaction whose commit counted rows of a
// root table, the roots and counts, so that a root row arriving after the
// commit (a replayed event) still gets its job (see Invalidate).
const snapshotsDDL = `
CREATE TABLE IF NOT EXISTS %[1]s.snapshots (
	id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
	correlation_id  text        NOT NULL,
	root_table      text        NOT NULL,
	root_key        jsonb       NOT NULL,
	status          text        NOT NULL DEFAULT 'pending'
	                CHECK (status IN ('pending', 'complete', 'failed')),
	payload         jsonb,
	fingerprint     text,
	retry_count     integer     NOT NULL DEFAULT 0,
	failure_reason  text,
	created_at      timestamptz NOT NULL DEFAULT now(),
	completed_at    timestamptz,
	source          text        NOT NULL,
	commit_lsn      pg_lsn      NOT NULL,
	root_seq        integer     NOT NULL,
	expected_tables jsonb       NOT NULL DEFAULT '{}',
	expected_rows   integer     NOT NULL DEFAULT 0,
	next_attempt_at timestamptz,
	pending_since   timestamptz DEFAULT now(),
	updated_at      timestamptz NOT NULL DEFAULT now(),
	UNIQUE (correlation_id, root_table, root_key)
);
CREATE TABLE IF NOT EXISTS %[1]s.snapshot_groups (
	correlation_id  text        PRIMARY KEY,
	source          text        NOT NULL,
	commit_lsn      pg_lsn      NOT NULL,
	roots           text[]      NOT NULL,
	expected_tables jsonb       NOT NULL,
	expected_rows   integer     NOT NULL,
	created_at      timestamptz NOT NULL DEFAULT now()
);
-- The rows of a transaction this version will never hold because an
-- erasure removed them or its fence kept them out (Discount): the commit's
-- counts less these are the documents' completeness check.
CREATE TABLE IF NOT EXISTS %[1]s.snapshot_fenced (
	source          text        NOT NULL,
	commit_lsn      pg_lsn      NOT NULL,
	seq             integer     NOT NULL,
	correlation_id  text        NOT NULL,
	table_name      text        NOT NULL,
	PRIMARY KEY (source, commit_lsn, seq)
);
CREATE INDEX IF NOT EXISTS snapshots_due ON %[1]s.snapshots (next_attempt_at NULLS FIRST, id)
	WHERE status = 'pending';
CREATE INDEX IF NOT EXISTS snapshots_pending_since ON %[1]s.snapshots (pending_since)
	WHERE status = 'pending';
CREATE INDEX IF NOT EXISTS snapshots_failed ON %[1]s.snapshots (id)
	WHERE status = 'failed';
-- Jobs are found by transaction through correlation_id, the unique
-- index's prefix (claims, group roots, retention and erasure): the
-- (source, commit_lsn) index the versions before had cost each document
-- ~10 us of its insert and served nothing else. Dropped where it exists
-- (a no-op after, as on new versions).
DROP INDEX IF EXISTS %[1]s.snapshots_tx;
-- The read API's GET /v1/snapshots?table=&key= (a root's snapshots).
CREATE INDEX IF NOT EXISTS snapshots_root_idx ON %[1]s.snapshots (root_table, root_key);
-- Payloads compressed with lz4 rather than pglz: most documents exceed the
-- TOAST threshold as jsonb, and pglz was about a third of the document
-- insert's CPU. New values only (rows already stored stay readable as they
-- are); changed once (the catalog says so after), and left alone on a
-- server built without lz4.
DO $snapshots_lz4$
BEGIN
	IF EXISTS (SELECT 1 FROM pg_attribute
	            WHERE attrelid = %[2]s::regclass AND attname = 'payload'
	              AND attcompression IS DISTINCT FROM 'l') THEN
		ALTER TABLE %[1]s.snapshots ALTER COLUMN payload SET COMPRESSION lz4;
	END IF;
EXCEPTION WHEN feature_not_supported THEN
	NULL;
END
$snapshots_lz4$;
`

// DDL returns the idempotent statements that create <schema>.snapshots and
// its indexes. schema is a version schema such as "archive_v1" that also
// holds the archive's rows table.
func DDL(schema string) string {
	return fmt.Sprintf(snapshotsDDL, pgx.Identifier{schema}.Sanitize(), pgquote.Literal(table(schema, "snapshots")))
}

type execer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Migrate creates <schema>.snapshots if it does not exist. It is idempotent;
// db may be a pool, a connection or the transaction that creates the version
// schema.
func Migrate(ctx context.Context, db execer, schema string) error {
	if _, err := db.Exec(ctx, DDL(schema)); err != nil {
		return fmt.Errorf("create %s.snapshots: %w", schema, err)
	}
	return nil
}

func table(schema, name string) string { return pgx.Identifier{schema, name}.Sanitize() }
