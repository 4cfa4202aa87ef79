-- 0006_readiness: what archive.status needs to tell readers whether, and up
-- to where, the archive can be trusted (DESIGN section 6).
--
-- quarantine.after_lsn: the partition's watermark when it met the event; the
-- event lies after it, so the archive is complete at most up to it while the
-- entry is open. NULL (entries from before this migration): unknown, taken
-- as 0/0.
ALTER TABLE epitaph.quarantine ADD COLUMN IF NOT EXISTS after_lsn pg_lsn;

-- progress.source_time: the source time of the watermark (the commit time,
-- or the mark's or heartbeat's time, of the message that set source_lsn).
ALTER TABLE epitaph.progress ADD COLUMN IF NOT EXISTS source_time timestamptz;

-- Lag per partition as last sampled by a worker from the stream (the
-- database alone cannot see it), with the readiness thresholds that worker
-- was configured with. A sample is believed until fresh_until; past it the
-- lag is unknown and the archive is not ready.
CREATE TABLE IF NOT EXISTS epitaph.partition_lag (
    projection          text        NOT NULL,
    version             integer     NOT NULL,
    partition           integer     NOT NULL,
    lag_events          bigint      NOT NULL,
    oldest_pending_at   timestamptz,
    sampled_at          timestamptz NOT NULL DEFAULT now(),
    fresh_until         timestamptz NOT NULL,
    max_lag_events      bigint      NOT NULL,
    max_pending_seconds float8      NOT NULL,
    PRIMARY KEY (projection, version, partition)
);

-- version_gaps summarizes the gaps table of one version's schema (archive_v<N>.gaps):
-- unacknowledged blocking gaps (lost_upstream, removed_from_stream), the
-- lowest position they start after (NULL from_lsn: unknown, taken as 0/0),
-- and informational truncate rows. A schema without the table has none.
-- SECURITY DEFINER: a reader allowed archive.status need not be allowed the
-- version schemas.
CREATE OR REPLACE FUNCTION epitaph.version_gaps(version_schema text,
    OUT unacknowledged integer, OUT first_lsn pg_lsn, OUT truncates integer)
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog AS $fn$
BEGIN
    unacknowledged := 0;
    truncates := 0;
    IF version_schema IS NULL OR to_regclass(format('%I.gaps', version_schema)) IS NULL THEN
        RETURN;
    END IF;
    EXECUTE format($q$
        SELECT (count(*) FILTER (WHERE kind <> 'truncate' AND acknowledged_at IS NULL))::int,
               min(COALESCE(from_lsn, '0/0'::pg_lsn)) FILTER (WHERE kind <> 'truncate' AND acknowledged_at IS NULL),
               (count(*) FILTER (WHERE kind = 'truncate'))::int
        FROM %I.gaps$q$, version_schema)
    INTO unacknowledged, first_lsn, truncates;
END
$fn$;
