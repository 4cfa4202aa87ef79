// Package projection is the projector runtime: partitioned workers that
// apply a source's JetStream stream to versioned read models in the target
// Postgres, and the built-in "archive" projection.
//
// # Packages
//
// The runtime (this package: the service, the partition workers, the
// apply, page verification, roots, version states, replay) builds on the
// jobs below it, and imports point one way (imports_test.go checks it):
//
//	projection/archive, projection/snapshot   the read model: tables, views, gaps table; snapshot documents
//	projection/version                        the version registry and its administration
//	projection/status, erasure, retention,    readiness, waits, gaps, status; erasures, fences, legal holds;
//	projection/trust                          retention cleanup; trusted keys
//	projection                                the runtime
//
// Readers (packages readapi, statuspage) import status, archive and
// version, never the runtime.
//
// # Guarantees
//
// The work unit is partition p of version N of a projection. Its durable
// consumer is <name>-v<N>-p<p> (filtered on event.PartitionFilter) and its
// progress row (package progress) is never shared with another version. A
// worker holds a lease on the unit; it fetches pages of at most 500 events
// and applies them in ONE target transaction together with the cursor's
// compare-and-swap advance (WHERE cursor = old AND epoch = lease epoch),
// commits, then acknowledges to JetStream. While the partition is behind, a
// transaction takes up to two fetches already waiting (at most 4 MiB) and
// ends at its last commit event; the unfinished source transaction after it
// stays delivered, unacknowledged, and starts the next transaction, so a
// source transaction of up to 1,500 events is applied whole. The Postgres cursor is the truth:
// the consumer is deleted and recreated at cursor+1 whenever it does not
// stand exactly there. A worker whose CAS fails lost its lease and stops the
// partition. Applying is idempotent (a row's identity is (source,
// commit_lsn, seq); INSERT .. ON CONFLICT DO NOTHING), so delivery is
// at-least-once and the archive holds each event once.
//
// # Choices
//
//   - Lost stream tail. The progress row keeps the identity of the message
//     at the cursor (its Nats-Msg-Id) and its source position. Before every
//     page (and at start) the message at the cursor is checked; when the
//     stream ends below the cursor or another message sits there, the
//     partition is rewound to just before its first message whose source
//     position is at or after the last applied commit LSN (binary search
//     over the stream; messages of a partition are in source order), or to
//     the start of the partition when that cannot be told, and re-applied.
//     A cursor below the stream's first sequence (purged, aged out) is fine.
//     Each page must also start at the partition's next message after the
//     cursor and be delivered contiguously to this worker, else the consumer
//     is reset.
//   - Failures. Permanent ones (event.DecodeError, Postgres class 22/23/54
//     errors on an event, a missing or corrupt large-row object) go to
//     epitaph.quarantine in the same transaction and the partition moves on;
//     a page is first applied without savepoints, and only when it fails
//     permanently is it applied again with savepoints and bisection, so
//     only the failing events are set aside. Everything else is transient:
//     exponential backoff (capped by Config.MaxBackoff), re-read the cursor,
//     reset the consumer, fetch again. Never quarantined.
//   - Large rows above Config.MaxRowBytes (default 256 MiB, by the
//     event's ObjectRef.Size) are quarantined as oversized and never
//     fetched.
//   - Hold mode (Config.HoldOnQuarantine, holdonquarantine.go; off by default, then no
//     extra query): a delete whose source row (schema, table, key) has an
//     open quarantine entry of its version, or an earlier event in the same
//     page being quarantined, is quarantined as held instead of applied, so
//     the order per row is kept; quarantine.Replay releases held entries in
//     stream order once the entry in front is replayed or discarded. Exact
//     within a partition; across partitions (a row deleted in transactions
//     of different partitions) only behind entries committed before the page.
//   - is_root is NULL while the transaction's commit has not been applied
//     (the transaction may still be incomplete), then true for a row no
//     other row of its transaction is a parent of by the event's refs (all
//     foreign-key values present, non-null and equal, as JSON, to the
//     parent's referenced columns). It is computed in memory when a whole
//     transaction is in one page, else in SQL when the commit is applied.
//   - expires_at = commit_time + Config.ArchiveTTL["schema.table"] (or
//     ["*"]); NULL (kept forever) when neither is set.
//   - Source watermark: progress.source_lsn rises with commits, marks,
//     heartbeats and gaps: the partition reflects the source up to it.
//     archive.status.source_lsn is the minimum over the live version's
//     partitions: the archive is complete up to that source LSN.
//   - Readiness. The reader views in schema "archive" (rows, snapshots)
//     point at the live version's schema archive_v<N>. archive.status says
//     per version whether it can be trusted: ready is false while a
//     partition has no live lease or has never advanced, or quarantine is
//     open; an empty archive.rows is never to be read as "nothing was
//     deleted" without it.
//   - Versions. Every version not retired (or failed) is applied side by
//     side; a new version (a row in epitaph.projection_versions) gets its
//     schema, tables and progress rows on the next balance round and is
//     built from the start of the stream. Version 1 of "archive" is created
//     live on the first run. version.PointViews re-points the reader views in the
//     caller's transaction (promotion, rollback).
//   - Lifecycle (states.go here; the registry and the
//     administration are package projection/version). CreateVersion
//     (`projector rebuild`) makes version N+1, building, with a new schema
//     from the projection's own DDL, new consumers and progress rows, and
//     the boundary: the stream's last sequence and its source LSN. It is
//     built by the workers' CURRENT code and configuration (TTL policy,
//     snapshot roots apply to all history). Workers move it building ->
//     catching_up (every partition applied its messages up to the
//     boundary) -> ready (lag and oldest pending below Config.ReadyMaxLag
//     and ReadyMaxPendingAge, the snapshot backlog likewise, no open
//     quarantine; back to catching_up when twice as far behind). Promote
//     (one transaction: the old live version becomes ready and keeps
//     consuming, the new one live, views re-pointed; refused without force
//     while a document complete in the live version is pending or failed
//     in the new one), Rollback (the most recently live active version is live
//     again), Retire (not the live one: workers stop it on their next
//     balance, its consumers and progress rows are deleted, quarantine rows
//     kept, Drop drops its schema). A version whose DDL is rejected is
//     failed and not run. Pages of non-live versions share
//     Config.RebuildShare of a worker while the live version is busy; the
//     side-effect hook Config.SideEffects runs for the live version only.
//     status.WaitComplete (`projector wait --lsn`, GET /wait) returns once the
//     live version is complete up to an LSN, and fails at once naming the
//     gaps and quarantined events that keep it from ever being (WaitLSN
//     only compares the watermarks). Compare compares two versions up to
//     the watermark both reflect.
//   - Readers are told (packages status and archive): gap and
//     truncate events become rows of the version's gaps table
//     (archive.gaps) in the transaction that applies them; archive.status
//     says whether a version is ready (leased, advancing, lag sampled by
//     the workers within the thresholds, no open quarantine, no
//     unacknowledged blocking gap), why not, and how far it is complete;
//     status.AckGap acknowledges a gap with a reason.
//   - Fair sharing: a worker claims up to ceil(P / live workers) partitions
//     of each version (live = heartbeat within its lease TTL); a worker over
//     its share soft-stops and releases the excess; a graceful Stop releases
//     everything at once; a dead worker's partitions are taken over after
//     their lease expires (default 15s).
//   - Lag: lag_events counts the partition's messages after the cursor;
//     lag_seconds and oldest_pending_age_seconds are the age (stream
//     timestamp) of the first message after the cursor, 0 when caught up.
package projection
