package projection

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/projection/erasure"
	"github.com/epitaph-dev/epitaph/projection/snapshot"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// unfenced leaves the fenced rows out of a page's rows (called by archiveRows,
// in the page's transaction tx) and returns the erasure counter of the fences it
// used, and the transactions (by commit LSN) of which it left rows out.
// Rows left out as erased with their children are recorded, and the
// rows of their transactions archived by earlier pages that reference them
// are erased from the version (FenceSet.Record): a fence with children
// holds for the whole source transaction, in any order of its pages. With
// snapshots, every row left out is taken out of its transaction's expected
// counts (snapshot.Discount), so that the other documents of the
// transaction complete without it.
func (s *Service) unfenced(ctx context.Context, tx pgx.Tx, v version.Version, rows []*archiveRow) ([]*archiveRow, int64, map[event.LSN]bool, error) {
	keep, dropped, epoch, parents, err := erasure.FilterRows(s.fences, ctx, tx, rows)
	if err != nil {
		return nil, 0, nil, err
	}
	snapshots := s.extraDDL != nil
	if len(parents) > 0 {
		n, err := s.fences.Record(ctx, tx, v.Schema, snapshots, parents)
		if err != nil {
			return nil, 0, nil, err
		}
		dropped += n
	}
	if dropped == 0 {
		return keep, epoch, nil, nil
	}
	s.retention.Fenced.WithLabelValues(v.Projection, fmt.Sprint(v.Version)).Add(float64(dropped))
	s.log.Info("erased rows not archived (erasure fence)", "version", v.Version, "rows", dropped)
	kept := make(map[*archiveRow]bool, len(keep))
	for _, r := range keep {
		kept[r] = true
	}
	txs := map[event.LSN]bool{}
	var gone []snapshot.FencedRow
	for _, r := range rows {
		if kept[r] {
			continue
		}
		e := r.ev
		txs[e.CommitLSN] = true
		gone = append(gone, snapshot.FencedRow{CorrelationID: e.CorrelationID(), Source: e.Source, CommitLSN: e.CommitLSN,
			Seq: e.Seq, Table: e.QualifiedTable()})
	}
	if snapshots {
		n, err := snapshot.Discount(ctx, tx, v.Schema, gone)
		if err != nil {
			return nil, 0, nil, err
		}
		if n > 0 {
			// A transaction whose commit was applied before (a replayed
			// row fenced now): its jobs, parked or waiting out a retry,
			// are due again with the counts they can meet.
			ids := make([]string, 0, len(gone))
			for _, g := range gone {
				if len(ids) == 0 || ids[len(ids)-1] != g.CorrelationID {
					ids = append(ids, g.CorrelationID)
				}
			}
			if _, err := snapshot.Invalidate(ctx, tx, v.Schema, ids); err != nil {
				return nil, 0, nil, err
			}
		}
	}
	return keep, epoch, txs, nil
}
