package archive

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/epitaph-dev/epitaph/internal/pgquote"
)

// statusView says, for the reader, whether the archive can be trusted
// (StatusQuery) for every version of the archive projection.
var statusView = statusViewPrefix + StatusQuery(`v.projection = 'archive'`)

const statusViewPrefix = `CREATE OR REPLACE VIEW archive.status AS`

// viewCurrent reports whether view exists with the given comment (which
// names what it shows) and, when table is set, the same columns as table:
// then it is left alone. Readers never fail because of the projector: a
// projector starting up must not replace (lock) reader views that already
// show the live version; this looks only at the catalogs.
func viewCurrent(ctx context.Context, tx pgx.Tx, view, comment, table string) (bool, error) {
	var current bool
	err := tx.QueryRow(ctx, `
		SELECT COALESCE(obj_description(to_regclass($1), 'pg_class') = $2, false)
		   AND ($3 = '' OR (SELECT array_agg(attname::text ORDER BY attnum) FROM pg_attribute
		                    WHERE attrelid = to_regclass($1) AND attnum > 0 AND NOT attisdropped)
		                 = (SELECT array_agg(attname::text ORDER BY attnum) FROM pg_attribute
		                    WHERE attrelid = to_regclass($3) AND attnum > 0 AND NOT attisdropped))`,
		view, comment, table).Scan(&current)
	if err != nil {
		return false, fmt.Errorf("look up view %s: %w", view, err)
	}
	return current, nil
}

// replaceView re-points a view in place when the columns allow it (so views
// that depend on it survive), else drops and recreates it.
func replaceView(ctx context.Context, tx pgx.Tx, view, query string) error {
	sp, err := tx.Begin(ctx)
	if err != nil {
		return err
	}
	if _, err := sp.Exec(ctx, `CREATE OR REPLACE VIEW `+view+` AS `+query); err == nil {
		return sp.Commit(ctx)
	}
	if err := sp.Rollback(ctx); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, `DROP VIEW IF EXISTS `+view); err != nil {
		return err
	}
	_, err = tx.Exec(ctx, `CREATE VIEW `+view+` AS `+query)
	return err
}

// StatusQuery is archive.status for the versions that cond (SQL over v, a
// row of epitaph.projection_versions) selects. A version is ready only when
// it is live, every partition is leased, started and not failing, the lag
// sampled by the workers under their current leases is fresh and within
// their thresholds, no quarantine is open and no blocking gap is
// unacknowledged; not_ready_reasons says which of these fails. complete_up_to_lsn is how far into the source
// the archive is complete: the lowest partition watermark, and not past the
// first unacknowledged blocking gap nor any open quarantine (NULL while a
// partition has no watermark); complete_up_to_time is the source time of
// that position when it is a watermark (NULL when a gap or a quarantined
// event caps it: its time is not known).
//
// It reads only epitaph tables and the versions' gaps tables (through
// epitaph.version_gaps), never locks anything a worker holds, so readers
// never wait on the projector.
func StatusQuery(cond string) string {
	return `
SELECT s.projection, s.version, s.state, s.schema_name, s.partitions, s.partitions_owned, s.partitions_started,
       s.source_lsn, s.every_partition_has_watermark, s.last_advance_at, q.open AS quarantine_open,
       (cardinality(r.reasons) = 0) AS ready,
       s.lag_events, s.oldest_pending_age_seconds,
       g.unacknowledged AS gaps_unacknowledged, g.truncates,
       c.lsn AS complete_up_to_lsn,
       CASE WHEN c.lsn IS NOT NULL AND c.lsn = s.source_lsn THEN s.source_time END AS complete_up_to_time,
       r.reasons AS not_ready_reasons
FROM (
    SELECT v.projection, v.version, v.state, v.schema_name,
           count(p.partition)::int AS partitions,
           (count(p.partition) FILTER (WHERE p.owner IS NOT NULL AND p.lease_expires_at > now()))::int AS partitions_owned,
           (count(p.partition) FILTER (WHERE p.last_advance_at IS NOT NULL))::int AS partitions_started,
           (count(p.partition) FILTER (WHERE p.attempts >= ` + fmt.Sprint(FailingAttempts) + `))::int AS partitions_failing,
           min(p.source_lsn) AS source_lsn,
           min(p.source_time) AS source_time,
           bool_and(p.source_lsn IS NOT NULL) AS every_partition_has_watermark,
           max(p.last_advance_at) AS last_advance_at,
           COALESCE(sum(l.lag_events), 0)::bigint AS lag_events,
           COALESCE(max(extract(epoch FROM now() - l.oldest_pending_at)), 0)::float8 AS oldest_pending_age_seconds,
           (count(l.partition) FILTER (WHERE l.fresh_until > now() AND l.epoch = p.epoch))::int AS lag_fresh,
           min(l.max_lag_events) AS max_lag_events,
           min(l.max_pending_seconds) AS max_pending_seconds
    FROM epitaph.projection_versions v
    LEFT JOIN epitaph.progress p ON p.projection = v.projection AND p.version = v.version
    LEFT JOIN epitaph.partition_lag l ON l.projection = p.projection AND l.version = p.version AND l.partition = p.partition
    WHERE ` + cond + ` AND v.state <> 'retired'
    GROUP BY v.projection, v.version, v.state, v.schema_name
) s
CROSS JOIN LATERAL epitaph.version_gaps(s.schema_name) g
CROSS JOIN LATERAL (
    SELECT count(*)::int AS open, min(COALESCE(qq.after_lsn, '0/0'::pg_lsn)) AS first_lsn
    FROM epitaph.quarantine qq
    WHERE qq.projection = s.projection AND qq.version = s.version AND qq.status = 'open'
) q
CROSS JOIN LATERAL (
    SELECT CASE WHEN s.every_partition_has_watermark THEN LEAST(s.source_lsn, g.first_lsn, q.first_lsn) END AS lsn
) c
CROSS JOIN LATERAL (
    SELECT array_remove(ARRAY[
        CASE WHEN s.state <> 'live' THEN 'version is ' || s.state || ', not live' END,
        CASE WHEN s.partitions = 0 THEN 'no partitions' END,
        CASE WHEN s.partitions_owned < s.partitions
             THEN format('%s of %s partitions leased', s.partitions_owned, s.partitions) END,
        CASE WHEN s.partitions_started < s.partitions
             THEN format('%s of %s partitions started', s.partitions_started, s.partitions) END,
        CASE WHEN s.partitions_failing > 0 THEN format('%s partitions failing', s.partitions_failing) END,
        CASE WHEN s.partitions > 0 AND s.lag_fresh < s.partitions
             THEN format('lag not sampled recently for %s of %s partitions', s.partitions - s.lag_fresh, s.partitions) END,
        CASE WHEN s.lag_events > s.max_lag_events
             THEN format('lag %s events (ready at most %s)', s.lag_events, s.max_lag_events) END,
        CASE WHEN s.oldest_pending_age_seconds > s.max_pending_seconds
             THEN format('oldest pending event %ss old (ready at most %ss)', round(s.oldest_pending_age_seconds::numeric, 1), s.max_pending_seconds) END,
        CASE WHEN q.open > 0 THEN format('%s quarantined events open', q.open) END,
        CASE WHEN g.unacknowledged > 0 THEN format('%s unacknowledged gaps', g.unacknowledged) END
    ]::text[], NULL) AS reasons
) r`
}

// PointViews re-points the reader views at archive_v<version> inside tx;
// the caller holds the version lock (PointViews takes it).
func PointViews(ctx context.Context, tx pgx.Tx, version int) error {
	schema := Schema(version)
	if _, err := tx.Exec(ctx, `CREATE SCHEMA IF NOT EXISTS archive`); err != nil {
		return fmt.Errorf("create schema archive: %w", err)
	}
	for _, table := range []string{"rows", "snapshots", "gaps"} {
		var exists bool
		if err := tx.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, Ident(schema, table)).Scan(&exists); err != nil {
			return fmt.Errorf("look up %s.%s: %w", schema, table, err)
		}
		if !exists {
			if _, err := tx.Exec(ctx, `DROP VIEW IF EXISTS `+Ident(ReaderSchema, table)); err != nil {
				return fmt.Errorf("drop view archive.%s: %w", table, err)
			}
			continue
		}
		comment := fmt.Sprintf("live version: %s. Check archive.status before trusting an empty result.", schema)
		query := `SELECT * FROM ` + Ident(schema, table)
		switch table {
		case "rows":
			// Trust: rows of unverified transactions stay invisible;
			// Retention: expired rows are hidden at once, also while a
			// hold or an open delivery keeps them. The comment says so, so a
			// view made before is re-pointed once.
			query += ` WHERE verified AND (expires_at IS NULL OR expires_at > now())`
			comment = fmt.Sprintf("live version: %s (verified, unexpired rows only). Check archive.status before trusting an empty result.", schema)
		case "snapshots":
			// A document expires with its root row.
			query = `SELECT s.* FROM ` + Ident(schema, table) + ` s WHERE NOT EXISTS (SELECT 1 FROM ` + Ident(schema, "rows") +
				` r WHERE r.source = s.source AND r.commit_lsn = s.commit_lsn AND r.seq = s.root_seq AND r.expires_at <= now())`
			comment = fmt.Sprintf("live version: %s (documents of unexpired roots only). Check archive.status before trusting an empty result.", schema)
		}
		current, err := viewCurrent(ctx, tx, Ident(ReaderSchema, table), comment, Ident(schema, table))
		if err != nil {
			return err
		}
		if current {
			continue
		}
		if err := replaceView(ctx, tx, Ident(ReaderSchema, table), query); err != nil {
			return fmt.Errorf("point view archive.%s at %s: %w", table, schema, err)
		}
		if _, err := tx.Exec(ctx, `COMMENT ON VIEW `+Ident(ReaderSchema, table)+` IS `+pgquote.Literal(comment)); err != nil {
			return fmt.Errorf("comment view archive.%s: %w", table, err)
		}
	}
	sum := sha256.Sum256([]byte(statusView))
	comment := "Is the archive ready, and complete up to where? (definition " + hex.EncodeToString(sum[:6]) + ")"
	current, err := viewCurrent(ctx, tx, "archive.status", comment, "")
	if err != nil || current {
		return err
	}
	if err := replaceView(ctx, tx, "archive.status", strings.TrimPrefix(statusView, statusViewPrefix)); err != nil {
		return fmt.Errorf("create view archive.status: %w", err)
	}
	if _, err := tx.Exec(ctx, `COMMENT ON VIEW archive.status IS `+pgquote.Literal(comment)); err != nil {
		return fmt.Errorf("comment view archive.status: %w", err)
	}
	return nil
}

// FailingAttempts is how many consecutive failed attempts make a partition
// count as failing (health "unavailable").
const FailingAttempts = 3
