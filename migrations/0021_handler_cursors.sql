-- 0021_handler_cursors: a webhook handler that batches (batch_size > 1)
-- without revalidation keeps a cursor instead of a queued row per
-- delivery: its pending deliveries are the archived rows of its table
-- after (commit_lsn, seq), up to the archive's horizon. A claimed batch
-- covers the rows up to claimed_to; its deliveries' rows are written once,
-- settled, when the batch ends.
CREATE TABLE IF NOT EXISTS epitaph.handler_cursors (
    handler_id       uuid        PRIMARY KEY,
    commit_lsn       pg_lsn      NOT NULL DEFAULT '0/0',
    seq              integer     NOT NULL DEFAULT -1,
    claimed_to_lsn   pg_lsn,
    claimed_to_seq   integer,
    claim_token      uuid,
    claim_expires_at timestamptz,
    attempt          integer     NOT NULL DEFAULT 0,
    next_attempt_at  timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now()
) WITH (fillfactor = 50);
