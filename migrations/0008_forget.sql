-- 0008_forget: retention and erasure (DESIGN section 7, issue 17).
--
-- legal_holds keeps archived rows past their expires_at: the cleanup worker
-- never deletes a row of the hold's table whose key equals the hold's key
-- (or whose row contains the hold's match). A hold names what it keeps, in
-- clear: it is there to keep it.
CREATE SCHEMA IF NOT EXISTS epitaph;

CREATE TABLE IF NOT EXISTS epitaph.legal_holds (
    id          bigserial   PRIMARY KEY,
    schema_name text        NOT NULL,
    table_name  text        NOT NULL,
    key         jsonb,
    match       jsonb,
    reason      text        NOT NULL CHECK (reason <> ''),
    created_by  text        NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT legal_holds_one_selector CHECK ((key IS NULL) <> (match IS NULL))
);
CREATE INDEX IF NOT EXISTS legal_holds_table_idx ON epitaph.legal_holds (schema_name, table_name);

-- erasures are the fences and their receipts. A fence never stores the
-- erased values: it keeps the table, the names of the matched columns
-- (sorted) and an HMAC-SHA256, under erasure_secret's key, of the canonical
-- JSON array of the values of those columns. Every version's apply hashes
-- the same columns of the rows it is about to archive and skips the ones
-- whose digest is fenced. mode key compares the event's key (which must
-- have exactly those columns), mode match the row image's top-level values.
-- removed counts what was removed where (never what).
CREATE TABLE IF NOT EXISTS epitaph.erasures (
    id            bigserial   PRIMARY KEY,
    schema_name   text        NOT NULL,
    table_name    text        NOT NULL,
    mode          text        NOT NULL CHECK (mode IN ('key', 'match')),
    columns       text[]      NOT NULL,
    digest        text        NOT NULL,
    with_children boolean     NOT NULL DEFAULT false,
    purge_stream  boolean     NOT NULL DEFAULT false,
    reason        text,
    actor         text        NOT NULL,
    runs          integer     NOT NULL DEFAULT 1,
    removed       jsonb       NOT NULL DEFAULT '{}',
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    completed_at  timestamptz,
    CONSTRAINT erasures_once UNIQUE (schema_name, table_name, mode, columns, digest)
);

-- Rows erased as children of a fenced row (--with-children), by their
-- identity in every version of the archive: a rebuild skips them too.
CREATE TABLE IF NOT EXISTS epitaph.erased_rows (
    source     text    NOT NULL,
    commit_lsn pg_lsn  NOT NULL,
    seq        integer NOT NULL,
    erasure_id bigint  NOT NULL REFERENCES epitaph.erasures (id),
    PRIMARY KEY (source, commit_lsn, seq)
);

-- The key of the fences' HMAC, made once per target.
CREATE TABLE IF NOT EXISTS epitaph.erasure_secret (
    id  boolean PRIMARY KEY DEFAULT true CHECK (id),
    key bytea   NOT NULL
);
INSERT INTO epitaph.erasure_secret (key)
VALUES (decode(replace(gen_random_uuid()::text || gen_random_uuid()::text, '-', ''), 'hex'))
ON CONFLICT DO NOTHING;

-- The change counter of the fences. Apply reads it through erasure_epoch()
-- in its insert statement (no extra round trip) and reloads its cached
-- fences when it moved; the function first takes the erasure lock shared,
-- so an erase (which takes it exclusively after recording its fence and
-- before removing rows) either sees the apply's rows committed, or the
-- apply sees the new counter and applies its page again.
CREATE TABLE IF NOT EXISTS epitaph.erasure_epoch (
    id    boolean PRIMARY KEY DEFAULT true CHECK (id),
    epoch bigint  NOT NULL DEFAULT 0
);
INSERT INTO epitaph.erasure_epoch (epoch) VALUES (0) ON CONFLICT DO NOTHING;

-- VOLATILE plpgsql: its SELECT takes a fresh snapshot after the lock.
CREATE OR REPLACE FUNCTION epitaph.erasure_epoch() RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared(7310012293695300897);
    RETURN (SELECT epoch FROM epitaph.erasure_epoch);
END $$;
