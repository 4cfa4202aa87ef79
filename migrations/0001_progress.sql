-- Cursors and leases of the projector: one row per (projection, version,
-- partition). The cursor is the JetStream stream sequence of the last applied
-- message of that partition; it only moves by compare-and-swap in the same
-- transaction as the read-model writes. No payloads are ever stored here.
CREATE TABLE IF NOT EXISTS epitaph.progress (
    projection            text        NOT NULL,
    version               integer     NOT NULL,
    partition             integer     NOT NULL,
    cursor                bigint      NOT NULL DEFAULT 0,
    -- source identity of the last applied event (checked against the stream
    -- to detect a lost tail)
    last_commit_lsn       pg_lsn,
    last_seq              integer,
    last_msg_id           text,
    -- watermark: the partition reflects the source up to this LSN
    source_lsn            pg_lsn,
    attempts              integer     NOT NULL DEFAULT 0,
    last_advance_at       timestamptz,
    last_failure_category text,
    last_failure_at       timestamptz,
    -- lease
    owner                 text,
    epoch                 bigint      NOT NULL DEFAULT 0,
    lease_expires_at      timestamptz,
    created_at            timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (projection, version, partition),
    CHECK (partition >= 0),
    CHECK (cursor >= 0)
);

CREATE INDEX IF NOT EXISTS progress_owner_idx ON epitaph.progress (owner) WHERE owner IS NOT NULL;

-- Live projector workers. A worker is alive while heartbeat_at is within its
-- lease TTL; the fair share of partitions is ceil(P / live workers).
CREATE TABLE IF NOT EXISTS epitaph.workers (
    worker_id    text        PRIMARY KEY,
    heartbeat_at timestamptz NOT NULL DEFAULT now(),
    started_at   timestamptz NOT NULL DEFAULT now(),
    lease_ttl    interval    NOT NULL DEFAULT '15 seconds'
);
