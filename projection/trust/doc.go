// Package trust is what a target trusts: the ed25519 keys whose
// signatures the projector believes, and the recorded legacy boundaries
// of streams written before signing.
//
// # Contract
//
// The capture signs every commit, mark, heartbeat and gap it publishes;
// a commit's signed digest covers its transaction's row messages. The
// runtime (package projection, verify.go) archives a transaction visibly
// only once its commit verifies with a key listed here, and quarantines
// what does not verify under CategoryUnauthenticated, believing nothing
// of it (it moves neither the watermark nor the partition's position).
//
// Keys (epitaph.trusted_keys). TrustKey adds a public key, idempotently: a
// key already trusted keeps its record and TrustKey reports false. Keys
// are only ever added, so messages signed by an older key stay verifiable
// after a rotation. TrustedKeys lists them, oldest first. While no key is
// trusted yet, a projector trusts the first key whose signature verifies
// (trust on first use), read from the message's event.HeaderPublicKey or
// from the stream's metadata under MetaSigningKey, and records it here.
//
// Legacy boundaries (epitaph.legacy_boundaries). Messages at or before a
// partition's legacy boundary were written before the stream was signed
// and are believed as before. Only an operator records one
// (RecordLegacyBoundary, from projector trust-key --legacy-boundary); the
// runtime never infers it, so without one every unsigned message is
// quarantined. LegacyBoundaries lists them, per stream and partition.
//
// The page verification itself (the pending window, the slow path over
// candidate messages, suspected gaps) is the runtime's: it runs inside the
// apply's transaction on the runtime's own items.
//
// Imports point one way: this package builds on package event and
// quarantine only; the runtime and `projector trust-key` import it.
package trust
