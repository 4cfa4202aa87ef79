// Package projection is the projector runtime: partitioned workers that
// apply a source's JetStream stream to versioned read models in the target
// PostgreSQL, and the built-in "archive" projection.
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
// Readers (the read API, the status page) import status, archive and
// version, never the runtime.
//
// # Guarantees
//
// The work unit is partition p of version N of a projection: a durable
// consumer and a progress row (package progress) of its own. A worker holds
// a lease on the unit, fetches pages of events and applies each page in ONE
// target transaction together with the cursor's compare-and-swap advance
// (fenced by the lease epoch), commits, then acknowledges to JetStream. The
// PostgreSQL cursor is the truth: the consumer is re-created at cursor+1
// whenever it does not stand exactly there, and a stream that lost its
// tail below the cursor is re-applied from the last applied commit.
// Applying is idempotent (a row's identity is (source, commit_lsn, seq)),
// so delivery is at-least-once and the archive holds each event once.
//
// Rows become visible only with their transaction's verified commit (a
// signature by a trusted key over a digest of its rows); what fails
// verification or cannot be applied goes to the quarantine in the same
// transaction, and what is known to be missing becomes a gap row, so
// archive.status can say whether, and up to where, the archive is
// complete. Every version not retired is applied side by side; a rebuild is
// a new version built by the current code from the start of the stream,
// promoted and rolled back in one transaction by package version.
//
// The details (lost tails, failures and bisection, hold mode, roots, TTLs,
// watermarks, readiness, fair sharing, lag) are documented for operators in
// docs/projector.md.
package projection
