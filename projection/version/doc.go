// Package version is the registry of projection versions and their
// administration: the rows of epitaph.projection_versions (Version,
// ListVersions, GetVersion), the states a version moves through, the
// version lock, creating the next version for a rebuild (CreateVersion,
// `projector rebuild`), promoting it (Promote), rolling back (Rollback),
// retiring a version (Retire) and comparing two versions (Compare).
//
// # Contract
//
// A version moves building -> catching_up -> ready -> live -> retired;
// promotion turns the previous live version back to ready (it keeps
// consuming, so a rollback is instant and current). A version whose DDL
// is rejected is failed and never run. The runtime (package projection)
// moves versions from building to ready (SetState there); this package
// makes them live, ready again, retired or failed, always in one
// transaction that holds the version lock (LockVersions), so creating
// versions and re-pointing the reader views are serialized across
// workers and operators.
//
// EnsureArchive gives the built-in archive projection its first version
// (live, created on the first run) and (re)creates the tables of every
// active version idempotently; a version other than the live one whose
// tables cannot be created is marked failed instead of blocking the
// others. CreateVersionTables runs a version's DDL (package
// projection/archive, plus the caller's extra DDL such as the snapshot
// tables) in a savepoint. PointViews takes the version lock and
// re-points the reader views at a version (archive.PointViews).
//
// The consumer group of a target database (DefaultGroup, ValidateGroup)
// prefixes every durable consumer; StreamPartitions reads a source
// stream's partition count from its metadata; PositionLSN is the source
// position a message stands for, as the runtime's cursors record it.
//
// Imports point one way: this package builds on projection/archive and
// projection/snapshot and never imports the runtime (package projection)
// or the packages above it; the runtime imports this one.
package version

import "github.com/jackc/pgx/v5"

// ident quotes a (schema-qualified) SQL identifier.
func ident(parts ...string) string { return pgx.Identifier(parts).Sanitize() }
