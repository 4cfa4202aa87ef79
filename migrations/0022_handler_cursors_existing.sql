-- 0022_handler_cursors_existing: a cursor handler (a webhook that batches
-- without revalidation) added before 0021 has no cursor: the apply queues
-- nothing for it and the dispatcher claims nothing without a cursor, so
-- none of its rows would be delivered after the upgrade. Its cursor starts
-- where Add starts one, at the live archive's horizon: the rows behind it
-- were queued as deliveries by the build that archived them (and a claim
-- leaves out rows that have a delivery of the handler already).
INSERT INTO epitaph.handler_cursors (handler_id, commit_lsn, seq)
SELECT h.id, COALESCE((SELECT min(COALESCE(p.source_lsn, '0/0'::pg_lsn)) FROM epitaph.progress p
                        JOIN epitaph.projection_versions v ON v.projection = p.projection AND v.version = p.version
                       WHERE v.projection = 'archive' AND v.state = 'live'), '0/0'::pg_lsn), 2147483647
FROM epitaph.handlers h
WHERE h.kind = 'webhook' AND h.batch_size > 1 AND NOT h.revalidate AND h.revoked_at IS NULL
ON CONFLICT (handler_id) DO NOTHING;
