package main

// baselineGuard is the DDL guard's function before its fast exit: one
// query over the command's tables with an array parameter (planned anew at
// every call), inside an EXCEPTION block entered at every call, with
// lock_timeout set for the whole function. It is kept so that every run
// measures the current guard against it on the same machine at the same
// moment. Its format arguments are the current guard's: %[1]s the
// publication as a literal, %[2]s the configured tables (NULL: every safe
// table), %[3]s set FULL, %[4]s and %[5]s the gap prefix and reason as
// literals, %[6]s the function, %[7]s whether a key-only table may be
// added.
const baselineGuard = `
CREATE OR REPLACE FUNCTION %[6]s() RETURNS event_trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog SET lock_timeout = '1ms' AS $guard$
DECLARE
  v_pub     constant text    := %[1]s;
  wanted    constant text[]  := %[2]s;
  set_full  constant boolean := %[3]s;
  key_ok    constant boolean := %[7]s;
  v_pub_oid oid;
  targets oid[];
  t record;
  l record;
  unsafe boolean;
  all_full boolean;
BEGIN
  IF current_setting('epitaph.ddl_guard_running', true) = 'on' THEN
    RETURN;
  END IF;
  BEGIN
    SELECT p.oid INTO v_pub_oid FROM pg_publication p WHERE p.pubname = v_pub;
    IF v_pub_oid IS NULL THEN
      RETURN;
    END IF;
    IF TG_TAG = 'DROP INDEX' THEN
      -- A replica identity index dropped: the tables left without it.
      targets := ARRAY(
        SELECT r.oid FROM pg_class r
        WHERE r.relreplident = 'i' AND r.relkind IN ('r', 'p')
          AND NOT EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = r.oid AND i.indisreplident));
    ELSE
      targets := ARRAY(
        SELECT COALESCE((SELECT i.indrelid FROM pg_index i WHERE i.indexrelid = d.objid), d.objid)
        FROM pg_event_trigger_ddl_commands() d WHERE d.classid = 'pg_class'::regclass);
    END IF;
    IF cardinality(targets) = 0 THEN
      RETURN;
    END IF;
    targets := ARRAY(SELECT DISTINCT COALESCE(pg_partition_root(x), x) FROM unnest(targets) x);
    -- The tables the command touched that need a change: most DDL finds
    -- none here.
    FOR t IN
      SELECT c.oid, n.nspname, c.relname, c.relkind, s.published
      FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
      CROSS JOIN LATERAL (
        SELECT EXISTS (SELECT 1 FROM pg_publication_rel pr WHERE pr.prpubid = v_pub_oid AND pr.prrelid = c.oid) AS published,
               bool_or(r.relreplident <> 'f') AS not_full,
               bool_or(NOT (r.relreplident = 'f'
                            OR (r.relreplident = 'd' AND EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = r.oid AND i.indisprimary))
                            OR (r.relreplident = 'i' AND EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = r.oid AND i.indisreplident)))) AS unsafe
        FROM pg_class r
        WHERE r.oid = ANY (CASE WHEN c.relkind = 'p' THEN c.oid || ARRAY(SELECT relid FROM pg_partition_tree(c.oid) WHERE isleaf)
                                ELSE ARRAY[c.oid] END)) s
      WHERE c.oid = ANY (targets)
        AND c.relkind IN ('r', 'p') AND NOT c.relispartition AND c.relpersistence = 'p'
        AND n.nspname NOT IN ('information_schema', 'epitaph', 'archive', 'epitaph_capture')
        AND n.nspname NOT LIKE 'pg\_%%' AND n.nspname !~ '^archive_v[0-9]+$'
        AND NOT EXISTS (SELECT 1 FROM pg_depend d WHERE d.classid = 'pg_class'::regclass AND d.objid = c.oid AND d.deptype = 'e')
        AND (wanted IS NULL OR n.nspname || '.' || c.relname = ANY (wanted) OR s.published)
        AND ((set_full AND s.not_full) OR (s.unsafe AND s.published)
             OR (NOT s.unsafe AND NOT s.published AND (key_ok OR NOT s.not_full)))
    LOOP
      PERFORM set_config('epitaph.ddl_guard_running', 'on', true);
      unsafe := false;
      all_full := true;
      FOR l IN
        SELECT r.oid, rn.nspname, r.relname, r.relreplident,
               EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = r.oid AND i.indisprimary) AS has_pk,
               EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = r.oid AND i.indisreplident) AS has_idx
        FROM pg_class r JOIN pg_namespace rn ON rn.oid = r.relnamespace
        WHERE r.oid = ANY (CASE WHEN t.relkind = 'p' THEN t.oid || ARRAY(SELECT relid FROM pg_partition_tree(t.oid) WHERE isleaf)
                                ELSE ARRAY[t.oid] END)
      LOOP
        IF l.relreplident <> 'f' AND set_full THEN
          BEGIN
            -- Recorded first, for capture uninstall: never FULL without it.
            INSERT INTO epitaph_capture.replica_identity (publication, relid, relation, identity, index_name)
            VALUES (v_pub, l.oid, format('%%I.%%I', l.nspname, l.relname), l.relreplident,
                    (SELECT ic.relname FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid
                      WHERE i.indrelid = l.oid AND i.indisreplident))
            ON CONFLICT (publication, relid) DO NOTHING;
            EXECUTE format('ALTER TABLE %%I.%%I REPLICA IDENTITY FULL', l.nspname, l.relname);
            RAISE NOTICE 'epitaph: set REPLICA IDENTITY FULL on %%.%% (--set-replica-identity-full)', l.nspname, l.relname;
            CONTINUE;
          EXCEPTION WHEN lock_not_available THEN
            RAISE NOTICE 'epitaph: %%.%% is in use by another transaction: REPLICA IDENTITY FULL is left to the capture', l.nspname, l.relname;
          WHEN OTHERS THEN
            RAISE WARNING 'epitaph: could not set REPLICA IDENTITY FULL on %%.%%: %%', l.nspname, l.relname, SQLERRM;
          END;
        END IF;
        IF NOT (l.relreplident = 'f' OR (l.relreplident = 'd' AND l.has_pk) OR (l.relreplident = 'i' AND l.has_idx)) THEN
          unsafe := true;
        END IF;
        IF l.relreplident <> 'f' THEN
          all_full := false;
        END IF;
      END LOOP;
      BEGIN
        IF unsafe AND t.published THEN
          EXECUTE format('ALTER PUBLICATION %%I DROP TABLE %%I.%%I', v_pub, t.nspname, t.relname);
          PERFORM pg_logical_emit_message(true, %[4]s,
            json_build_object('schema', t.nspname, 'table', t.relname, 'reason', %[5]s)::text);
          RAISE WARNING 'epitaph: %%.%% removed from publication %%: it has no usable replica identity, its deletes would fail (a gap is recorded)', t.nspname, t.relname, v_pub;
        ELSIF NOT unsafe AND NOT t.published AND (key_ok OR all_full) THEN
          -- ONLY: an inheritance parent's children are candidates of their own.
          EXECUTE format('ALTER PUBLICATION %%I ADD TABLE %%s%%I.%%I', v_pub,
            CASE WHEN t.relkind = 'r' THEN 'ONLY ' ELSE '' END, t.nspname, t.relname);
        END IF;
      EXCEPTION WHEN lock_not_available THEN
        IF unsafe THEN
          RAISE WARNING 'epitaph: %%.%% has no usable replica identity but publication %% is in use by another transaction: its DELETEs fail until the capture''s catalog poll removes it, once that transaction ends', t.nspname, t.relname, v_pub;
        ELSE
          RAISE NOTICE 'epitaph: publication %% is in use by another transaction: %%.%% is left to the capture''s catalog poll', v_pub, t.nspname, t.relname;
        END IF;
      WHEN OTHERS THEN
        RAISE WARNING 'epitaph: DDL guard could not update publication %% for %%.%%: %%', v_pub, t.nspname, t.relname, SQLERRM;
      END;
    END LOOP;
    PERFORM set_config('epitaph.ddl_guard_running', 'off', true);
  EXCEPTION WHEN lock_not_available THEN
    RAISE NOTICE 'epitaph: DDL guard skipped, a catalog is in use: the capture''s catalog poll takes over';
  WHEN OTHERS THEN
    -- The application's DDL never fails because of the guard.
    RAISE WARNING 'epitaph: DDL guard skipped: %%', SQLERRM;
  END;
END
$guard$`
