package archive

import (
	"github.com/epitaph-dev/epitaph/internal/pgquote"
)

// DDL creates the archive table of one version. Idempotent.
//
// is_root is NULL until the transaction's commit event has been applied
// (the transaction is not complete yet), then true for a row that no other
// row of the same transaction is a parent of by the events' foreign keys;
// it stays NULL where that cannot be told: a key-only row whose image lacks
// a column of its foreign key, or whose would-be parents' images lack the
// referenced columns (and no other parent is known).
//
// text_values keeps, only for the columns where storing the row as jsonb
// changes a value, the event's exact text of it (see textValues): with
// columns (the event's column types) it makes the archived row restore to
// the deleted one, equal by row::text, without the stream. NULL for almost
// every row.
//
// verified is false while the row's transaction has not been verified
// against its signed commit (a transaction spanning pages, applied before
// its commit arrives); archive.rows shows only verified rows, so readers
// see whole, authenticated transactions.
func DDL(schema string) string {
	s := Ident(schema)
	return `
CREATE SCHEMA IF NOT EXISTS ` + s + `;
` + rowsTableDDL(s) + `
CREATE INDEX IF NOT EXISTS rows_table_key_idx ON ` + s + `.rows (schema_name, table_name, key);
CREATE INDEX IF NOT EXISTS rows_correlation_idx ON ` + s + `.rows (correlation_id);
CREATE INDEX IF NOT EXISTS rows_commit_time_idx ON ` + s + `.rows (commit_time);
-- erase --match and hold --match: JSON containment on the row (package projection/erasure).
CREATE INDEX IF NOT EXISTS rows_row_match_idx ON ` + s + `.rows USING gin (row jsonb_path_ops);
DO $$ BEGIN
    -- Not ALTER TABLE .. IF NOT EXISTS: that takes an exclusive lock even
    -- when the column exists, and this runs whenever version states change
    -- (readers of archive.rows deadlocked with it).
    IF NOT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = ` + pgquote.Literal(s+".rows") + `::regclass
                   AND attname = 'verified' AND NOT attisdropped) THEN
        ALTER TABLE ` + s + `.rows ADD COLUMN verified boolean NOT NULL DEFAULT true;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = ` + pgquote.Literal(s+".rows") + `::regclass
                   AND attname = 'text_values' AND NOT attisdropped) THEN
        ALTER TABLE ` + s + `.rows ADD COLUMN text_values jsonb;
    END IF;
END $$;
` + gapsDDL(s)
}

// gapsDDL creates the version's gaps table: what the
// archive is known to miss; and pending_truncates, where a truncate of a
// transaction not verified yet waits for its commit (package projection's trust check). partition is NULL for a gap that concerns every
// partition (a loss upstream, published to each of them, is one row); the
// unique index makes the partitions that apply its copies record it once.
func gapsDDL(s string) string {
	return `
CREATE TABLE IF NOT EXISTS ` + s + `.gaps (id bigserial PRIMARY KEY, kind text NOT NULL
  CHECK (kind IN ('lost_upstream','removed_from_stream','truncate')), schema_name text, table_name text,
  partition int, from_lsn pg_lsn, to_lsn pg_lsn, from_seq bigint, to_seq bigint,
  detected_at timestamptz NOT NULL DEFAULT now(), acknowledged_at timestamptz, ack_reason text);
CREATE UNIQUE INDEX IF NOT EXISTS gaps_source_wide_idx ON ` + s + `.gaps
  (kind, COALESCE(schema_name, ''), COALESCE(table_name, ''), from_lsn, to_lsn) WHERE partition IS NULL;
CREATE TABLE IF NOT EXISTS ` + s + `.pending_truncates (partition int NOT NULL, commit_lsn pg_lsn NOT NULL,
  seq int NOT NULL, schema_name text NOT NULL, table_name text NOT NULL, PRIMARY KEY (partition, commit_lsn, seq));
`
}

// rowsColumns are the rows table's columns as the first release created
// them (later ones are added by DDL's DO block).
const rowsColumns = `
    source         text        NOT NULL,
    schema_name    text        NOT NULL,
    table_name     text        NOT NULL,
    key            jsonb,
    row            jsonb,
    identity       text,
    correlation_id text        NOT NULL,
    is_root        boolean,
    xid            bigint,
    commit_lsn     pg_lsn      NOT NULL,
    commit_time    timestamptz,
    seq            integer     NOT NULL,
    archived_at    timestamptz NOT NULL DEFAULT now(),
    expires_at     timestamptz,
    refs           jsonb,
    columns        jsonb`

// rowsTableDDL creates the rows table when it does not exist: on
// PostgreSQL 15 and later range-partitioned by commit_time, with its
// default partition (rows no partition covers: older than the oldest, or
// a NULL commit_time), so an insert never fails for want of a partition;
// the partitions proper are made by EnsurePartitions. A partitioned
// table's unique key must include the partition key, and commit_time may
// be NULL (a primary key may not), so the key is UNIQUE NULLS NOT DISTINCT
// (source, commit_lsn, seq, commit_time): one event has one commit_time, so
// an event applied twice still conflicts (the inserts' ON CONFLICT DO
// NOTHING), and a transaction's rows, sharing their commit_time, share a
// partition. Its expires_at index is not partial: it also finds the rows
// that never expire, which keep a partition from being dropped
// (package retention). An existing table (an earlier release's, not
// partitioned) is left as it is and keeps working.
func rowsTableDDL(s string) string {
	partitioned := `CREATE TABLE ` + s + `.rows (` + rowsColumns + `,
    CONSTRAINT rows_key UNIQUE NULLS NOT DISTINCT (source, commit_lsn, seq, commit_time)
) PARTITION BY RANGE (commit_time);
CREATE TABLE ` + s + `.` + DefaultPartition + ` PARTITION OF ` + s + `.rows DEFAULT;
CREATE INDEX rows_expires_at_idx ON ` + s + `.rows (expires_at);`
	plain := `CREATE TABLE ` + s + `.rows (` + rowsColumns + `,
    PRIMARY KEY (source, commit_lsn, seq)
);
CREATE INDEX rows_expires_at_idx ON ` + s + `.rows (expires_at) WHERE expires_at IS NOT NULL;`
	return `DO $ddl$ BEGIN
    IF to_regclass(` + pgquote.Literal(s+".rows") + `) IS NULL THEN
        IF current_setting('server_version_num')::int >= 150000 THEN
            EXECUTE ` + pgquote.Literal(partitioned) + `;
        ELSE
            EXECUTE ` + pgquote.Literal(plain) + `;
        END IF;
    END IF;
END $ddl$;`
}
