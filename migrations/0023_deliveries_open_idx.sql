-- 0023_deliveries_open_idx: a handler's open deliveries, found in one probe.
--
-- A batching webhook's claim (handler/cursor.go) stops before a row whose
-- key has an earlier delivery of the handler still queued (a late row, or
-- one an older build queued), so a key's deliveries go out in commit
-- order. It asks first whether the handler has any open queued delivery at
-- all: almost always none, and then no row of the batch is probed for its
-- key. Only open deliveries are in the index: the settled ones (every
-- delivery a cursor sends) add nothing to it.
CREATE INDEX IF NOT EXISTS deliveries_open_idx ON epitaph.deliveries (handler_id)
    WHERE state IN ('pending', 'in_flight');
