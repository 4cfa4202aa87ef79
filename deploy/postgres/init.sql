-- Runs once, when the compose Postgres volume is first initialised
-- (docker-entrypoint-initdb.d). The application database `app` is made by
-- POSTGRES_DB; Epitaph's read models and control schema go into `archive`.
-- The source could equally be the target: Epitaph never publishes its own
-- schemas (design §3).
CREATE DATABASE archive;
