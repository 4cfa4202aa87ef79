-- 0012_stream_identity: which stream a partition's cursor counts in.
--
-- A cursor is a sequence of one stream. A stream deleted and made anew
-- (same name) starts its sequences again and holds none of the old
-- stream's messages: whatever the old one held past the cursor was never
-- applied and may be lost. stream_created is the creation time of the
-- stream the cursor belongs to (NULL: not recorded yet, taken as the
-- current one); a worker that finds another stream under the name records a
-- removed_from_stream gap before it goes on with the new stream.
ALTER TABLE epitaph.progress ADD COLUMN IF NOT EXISTS stream_created timestamptz;
