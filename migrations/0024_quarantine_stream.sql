-- 0024_quarantine_stream: a quarantine entry names the stream it came from.
--
-- An entry was unique per (projection, version, stream sequence). A stream
-- deleted and made anew numbers its messages from 1 again, so a message
-- quarantined from the new stream at a sequence an old entry held was
-- taken for a re-delivery of that entry: its attempts were bumped, and
-- when the old entry was resolved the new message stayed resolved with
-- it, unseen, its deletes missing with nothing open to say so. The
-- stream is named by its creation time, as the partition's cursor names
-- it (epitaph.progress.stream_created); '-infinity' where unknown.
ALTER TABLE epitaph.quarantine ADD COLUMN IF NOT EXISTS stream_created timestamptz NOT NULL DEFAULT '-infinity';
-- An entry first seen since the stream its partition reads was made came
-- from that stream; an older one from a stream before it.
UPDATE epitaph.quarantine q SET stream_created = p.stream_created
FROM epitaph.progress p
WHERE p.projection = q.projection AND p.version = q.version AND p.partition = q.partition
  AND p.stream_created IS NOT NULL AND q.first_seen >= p.stream_created AND q.stream_created = '-infinity';
ALTER TABLE epitaph.quarantine DROP CONSTRAINT IF EXISTS quarantine_event_once;
ALTER TABLE epitaph.quarantine ADD CONSTRAINT quarantine_event_once UNIQUE (projection, version, stream_created, stream_seq);
