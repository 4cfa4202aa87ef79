// Package snapshot builds the snapshot read model: for every deleted row of
// a configured root table (say public.orders), one JSON document holding
// that row with every row of the same source transaction that descends from
// it by foreign key, from any table and to any depth, assembled from the
// archive alone (<schema>.rows of a version schema such as archive_v1).
// docs/projector.md states the document's shape for readers.
//
// Contract:
//   - A document is complete only when the transaction's archived rows
//     match the signed commit's per-table counts, less the rows an erasure
//     fenced or purged (<schema>.snapshot_fenced, Discount); short groups
//     are retried, then failed naming each table as "schema.table has N of
//     M rows".
//   - Row C nests under row P when one of C's refs names P's table and the
//     values are equal by text form; each row is placed once, breadth first
//     under the parent nearest the root, so cycles terminate. Every
//     root-table row gets its own document; rows under no root are counted
//     in meta.unrelated_count.
//   - The fingerprint is the sha256 of the sorted (commit_lsn, seq) of the
//     rows read, so any row added or removed changes it.
//
// What a host calls (the projector runtime does):
//   - Migrate(ctx, tx, schema) when it creates a version schema.
//   - In the target transaction that applies a page: Invalidate for the
//     correlation ids it inserted (a replayed row of an applied commit),
//     then CreateAssembled for commits whose rows the page archived whole
//     (documents assembled in memory and written complete),
//     CreateFromArchive for commits spanning pages (rows read back), which
//     calls CreateJobs for what it cannot complete yet.
//   - In the background: a Batcher per process, or RunBatch from any host:
//     it claims due jobs with FOR UPDATE SKIP LOCKED and turns each into
//     complete, pending again (retry_count+1, a later next_attempt_at) or
//     failed (a sanitized failure_reason), in one statement.
//   - At cutover: Backlog feeds readiness, Behind is what promote refuses,
//     CompareDocuments is what compare adds.
package snapshot
