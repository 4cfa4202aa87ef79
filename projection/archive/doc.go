// Package archive is the read model of the built-in "archive" projection:
// the tables of one version (DDL) and the insert of their rows, the gaps
// table, and the reader views in schema "archive" that point at the live
// version.
//
// # Contract
//
// Version n of the archive lives in schema archive_v<n> (Schema). DDL
// creates its tables idempotently: rows (one archived delete per
// (source, commit_lsn, seq)), gaps (what the archive is known to miss:
// lost_upstream, removed_from_stream, truncate) and pending_truncates (a
// truncate waiting for its transaction's signed commit). Running DDL again
// on an existing schema adds the columns later releases introduced
// without taking an exclusive lock when they already exist.
//
// The reader views archive.rows, archive.gaps, archive.snapshots and
// archive.status are the only objects readers query. PointViews re-points
// them at one version inside the caller's transaction, so readers see the
// old or the new version, never a mix and never a missing view; a view
// that already shows the version (its comment and columns match) is left
// alone, so a starting projector never locks what readers use. The caller
// holds the version lock (package projection/version's PointViews takes
// it). archive.rows shows verified, unexpired rows only; archive.snapshots
// the documents of unexpired roots only.
//
// StatusQuery is the SQL of archive.status for any set of versions: whether
// a version is ready (leased, advancing, lag within its thresholds, no
// open quarantine, no unacknowledged blocking gap), why not, and how far
// it is complete. It reads only epitaph tables and the versions' gaps
// tables, never anything a worker locks, so readers never wait on the
// projector. FailingAttempts is the number of consecutive failed attempts
// that make a partition count as failing there and in package
// projection/status.
//
// InsertRows archives delete events (Row) with one set-based statement
// (two when some of them are archived already), idempotently: an event
// applied twice is archived once. A row of a
// transaction not verified yet is inserted invisible. InsertGap records a
// Gap inside the transaction that applies it, once per gap however many
// partitions apply its copies.
//
// The package imports no other package of the projector: everything above
// it (version, status, erasure, retention, trust, the runtime) builds on
// it.
package archive
