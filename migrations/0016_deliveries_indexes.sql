-- 0016_deliveries_indexes: fewer index entries per write of a delivery.
--
-- No update of a delivery's state is a heap-only tuple (state is in the
-- predicates of the partial indexes), so every write of a delivery (the
-- apply's insert, the claim, the settle) adds an entry to every index of
-- epitaph.deliveries whose predicate it meets. Two of the full indexes
-- served nothing another one could not:
--
-- * deliveries_once (handler_id, source, commit_lsn, seq, generation) and
--   deliveries_row_idx (source, commit_lsn, seq) become one unique index
--   on (source, commit_lsn, seq, handler_id, generation): the row's
--   deliveries are its prefix (priority order, scrub at terminal state,
--   retention, erasure, release), and ON CONFLICT (handler_id, source,
--   commit_lsn, seq, generation) infers it (column order does not matter).
-- * deliveries_correlation_idx (correlation_id): no statement looks
--   deliveries up by correlation id (groups are read from the archive).
--
-- Full indexes written by every write: five before, three after (the
-- primary key, the row's unique index, the later-delivery key index).
-- The unique index is built before the constraint it replaces is dropped,
-- so the deliveries stay unique throughout.
CREATE UNIQUE INDEX IF NOT EXISTS deliveries_row_once ON epitaph.deliveries (source, commit_lsn, seq, handler_id, generation);
ALTER TABLE epitaph.deliveries DROP CONSTRAINT IF EXISTS deliveries_once;
DROP INDEX IF EXISTS epitaph.deliveries_row_idx;
DROP INDEX IF EXISTS epitaph.deliveries_correlation_idx;
