// Package version is the administration of projection versions: creating
// the next version for a rebuild (CreateVersion, `projector rebuild`),
// promoting it (Promote), rolling back (Rollback), retiring a version
// (Retire) and comparing two versions (Compare). The runtime (package
// projection) builds, catches up and serves the versions; it never
// imports this package. What this package needs of the runtime is its
// exported API: the version rows (projection.ListVersions, GetVersion),
// the version lock (projection.LockVersions), a version's tables
// (projection.CreateVersionTables), the reader views
// (projection.PointViews), the stream's partition count
// (projection.StreamPartitions) and the position a message stands for
// (projection.PositionLSN).
//
// The lifecycle a version goes through is described in package
// projection (doc.go, "Lifecycle"); the states are projection.State*.
package version

import "github.com/jackc/pgx/v5"

// ident quotes a (schema-qualified) SQL identifier.
func ident(parts ...string) string { return pgx.Identifier(parts).Sanitize() }
