package projection

import (
	"context"

	"github.com/jackc/pgx/v5"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/snapshot"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// snapshotHooks returns the DDL of a version's snapshots table.
func snapshotHooks() func(schema string) string { return snapshot.DDL }

// snapshotJobs creates, in the apply transaction, the snapshot jobs of
// commits (of page p), after their rows are archived. A transaction whose rows
// were all archived by this transaction (it fits in the page: inPage, and
// every row of it inserted now) has its documents assembled in memory and
// written complete; one whose rows span pages has them assembled from the
// archive (its earlier pages' rows and this page's), read in this
// transaction, and written complete too, as is one of which the erasure
// fences left rows out (fenced: the archive knows which). What neither can complete now
// (rows missing or rejected) gets pending jobs for the batcher. It returns
// the number of jobs to hand to a batch after the commit (the pending
// ones, and those a replayed commit found already made).
//
// This is the seam for verified groups: a group reaches the in-page
// assembly only once its rows are known complete; a check that a group's
// rows are authentic belongs before this call, and a group failing it must
// not be handed to either path.
func (s *Service) snapshotJobs(ctx context.Context, tx pgx.Tx, p *applyPlan, commits []*item, archived map[string]archive.Inserted) (int, error) {
	v, rows, inPage, fenced := p.v, p.rows, p.inPage, p.fenced
	if len(s.cfg.SnapshotRoots) == 0 {
		return 0, nil
	}
	var byTx map[event.LSN][]snapshot.Row
	var groups []snapshot.Group
	var spanning []*event.Event
	for _, c := range commits {
		a, ok := archived[c.ev.CorrelationID()]
		if inPage[c.ev.CommitLSN] && !fenced[c.ev.CommitLSN] && ok && a.Rows == c.ev.Rows {
			if byTx == nil {
				byTx = snapshotRows(rows)
			}
			groups = append(groups, snapshot.Group{Commit: c.ev, Rows: byTx[c.ev.CommitLSN], ArchivedAt: a.ArchivedAt})
			continue
		}
		spanning = append(spanning, c.ev)
	}
	_, pending, err := snapshot.CreateFromArchive(ctx, tx, v.Schema, spanning, s.cfg.SnapshotRoots)
	if err != nil {
		return pending, err
	}
	_, n, err := snapshot.CreateAssembled(ctx, tx, v.Schema, groups, s.cfg.SnapshotRoots)
	return pending + n, err
}

// snapshotsCommitted runs, right after the apply transaction committed,
// one batch of the batcher's for the jobs this page's commits left pending
// (a replayed commit's jobs, groups not complete at the commit): it claims only
// those transactions' jobs (RunBatchFor), so their documents are complete a
// moment after their commit is applied, instead of queueing behind the
// batcher's older work while the apply runs at full speed. The apply waits
// for it: the documents keep pace with the commits they follow. What it
// leaves (a failure, a group not complete yet, jobs another batch holds) is
// the batcher's, which it wakes when the batch claimed fewer than the
// pending jobs the page made.
func (s *Service) snapshotsCommitted(ctx context.Context, v version.Version, commits []*item, pending int) {
	txs := make([]snapshot.TxRef, 0, len(commits))
	for _, c := range commits {
		if c.category == "" {
			txs = append(txs, snapshot.TxRef{Source: c.ev.Source, XID: c.ev.XID, CommitLSN: c.ev.CommitLSN})
		}
	}
	res, err := snapshot.RunBatchFor(ctx, s.pool, snapshot.Config{Schema: v.Schema}, txs)
	if err != nil && ctx.Err() == nil {
		s.log.Warn("snapshot batch after commit failed; left to the batcher", "schema", v.Schema, "err", err)
	}
	if err != nil || res.Claimed < pending {
		s.batcher.Wake()
	}
}

// snapshotRows are the page's applied rows by transaction, as archived.
func snapshotRows(rows []*archiveRow) map[event.LSN][]snapshot.Row {
	out := map[event.LSN][]snapshot.Row{}
	for _, r := range rows {
		if r.item.category != "" {
			continue
		}
		e := r.ev
		out[e.CommitLSN] = append(out[e.CommitLSN], snapshot.Row{Schema: e.Schema, Table: e.Table, Identity: e.Identity,
			Key: e.Key, Row: r.row, Refs: e.Refs, Seq: e.Seq, CommitTime: e.CommitTime})
	}
	return out
}

// snapshotTargets lists the schemas of the active archive versions, the
// live one marked (the batcher serves it first).
func (s *Service) snapshotTargets(ctx context.Context) ([]snapshot.Target, error) {
	vs, err := version.ListVersions(ctx, s.pool, archive.Projection)
	if err != nil {
		return nil, err
	}
	var out []snapshot.Target
	for _, v := range vs {
		if v.Active() {
			out = append(out, snapshot.Target{Schema: v.Schema, Projection: v.Projection, Version: v.Version, Live: v.State == version.StateLive})
		}
	}
	return out, nil
}

func (s *Service) startSnapshots(ctx context.Context) error {
	b, err := snapshot.NewBatcher(s.pool, snapshot.BatcherConfig{
		Targets:    s.snapshotTargets,
		Logger:     s.log,
		Registerer: s.reg,
	})
	if err != nil {
		return err
	}
	s.batcher = b
	return b.Start(ctx)
}
