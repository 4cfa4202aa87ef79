-- Versions of each projection. Several versions of one projection run side
-- by side (each with its own schema, consumers and progress rows); at most
-- one is live: the reader views point at it.
CREATE TABLE IF NOT EXISTS epitaph.projection_versions (
    projection      text        NOT NULL,
    version         integer     NOT NULL CHECK (version > 0),
    state           text        NOT NULL DEFAULT 'building'
                    CHECK (state IN ('building', 'catching_up', 'ready', 'live', 'retired')),
    schema_name     text        NOT NULL,
    -- stream position recorded when the version was created: before it the
    -- version is building, after it catching up
    boundary_seq    bigint,
    boundary_lsn    pg_lsn,
    partitions      integer     CHECK (partitions > 0),
    created_at      timestamptz NOT NULL DEFAULT now(),
    building_at     timestamptz,
    catching_up_at  timestamptz,
    ready_at        timestamptz,
    live_at         timestamptz,
    retired_at      timestamptz,
    config          jsonb       NOT NULL DEFAULT '{}'::jsonb,
    PRIMARY KEY (projection, version),
    UNIQUE (schema_name)
);

CREATE UNIQUE INDEX IF NOT EXISTS projection_versions_one_live
    ON epitaph.projection_versions (projection) WHERE state = 'live';
