package archive

import (
	"fmt"

	"github.com/jackc/pgx/v5"
)

// Projection is the name of the built-in archive projection.
const Projection = "archive"

// ReaderSchema is the reader-facing schema: views onto the live version.
const ReaderSchema = "archive"

// Schema is the schema of version n of the archive: archive_v<n>.
func Schema(n int) string { return fmt.Sprintf("archive_v%d", n) }

// Ident quotes a qualified SQL identifier (schema, table, ...).
func Ident(parts ...string) string { return pgx.Identifier(parts).Sanitize() }

// VersionSchema is the schema of one version and whether it has a
// snapshots table.
type VersionSchema struct {
	Schema    string
	Snapshots bool
}
