-- 0003_quarantine: events a projector could not decode or apply.
--
-- A row is written in the same transaction that advances the partition's
-- cursor past the event, so an event is either applied or quarantined, never
-- lost and never blocking. Rows are kept after they are resolved (replayed or
-- discarded) as an audit record. The error text is sanitized: it never holds
-- row values; the raw message is in data (shown only on request).
CREATE SCHEMA IF NOT EXISTS epitaph;

CREATE TABLE IF NOT EXISTS epitaph.quarantine (
    id                bigserial   PRIMARY KEY,
    projection        text        NOT NULL,
    version           integer     NOT NULL,
    partition         integer     NOT NULL,
    stream_seq        bigint      NOT NULL,
    subject           text        NOT NULL,
    headers           jsonb       NOT NULL DEFAULT '{}',
    data              bytea       NOT NULL,
    category          text        NOT NULL,
    error             text        NOT NULL,
    -- The source row the event is about, when the body could be read far
    -- enough to tell: hold mode keeps later events of the same row behind it.
    source_schema     text,
    source_table      text,
    source_key        jsonb,
    first_seen        timestamptz NOT NULL DEFAULT now(),
    last_attempt_at   timestamptz NOT NULL DEFAULT now(),
    attempts          integer     NOT NULL DEFAULT 1,
    status            text        NOT NULL DEFAULT 'open'
                      CHECK (status IN ('open', 'replayed', 'discarded')),
    resolved_at       timestamptz,
    resolution_reason text,
    -- A re-delivered event is not quarantined twice: Insert bumps attempts.
    CONSTRAINT quarantine_event_once UNIQUE (projection, version, stream_seq),
    CONSTRAINT quarantine_resolved CHECK ((status = 'open') = (resolved_at IS NULL))
);

-- Operators and health look at unresolved entries per projection version.
CREATE INDEX IF NOT EXISTS quarantine_open_idx
    ON epitaph.quarantine (projection, version, stream_seq)
    WHERE status = 'open';

-- Hold mode: is there an open entry for this source row?
CREATE INDEX IF NOT EXISTS quarantine_open_key_idx
    ON epitaph.quarantine (projection, version, source_schema, source_table, source_key)
    WHERE status = 'open' AND source_key IS NOT NULL;
