-- 0014_forget_pages: erasure fences that hold across the pages of a source
-- transaction, and what an erasure could not check (issue 17).
--
-- erased_parents: the rows an apply (or an erase) left out or removed
-- because a fence with children covers them, kept so that their children in
-- another page of the same source transaction (earlier or later, and in a
-- rebuild) are erased too. Like a fence it holds no value: one row per
-- column of the erased row, with the HMAC-SHA256 (epitaph.erasure_secret's
-- key) of that column's canonical JSON value; a child is erased when, for
-- one of its foreign keys to that table, every referencing column's digest
-- equals the referenced column's digest of one such row.
CREATE TABLE IF NOT EXISTS epitaph.erased_parents (
    source      text    NOT NULL,
    commit_lsn  pg_lsn  NOT NULL,
    seq         integer NOT NULL,
    schema_name text    NOT NULL,
    table_name  text    NOT NULL,
    column_name text    NOT NULL,
    digest      text    NOT NULL,
    erasure_id  bigint  NOT NULL REFERENCES epitaph.erasures (id),
    PRIMARY KEY (source, commit_lsn, seq, column_name)
);

-- unchecked counts, per place, what the last run of an erasure could not
-- match by value: quarantine entries whose message cannot be decoded (and
-- whose raw bytes, source key and message id did not match either).
ALTER TABLE epitaph.erasures ADD COLUMN IF NOT EXISTS unchecked jsonb NOT NULL DEFAULT '{}';
