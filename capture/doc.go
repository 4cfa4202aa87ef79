// Package capture reads the source database's DELETEs (and TRUNCATEs)
// through a logical replication slot (pgoutput) and publishes them to
// JetStream in Epitaph's wire format (package event), each row once in the
// stream. docs/capture.md is the user's guide; this is the contract.
//
// What it publishes: a delete event per deleted row of the published
// tables, a truncate event per truncated table, a commit per transaction
// that had either, marks and heartbeats on every partition, and gap events
// where deletes were lost. Values are lossless (see event.Event); a row too
// large for one message is put in the object store and referenced.
//
// Guarantees:
//   - No loss: a position is confirmed to the slot only once every message
//     before it is acknowledged and, for a 1-replica stream, synced by the
//     broker (Config.BrokerSyncInterval); the slot holds the rest.
//   - No duplicates: the stream always holds a prefix of what the capture
//     sent (every message expects the previous one's id), and a new session
//     resumes after the last message the stream proves the capture
//     published (its signature, at a plausible position), adopting the rows
//     stored after it byte for byte. Nothing another writer put in the
//     stream is believed.
//   - Authenticity: commits, marks, heartbeats and gaps are signed with the
//     capture's key; every row and truncate is in its commit's signed digest.
//   - Fail closed: an invalidated slot, or a missing one while the stream
//     holds this source's messages, is a *ConfigError naming
//     Config.RecreateSlot, which publishes a gap for the lost range. A healthy slot is never dropped;
//     the slot is created before the stream, and a first start that fails
//     drops the slot it made.
//
// Lifecycle: New validates the Config; Start connects, checks, sets up the
// publication, the stream and the slot, and streams in the background,
// returning setup errors (a *ConfigError when the operator must change
// something). Stop stops softly: publishes in flight are awaited and what
// is safe is confirmed; cancelling Start's context is the hard stop. Outages of the
// source or the broker are ridden out with a new session (backoff, for as
// long as they last); any other error ends the service and Wait returns
// it. With Config.Standby several captures share one slot through a
// session advisory lock on the source (lease.go): one streams, the others
// wait, and a holder that loses the lock stops at once with a
// *LeaseLostError.
package capture
