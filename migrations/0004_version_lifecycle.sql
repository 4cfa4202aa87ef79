-- 0004_version_lifecycle: the full lifecycle of projection versions
-- (building -> catching_up -> ready -> live -> retired, and failed).
--
-- failed: the version could not be built (its schema could not be created
-- by the projection's DDL); workers do not run it; retire it.
-- from_time: a partial rebuild (projector rebuild --from-time) starts every
-- partition at its first message stored at or after this time.
-- failed_reason is sanitized (never row values).
ALTER TABLE epitaph.projection_versions DROP CONSTRAINT IF EXISTS projection_versions_state_check;
ALTER TABLE epitaph.projection_versions ADD CONSTRAINT projection_versions_state_check
    CHECK (state IN ('building', 'catching_up', 'ready', 'live', 'retired', 'failed'));
ALTER TABLE epitaph.projection_versions ADD COLUMN IF NOT EXISTS failed_at timestamptz;
ALTER TABLE epitaph.projection_versions ADD COLUMN IF NOT EXISTS failed_reason text;
ALTER TABLE epitaph.projection_versions ADD COLUMN IF NOT EXISTS from_time timestamptz;
