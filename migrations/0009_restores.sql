-- 0009_restores: the record of every `projector restore` (DESIGN section 7):
-- who put archived rows back into the source, when, what and how it ended.
--
-- A row is inserted before the source transaction starts (outcome
-- 'running') and settled after it: a restore that died between the source
-- commit and the settle stays 'running', and the source tells (its rows
-- are there or not). Values are never kept here, only what was asked and
-- counts; the rows themselves stay in the archive.
CREATE SCHEMA IF NOT EXISTS epitaph;

CREATE TABLE IF NOT EXISTS epitaph.restores (
    id             bigserial   PRIMARY KEY,
    -- Who: --actor, else the OS user running the command.
    actor          text        NOT NULL,
    source         text        NOT NULL,
    correlation_id text        NOT NULL,
    -- What: the whole transaction, one root's snapshot subtree
    -- (root_table, root_key) or one row (table_name, key).
    root_table     text,
    root_key       jsonb,
    table_name     text,
    key            jsonb,
    on_conflict    text        NOT NULL CHECK (on_conflict IN ('abort', 'skip')),
    -- running | restored | conflict (aborted on a row whose key exists) |
    -- failed. A dry run writes nothing, here neither.
    outcome        text        NOT NULL DEFAULT 'running'
                   CHECK (outcome IN ('running', 'restored', 'conflict', 'failed')),
    rows_restored  integer     NOT NULL DEFAULT 0,
    rows_skipped   integer     NOT NULL DEFAULT 0,
    -- Per table: rows, order, columns dropped since the delete.
    plan           jsonb,
    -- Sanitized: the error's kind and where, never values.
    error          text,
    started_at     timestamptz NOT NULL DEFAULT now(),
    finished_at    timestamptz
);

CREATE INDEX IF NOT EXISTS restores_correlation_idx ON epitaph.restores (correlation_id);
