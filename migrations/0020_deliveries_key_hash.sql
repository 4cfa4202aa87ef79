-- 0020_deliveries_key_hash: the key index compares hashes, not jsonb.
--
-- deliveries_key_idx (handler_id, schema_name, table_name, key) serves the
-- per-key order of batching handlers (the claim) and revalidation's check
-- for a later deletion of the same key. Every insert of a delivery and
-- every claim and settle (each writes a new row version with entries in
-- every index) descended it comparing whole jsonb keys, since a handler's
-- entries share the first three columns: a third of the cost of queueing
-- a delivery. The new index holds the handler and jsonb_hash(key) (equal
-- keys hash equal; the statements compare the keys themselves too).
CREATE INDEX IF NOT EXISTS deliveries_key_hash_idx ON epitaph.deliveries (handler_id, jsonb_hash(key));
DROP INDEX IF EXISTS epitaph.deliveries_key_idx;
