package projection

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/epitaph-dev/epitaph/projection/erasure"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// unfenced leaves the fenced rows out of a page's rows (called by archiveRows,
// in the page's transaction tx) and returns the erasure counter of the fences it
// used. Rows left out as erased with their children are recorded, and the
// rows of their transactions archived by earlier pages that reference them
// are erased from the version (FenceSet.Record): a fence with children
// holds for the whole source transaction, in any order of its pages.
func (s *Service) unfenced(ctx context.Context, tx pgx.Tx, v version.Version, rows []*archiveRow) ([]*archiveRow, int64, error) {
	keep, dropped, epoch, parents, err := erasure.FilterRows(s.fences, ctx, tx, rows)
	if err != nil {
		return nil, 0, err
	}
	if len(parents) > 0 {
		n, err := s.fences.Record(ctx, tx, v.Schema, parents)
		if err != nil {
			return nil, 0, err
		}
		dropped += n
	}
	if dropped > 0 {
		s.retention.Fenced.WithLabelValues(v.Projection, fmt.Sprint(v.Version)).Add(float64(dropped))
		s.log.Info("erased rows not archived (erasure fence)", "version", v.Version, "rows", dropped)
	}
	return keep, epoch, nil
}
