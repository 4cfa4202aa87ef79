// Package capture reads the source database's DELETEs (and TRUNCATEs)
// through a logical replication slot and publishes them to JetStream in
// Epitaph's wire format (package event), exactly once in the stream.
//
// # Source side
//
//   - pgoutput, proto_version 1, messages on, PostgreSQL 14 or newer.
//     BEGIN carries the transaction's commit LSN, so its partition
//     (event.Partition) is known at once and rows are published as they
//     arrive: a transaction is never held in memory.
//   - The publication lists tables explicitly (never FOR ALL TABLES):
//     publish = 'delete, truncate', publish_via_partition_root = true (events
//     name the partitioned parent). With no table list, every ordinary or
//     partitioned table outside pg_catalog, information_schema and Epitaph's
//     own schemas (epitaph, archive, archive_v*) is published, except tables
//     whose deletes would fail once published (no key and REPLICA IDENTITY
//     DEFAULT, or NOTHING): those are named in a warning and skipped, or
//     refused when named explicitly, unless SetReplicaIdentityFull makes them
//     FULL. Key-only tables are reported; their events carry
//     "identity":"key" and only the key columns. The publication follows the
//     configuration at every start (ALTER PUBLICATION .. SET TABLE).
//   - Values are read in text form on a replication connection pinned to
//     DateStyle ISO, IntervalStyle postgres, TimeZone UTC,
//     extra_float_digits 3, bytea_output hex, UTF8, and mapped to JSON
//     losslessly (see event.Event); RestoreSQL is the inverse. Column types
//     are format_type(oid, typmod); the primary key and foreign keys (refs)
//     come from the current catalog, read again on every Relation message.
//   - A row whose message would exceed the broker's max payload is stored in
//     the object store bucket epitaph_<source>_rows (object name = message id
//     with '/' as '_') and the event carries row_ref with its SHA-256.
//   - pg_logical_emit_message with prefix epitaph.mark gives a mark event on
//     every partition; the capture emits epitaph.heartbeat messages every
//     HeartbeatInterval and publishes each, when it comes back through the
//     slot, as a heartbeat mark on every partition.
//
// # No loss, no duplicates
//
// Publishes are asynchronous with a bounded window (MaxInFlight messages,
// 64 MiB). The LSN confirmed to the slot is the end of a transaction (or a
// keepalive's WAL end when nothing is open) only once every message before
// it is acknowledged and, for a 1-replica stream, once the newest of those
// acknowledgements is older than BrokerSyncInterval: JetStream acknowledges
// before it fsyncs, so a power loss can drop acknowledged messages, and the
// slot must still hold them. The price is that the slot retains that much
// more WAL and a restart re-reads up to that much. On a clean stop the
// embedded broker is shut down and its files fsynced, after which
// everything acknowledged is confirmed. Any publish error stops the loop (Wait returns it): the
// process restarts and nothing is skipped.
//
// NATS is connected with no reconnect buffer, and every message carries
// Nats-Expected-Last-Msg-Id = the previous message's id, so the stream always
// holds a prefix of what the capture sent. Every message also carries the
// header Epitaph-Position ("<trigger lsn>#<n>", strictly increasing in
// output order). On start the stream's last message is read and every
// re-sent message at or before its position is skipped; Nats-Msg-Id dedupe
// covers the rest. A re-send is therefore never stored twice, even after an
// outage longer than the dedupe window.
//
// Message ids and numbering: delete and truncate messages share the
// transaction's seq counter (event.MsgID); the commit message counts only
// deletes in rows and tables.
//
// # Gaps
//
// A missing slot while the stream already holds this source's messages, or
// a slot invalidated by max_slot_wal_keep_size (wal_status lost), means
// deletes were lost upstream: capture refuses to start and names
// --recreate-slot. With RecreateSlot it creates the slot and publishes a gap
// event (from the stream's last LSN to the new slot's consistent point) to
// every partition before streaming. A healthy slot is never dropped.
// If the process dies between creating the slot and the gap being
// acknowledged, the next start sees a healthy slot and does not publish the
// gap again: recreate with the operator watching.
//
// # Lifecycle
//
// New validates the configuration; Start connects, checks, sets up and
// starts streaming in the background, returning setup errors (a
// *ConfigError when the operator must change something). Cancelling
// Start's context, or Stop, stops softly: in-flight publishes are awaited
// and what is safe is confirmed. Wait returns the loop's error. The service
// does not reconnect by itself: on any source or broker failure it stops
// with an error, and its supervisor restarts it; the restart resumes from
// the slot without loss or duplicates.
package capture
