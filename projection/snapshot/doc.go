// Package snapshot builds the snapshot read model: for every deleted row of
// a configured root table (say public.orders), one JSON document holding
// that row with every row of the same source transaction that descends from
// it by foreign key, from any table and to any depth, assembled after the
// fact from the archive alone (<schema>.rows of a version schema such as
// archive_v1).
//
// Lifecycle. The projector runtime, applying a transaction's commit event
// in the target transaction that also archived every row of it (the
// transaction fits in the page), calls CreateAssembled: the documents are
// assembled in memory, by the same code and rules as a batch, and written
// complete in that transaction. A transaction whose rows earlier pages
// archived too (it spans pages) goes to CreateFromArchive in the same
// target transaction: its rows are read back from the archive with the
// batch's query and its documents assembled and written complete the same
// way. A group neither can complete now (rows missing or rejected) gets
// CreateJobs: one pending job per archived root-table row. RunBatch (one batch, any
// host, any schedule; the Batcher runs it on an interval, the live version
// first) claims due jobs with FOR UPDATE SKIP LOCKED, with the other due
// jobs of their transactions, reads the rows of all claimed transactions
// in one query, and turns each job into complete (payload, fingerprint,
// completed_at), pending again (retry_count+1 and a later next_attempt_at:
// retries need no scheduler) or failed (a sanitized failure_reason), all
// written by one statement. When archive rows of a transaction arrive
// after its commit was applied (a quarantined event replayed), the runtime
// calls Invalidate and the jobs are rebuilt.
//
// Choices where the wire format and the read model leave them open:
//   - Completeness is the commit's per-table counts: a group with fewer
//     archive rows of some table than counted is short (retried, then failed
//     naming each short table as "schema.table has N of M rows"); more rows
//     than counted is not an error; a commit without counts checks nothing.
//     A group with no archive rows fails at once.
//   - Nesting: row C is a child of row P when one of C's refs (the event's
//     foreign keys) names P's table and C's values in the ref's columns
//     equal P's in the referenced columns (all non-NULL; values compare by
//     text form, so integer 7 matches numeric "7"). A document is walked
//     breadth first from its root, each row placed once under the parent
//     nearest the root; a row already placed is not entered again, so
//     self-references and cycles terminate. Children arrays are in deletion
//     order (seq), keyed by "schema.table".
//   - Every root-table row gets its own job, also one nested under another
//     deleted root-table row (a category under a deleted category): its
//     document is its own subtree. A row that descends from two roots
//     appears in both documents. Rows descending from no root are left out
//     and counted in meta.unrelated_count.
//   - meta: correlation_id, archived_at (when the last row of the document
//     was archived), commit_time, entity_count (rows in the document, root
//     included), unrelated_count, transaction_rows.
//   - The fingerprint is the sha256 of the sorted (commit_lsn, seq)
//     identities of all the transaction's archive rows read for the
//     document, so any row added or removed changes it.
//   - Rows archived with replica identity "key"/"nothing" carry only key
//     columns: they nest only where those columns hold the foreign key.
//
// What a host runtime calls (the projector does this):
//   - creating a version schema: Migrate(ctx, tx, schema) (or exec DDL(schema))
//     after <schema>.rows exists; the reader view is
//     CREATE OR REPLACE VIEW archive.snapshots AS SELECT * FROM <schema>.snapshots;
//   - applying a page, in its target transaction: after inserting archive
//     rows with INSERT .. ON CONFLICT DO NOTHING RETURNING correlation_id,
//     Invalidate(ctx, tx, schema, <distinct correlation ids actually
//     inserted>) (a no-op for transactions whose commit is not applied yet);
//     then for the commit events, after their rows: CreateAssembled(ctx,
//     tx, schema, <groups whose rows this transaction archived, all of
//     them, with the archived_at RETURNING gave>, roots) and
//     CreateFromArchive(ctx, tx, schema, <the other commits>, roots) (it
//     calls CreateJobs for what it cannot complete);
//   - in the background: a Batcher per process (NewBatcher(pool,
//     BatcherConfig{Targets: <version schemas that have snapshots, the
//     live one marked>, Registerer: reg}), Start, Wake after committing
//     pending jobs, Stop), or RunBatch from any other host.
//
// Cutover (the projector's version lifecycle): Backlog is the readiness
// input, Behind what promote refuses, CompareDocuments what compare adds.
package snapshot
