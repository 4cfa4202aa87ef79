-- 0005_trust: what a projector believes of the stream (DESIGN section 6).
--
-- trusted_keys: the capture's Ed25519 public keys this target accepts
-- signatures from. The first key a projector meets is recorded here
-- (trusted_by = 'first use'); any other key is refused until an operator
-- adds it with `projector trust-key`. Keys are never removed by the
-- projector: after a rotation the old key stays trusted for what it signed.
CREATE TABLE IF NOT EXISTS epitaph.trusted_keys (
    key_id        text        PRIMARY KEY,          -- event.KeyID: 16 hex digits of sha256(public key)
    public_key    bytea       NOT NULL CHECK (length(public_key) = 32),
    first_seen_at timestamptz NOT NULL DEFAULT now(),
    trusted_at    timestamptz NOT NULL DEFAULT now(),
    trusted_by    text        NOT NULL,             -- 'first use' or the operator's note of who
    note          text
);

-- legacy_boundaries: a stream written before signing. The first run of a
-- projector on a partition records the last unsigned message of that
-- partition then in the stream; unsigned messages at or before it are
-- believed as before, unsigned messages after it are quarantined
-- (unauthenticated). boundary_seq 0: the partition had no unsigned message.
CREATE TABLE IF NOT EXISTS epitaph.legacy_boundaries (
    stream       text        NOT NULL,
    partition    integer     NOT NULL CHECK (partition >= 0),
    boundary_seq bigint      NOT NULL CHECK (boundary_seq >= 0),
    recorded_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (stream, partition)
);

-- Per partition of a version, beside its cursor (moved in the same
-- transaction):
--   part_seq: the Epitaph-Partition-Seq of the last verified message
--     applied (NULL: not known yet, e.g. after a rewind); the next verified
--     message must be part_seq + 1 plus the rows of its transaction, else
--     messages were removed from the stream (a removed_from_stream gap).
--   tx_start: stream sequence of the last verified boundary (commit, mark,
--     heartbeat, gap) applied: the row messages after it, up to the cursor,
--     belong to a transaction whose commit has not been applied yet.
--   tx_digest: the event.Digest state over those row messages in stream
--     order (encoding.BinaryMarshaler), so a transaction spanning pages is
--     checked against its commit's Epitaph-Digest without re-reading it.
--   tx_first: the stream sequence of the first of them.
--   tx_pending: how many row messages that is (0: none open).
ALTER TABLE epitaph.progress ADD COLUMN IF NOT EXISTS part_seq bigint;
ALTER TABLE epitaph.progress ADD COLUMN IF NOT EXISTS tx_start bigint;
ALTER TABLE epitaph.progress ADD COLUMN IF NOT EXISTS tx_first bigint;
ALTER TABLE epitaph.progress ADD COLUMN IF NOT EXISTS tx_digest bytea;
ALTER TABLE epitaph.progress ADD COLUMN IF NOT EXISTS tx_pending integer NOT NULL DEFAULT 0;
