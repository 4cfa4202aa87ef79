package version

import (
	"context"

	"github.com/jackc/pgx/v5"

	"github.com/epitaph-dev/epitaph/projection/archive"
)

// PointViews re-points the reader views of schema "archive" (archive.rows,
// archive.gaps, and archive.snapshots when that version has a snapshots table) at
// archive_v<version>, inside tx: readers see the old or the new version,
// never a mix and never a missing view. It takes the version lock (held to
// the end of tx, re-entrant), so a worker re-pointing the views from the
// versions it read cannot undo a caller that changed the states itself.
func PointViews(ctx context.Context, tx pgx.Tx, version int) error {
	if err := LockVersions(ctx, tx); err != nil {
		return err
	}
	return archive.PointViews(ctx, tx, version)
}
