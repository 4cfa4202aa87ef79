// Package revalidate decides, before every attempt of a row handler's
// delivery, whether the deletion it was queued for still stands. A queued delivery is evidence of an earlier state,
// not authority: between queueing and running, the key can be inserted
// again, the row erased, a row of the same source transaction archived
// late, the key deleted again, the handler revoked.
//
// The promise a delivery stores is small: the archived row's identity and a
// fingerprint of the complete set it was queued for — every verified, live
// archive row of the same source transaction (correlation_id) and table,
// identities and values, in (commit_lsn, seq) order — with the cheap pair
// (row count, greatest archive identity) computed over the same predicate.
// StampGroup sets them in SQL when a group's deliveries are released.
//
// Evaluator.Evaluate re-reads authoritative state on every call (nothing is
// cached but connection pools) and returns one outcome: send,
// stop_completed, stop_changed, stop_revoked, stop_superseded or defer.
// The cheap pair is checked first with one indexed aggregate; the whole set
// is read and hashed only when the pair differs. Record writes the outcome,
// the observed fingerprint and the time on the delivery; for stop_changed it
// queues the next generation of the delivery for the current set, in the
// same transaction.
package revalidate
