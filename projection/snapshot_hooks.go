package projection

import (
	"context"

	"github.com/jackc/pgx/v5"

	"github.com/epitaph-dev/epitaph/event"
)

// snapshotHooks returns the snapshot package's job creation and DDL; nil
// until that package provides them.
func snapshotHooks() (func(ctx context.Context, tx pgx.Tx, schema string, commit *event.Event, roots []string) (int, error), func(schema string) string) {
	return nil, nil
}
