package projection

import (
	"context"

	"github.com/jackc/pgx/v5"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/projection/snapshot"
)

// snapshotHooks returns the snapshot package's job creation and the DDL of
// a version's snapshots table.
func snapshotHooks() (func(ctx context.Context, tx pgx.Tx, schema string, commit *event.Event, roots []string) (int, error), func(schema string) string) {
	return snapshot.CreateJobs, snapshot.DDL
}

// snapshotSchemas lists the schemas of the active archive versions, for the
// snapshot batcher.
func (s *Service) snapshotSchemas(ctx context.Context) ([]string, error) {
	vs, err := ListVersions(ctx, s.pool, ArchiveProjection)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, v := range vs {
		if v.Active() {
			out = append(out, v.Schema)
		}
	}
	return out, nil
}

func (s *Service) startSnapshots(ctx context.Context) error {
	b, err := snapshot.NewBatcher(s.pool, snapshot.BatcherConfig{
		Schemas:    s.snapshotSchemas,
		Logger:     s.log,
		Registerer: s.reg,
	})
	if err != nil {
		return err
	}
	s.batcher = b
	return b.Start(ctx)
}
