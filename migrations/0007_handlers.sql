-- 0007_handlers: row handlers and their deliveries (DESIGN section 7).
--
-- A handler is a side effect to run for every archived row of one source
-- table. A delivery is one (handler, archived row) piece of work. It is
-- inserted in the same target transaction that archives its row, by the
-- live version only, so that a crash can neither lose nor double the
-- intent; the dispatcher then claims, revalidates and runs it at least
-- once, and settles it guarded by the claim token it was given.
CREATE SCHEMA IF NOT EXISTS epitaph;

CREATE TABLE IF NOT EXISTS epitaph.handlers (
    -- Stable identity: work queued under an id keeps its handler, whatever
    -- the handler is renamed to. Nothing else refers to a handler.
    id              uuid        PRIMARY KEY,
    name            text,
    schema_name     text        NOT NULL,
    table_name      text        NOT NULL,
    kind            text        NOT NULL CHECK (kind IN ('webhook', 'exec', 'nats', 'go')),
    -- webhook: URL; exec: the command as a JSON array of arguments (no
    -- shell); nats: subject; go: the name the embedding program registered.
    target          text        NOT NULL,
    -- Handlers of one row run in priority order, lowest first, each after
    -- the previous one is terminal; equal priorities by id.
    priority        integer     NOT NULL DEFAULT 0,
    phase           text        NOT NULL DEFAULT 'immediate'
                    CHECK (phase IN ('immediate', 'after-group')),
    -- The columns a delivery keeps besides the key (store the promise, not
    -- the presentation). Empty: the key only.
    columns         text[]      NOT NULL DEFAULT '{}',
    max_attempts    integer     NOT NULL DEFAULT 25 CHECK (max_attempts > 0),
    backoff         interval    NOT NULL DEFAULT '1 second' CHECK (backoff > '0'),
    claim_timeout   interval    NOT NULL DEFAULT '5 minutes' CHECK (claim_timeout > '0'),
    -- A path the projector reads at dispatch (webhook HMAC secret); the
    -- secret itself is never stored.
    secret_file     text,
    -- Revalidation (issue 16): on by default; source_url_file names a file
    -- holding the source URL to read (NULL: the projector's --source-url).
    revalidate      boolean     NOT NULL DEFAULT true,
    source_url_file text,
    enabled         boolean     NOT NULL DEFAULT true,
    revoked_at      timestamptz,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX IF NOT EXISTS handlers_table_idx ON epitaph.handlers (schema_name, table_name);

CREATE TABLE IF NOT EXISTS epitaph.deliveries (
    -- Deterministic from (handler_id, source, commit_lsn, seq, generation):
    -- the idempotency key a handler sees (Epitaph-Delivery-Id).
    id                   uuid        PRIMARY KEY,
    handler_id           uuid        NOT NULL,
    -- The archived row (its identity in every version of the archive).
    source               text        NOT NULL,
    commit_lsn           pg_lsn      NOT NULL,
    seq                  integer     NOT NULL,
    -- A delivery that stopped as changed is followed by a new one for the
    -- current set, under a new identity: generation + 1.
    generation           integer     NOT NULL DEFAULT 0,
    schema_name          text        NOT NULL,
    table_name           text        NOT NULL,
    key                  jsonb,
    correlation_id       text        NOT NULL,
    commit_time          timestamptz,
    -- The archive version that was live when the row was applied.
    version              integer     NOT NULL,
    phase                text        NOT NULL DEFAULT 'immediate'
                         CHECK (phase IN ('immediate', 'after-group')),
    priority             integer     NOT NULL DEFAULT 0,
    state                text        NOT NULL DEFAULT 'pending'
                         CHECK (state IN ('pending', 'in_flight', 'done', 'stopped', 'dead')),
    -- NULL while the delivery waits for its row to be verified (its source
    -- transaction's signed commit applied) or for its group (after-group);
    -- set when it may be dispatched.
    released_at          timestamptz,
    -- Set when --group-settle-timeout released it without its commit.
    released_unsettled   boolean     NOT NULL DEFAULT false,
    -- False while its row belongs to a signed transaction whose commit has
    -- not been applied (the row is not verified yet): such a delivery is
    -- never released, not even by --group-settle-timeout; it ends stopped
    -- (outcome unverified) if its transaction is quarantined.
    verified             boolean     NOT NULL DEFAULT true,
    attempt              integer     NOT NULL DEFAULT 0,
    next_attempt_at      timestamptz NOT NULL DEFAULT now(),
    claim_token          uuid,
    claim_expires_at     timestamptz,
    -- Revalidation: send, stop_completed, stop_changed, stop_revoked,
    -- stop_superseded, defer; or done / dead reasons of the dispatcher.
    outcome              text,
    -- Sanitized: error type, machine code, diagnostic id; never error text.
    last_error           text,
    defers               integer     NOT NULL DEFAULT 0,
    -- The kept columns (key and the handler's columns); NULL once every
    -- handler of the row is terminal, or past the payload retention.
    payload              jsonb,
    payload_scrubbed_at  timestamptz,
    -- Fingerprint of the delivery's set (the group's archive rows of the
    -- handler's table) when queued, and the cheap-path pair (row count,
    -- greatest archive identity) it was computed over.
    fingerprint          text,
    group_rows           integer,
    group_max            text,
    observed_fingerprint text,
    evaluated_at         timestamptz,
    created_at           timestamptz NOT NULL DEFAULT now(),
    updated_at           timestamptz NOT NULL DEFAULT now(),
    settled_at           timestamptz,
    CONSTRAINT deliveries_once UNIQUE (handler_id, source, commit_lsn, seq, generation),
    CONSTRAINT deliveries_claim CHECK ((state = 'in_flight') = (claim_token IS NOT NULL))
);

-- A target that applied an earlier draft of this (unreleased) migration.
ALTER TABLE epitaph.deliveries ADD COLUMN IF NOT EXISTS verified boolean NOT NULL DEFAULT true;

-- The dispatcher claims due work in order.
CREATE INDEX IF NOT EXISTS deliveries_due_idx ON epitaph.deliveries (next_attempt_at)
    WHERE state = 'pending' AND released_at IS NOT NULL;
-- Reclaims of expired claims.
CREATE INDEX IF NOT EXISTS deliveries_claims_idx ON epitaph.deliveries (claim_expires_at)
    WHERE state = 'in_flight';
-- A row's handlers in priority order; retention keeps rows with open work.
CREATE INDEX IF NOT EXISTS deliveries_row_idx ON epitaph.deliveries (source, commit_lsn, seq);
-- Later deliveries of the same (handler, table, key): supersession.
CREATE INDEX IF NOT EXISTS deliveries_key_idx ON epitaph.deliveries (handler_id, schema_name, table_name, key);
CREATE INDEX IF NOT EXISTS deliveries_correlation_idx ON epitaph.deliveries (correlation_id);
-- Releasing a group's deliveries when its commit is applied.
CREATE INDEX IF NOT EXISTS deliveries_unreleased_idx ON epitaph.deliveries (correlation_id)
    WHERE released_at IS NULL AND state = 'pending';

CREATE SCHEMA IF NOT EXISTS archive;

CREATE OR REPLACE VIEW archive.deliveries AS
    SELECT id, handler_id, schema_name, table_name, key, correlation_id, state, attempt,
           outcome, last_error, payload, created_at, updated_at,
           source, commit_lsn, seq, generation, phase, released_at, released_unsettled,
           next_attempt_at, claim_expires_at, defers, fingerprint, observed_fingerprint,
           evaluated_at, settled_at
    FROM epitaph.deliveries;
