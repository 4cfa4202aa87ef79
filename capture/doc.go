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
//     own schemas (exactly epitaph, archive, archive_v<digits>) is published, except tables
//     whose deletes would fail once published (no key and REPLICA IDENTITY
//     DEFAULT, or NOTHING): those are named in a warning and skipped, or
//     refused when named explicitly, unless SetReplicaIdentityFull makes them
//     FULL. Key-only tables are reported; their events carry
//     "identity":"key" and only the key columns. The publication follows the
//     configuration at every start (ALTER PUBLICATION .. SET TABLE), and the
//     catalog while streaming (watch.go: every CatalogPoll and after every
//     Relation message, new safe tables are added, tables that lose their
//     usable identity are removed with a table gap in the same transaction,
//     event.PrefixGap; InstallDDLGuard applies the same rules at DDL time).
//   - A row's identity is its own: a partitioned table's "full" tuple that
//     is NULL outside the primary key may be a key-only leaf's and is
//     labelled key (relation.encodeRow). The key is the primary key when the
//     tuple holds it, else the replica identity index's columns.
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
// holds a prefix of what the capture sent. That chain also lets most row
// messages go without an acknowledgement: up to 64 rows (1 MiB) in a row
// are published as plain NATS messages with no reply subject, and the next
// message asks for one. Its acknowledgement proves every message before it
// stored, in order; a refused message makes every later one fail, so the
// acknowledged one fails too and the loop stops. Commits, marks, gaps and
// truncates always ask. JetStream then builds one acknowledgement per batch
// instead of one per row, and the client tracks one future per batch.
//
// The stream is made with persist mode async when the broker is embedded
// (StreamPersist): the server acknowledges a message once it is in its
// write buffer and writes the buffer a few milliseconds later, instead of a
// write per message. A kill of the process can lose that buffer; the
// trailing confirmation means the source sends it again, and projectors
// check the message at their cursor and rewind over a lost tail
// (projection package).
//
// Every message also carries the header Epitaph-Position ("<trigger
// lsn>#<n>", strictly increasing in output order; the trigger of a
// transaction's messages is its commit LSN, of a non-transactional message
// or a gap the LSN just before the end of its record, since the next commit
// may start exactly there). On start the stream is read back to the last
// message the capture can prove it published (signed with its key, at a
// plausible position, a transaction boundary; trust.go) and every re-sent
// message at or before its position is skipped; the rows stored after it
// are adopted when the replay finds itself there byte for byte. A re-send
// is therefore never stored twice, even after an outage longer than the
// dedupe window, and nothing another writer put in the stream is believed.
//
// Every message also carries Epitaph-Partition-Seq; commits carry the
// transaction's Epitaph-Digest; commits, marks, heartbeats and gaps are
// signed (Epitaph-Key-Id, Epitaph-Signature; see package event).
//
// Message ids and numbering: delete and truncate messages share the
// transaction's seq counter (event.MsgID); the commit message counts only
// deletes in rows and tables.
//
// # First start
//
// The slot is created before the stream: whoever sees the stream can rely on
// every delete committed from then on reaching it. The stream is read first
// (where to resume, whether a missing slot means a gap) and created last; a
// first start that cannot create it drops the slot it just made, so a
// misconfigured start leaves nothing holding WAL on the source.
//
// # Gaps
//
// A missing slot while the stream already holds this source's messages, or
// a slot invalidated by max_slot_wal_keep_size (wal_status lost), means
// deletes were lost upstream: capture refuses to start and names
// --recreate-slot. With RecreateSlot it creates the slot and publishes a gap
// event (from the stream's last LSN to the new slot's consistent point) to
// every partition before streaming. A healthy slot is never dropped (except
// the one a failed first start just made, above).
// If the process dies between creating the slot and the gap being
// acknowledged, the next start sees a healthy slot and does not publish the
// gap again: recreate with the operator watching.
//
// # Standby
//
// With Config.Standby (--standby, EPITAPH_STANDBY) several captures run for
// one slot: one streams, the others wait. The lease is a session advisory
// lock on the source (pg_try_advisory_lock; the key is the FNV-64a hash of
// the database and slot names, shown in pg_locks as classid/objid with
// objsubid 1), held by a dedicated connection for as long as the capture
// runs. A standby takes it before it touches the publication, the stream
// or the slot; until then it polls every StandbyPoll (default 1s) with
// epitaph_capture_active 0, /healthz 200 and /status role "standby", naming
// the holder (pid and application_name, from pg_locks and
// pg_stat_activity). With the lease it also waits for the slot to become
// inactive (the old holder's walsender can outlive its lease session for a
// moment, and a capture started without --standby does not take the lease),
// then sets up and streams as usual: the stream holds a prefix of what any
// capture sent (Nats-Expected-Last-Msg-Id) and the new holder skips what
// the slot re-sends up to the stream's last position, so a takeover neither
// loses nor duplicates a row. Errors of that setup are returned by Wait.
//
// The holder checks its lease every StandbyPoll. When the lease connection
// fails or the lock is gone it stops at once, without the soft stop, with a
// *LeaseLostError (fail closed: another capture may be taking over); its
// supervisor restarts it and it waits as a standby. Every connection to the
// source carries application_name Config.ApplicationName
// ("epitaph-capture:<host>-<pid>"). Standby needs an external JetStream
// server: with the embedded one every capture would have its own stream.
//
// Takeover time is StandbyPoll plus setup (well under a second on a healthy
// source) after PostgreSQL has ended the old holder's lease session and
// walsender:
//
//   - the holder's process dies on a live host (crash, SIGKILL, OOM kill):
//     the kernel closes its sockets and PostgreSQL ends both sessions at
//     once; the takeover takes 1-2s (under 1.1s in the SIGKILL test).
//   - a clean stop (SIGTERM): the soft stop first (in-flight publishes are
//     awaited, at most 30s), then as above.
//   - the holder's host dies or is cut off: PostgreSQL only learns it from
//     TCP. The lease connection sets tcp_keepalives_idle=10,
//     tcp_keepalives_interval=5, tcp_keepalives_count=3 and
//     tcp_user_timeout=20000 for its session (parameters in the source URL
//     win), so the lease goes after about 25s; the walsender ends after
//     wal_sender_timeout without replies (default 60s; capture replies at
//     least every 10s, so 30s is safe). The bound is
//     max(25s, wal_sender_timeout) + StandbyPoll + setup: about 1 minute
//     with the defaults, about 30s with wal_sender_timeout = 30s, the
//     setting we recommend on the source. A holder cut off from PostgreSQL
//     but not from NATS notices within StandbyPoll + max(2*StandbyPoll, 5s)
//     and stops; anything it still had in flight cannot break the stream's
//     prefix (expected last message id).
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
