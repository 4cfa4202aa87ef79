package projection

import (
	"context"

	"github.com/jackc/pgx/v5"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/handler/revalidate"
)

// queueDeliveries is the row handlers' part of a page's transaction:
// deliveries of rows that verification dropped are stopped, the page's
// archived rows get one delivery per handler of their table (live version
// only: handler.Enqueue checks it in the statement), and the deliveries of
// transactions whose commit this page applied are released. Nothing at all
// (no query) while no handler exists. rows are the rows of page p that
// were archived.
func (s *Service) queueDeliveries(ctx context.Context, tx pgx.Tx, p *applyPlan, rows []*archiveRow) error {
	v, commits, inPage, vd := p.v, p.commits, p.inPage, p.vd
	if s.handlers == nil || !s.handlers.Any() {
		return nil
	}
	if len(vd.drop) > 0 {
		lsns, seqs := make([]string, len(vd.drop)), make([]int32, len(vd.drop))
		for i, r := range vd.drop {
			lsns[i], seqs[i] = r.lsn.String(), int32(r.seq)
		}
		if err := handler.StopUnverified(ctx, tx, s.cfg.SourceName, lsns, seqs); err != nil {
			return err
		}
	}
	committed := map[event.LSN]bool{}
	release := make([]string, 0, len(commits)+len(vd.promote))
	for _, c := range commits {
		if c.category != "" {
			continue
		}
		committed[c.ev.CommitLSN] = true
		if !inPage[c.ev.CommitLSN] {
			// Rows of earlier pages wait for this commit.
			release = append(release, c.ev.CommitLSN.String())
		}
	}
	for _, l := range vd.promote {
		release = append(release, l.String())
	}
	var queue []handler.Row
	for _, r := range rows {
		e := r.ev
		if r.item.category != "" || len(s.handlers.For(e.QualifiedTable())) == 0 {
			continue
		}
		hr := handler.Row{Source: e.Source, Schema: e.Schema, Table: e.Table, Key: e.Key, Image: r.row,
			CorrelationID: e.CorrelationID(), CommitLSN: e.CommitLSN.String(), Seq: e.Seq,
			Verified: !r.pending, Committed: committed[e.CommitLSN]}
		if !e.CommitTime.IsZero() {
			t := e.CommitTime
			hr.CommitTime = &t
		}
		queue = append(queue, hr)
	}
	if _, err := handler.Enqueue(ctx, tx, s.handlers, v.Projection, v.Version, queue); err != nil {
		return err
	}
	release = distinct(release)
	if err := handler.Release(ctx, tx, s.cfg.SourceName, release); err != nil {
		return err
	}
	// Revalidation's promise: the fingerprint of each released
	// delivery's set, now that its rows are archived and verified.
	for _, r := range queue {
		if r.Verified {
			release = append(release, r.CommitLSN)
		}
	}
	_, err := revalidate.StampGroups(ctx, tx, v.Schema, s.cfg.SourceName, distinct(release))
	return err
}

// distinct returns the commit LSNs once each, in their first order: a
// page's rows share a few transactions, and a list with one LSN per row
// makes the planner give up the (source, commit_lsn) indexes for a filter
// over every row of the source (a statement that grew with the archive).
func distinct(lsns []string) []string {
	seen := make(map[string]bool, len(lsns))
	out := lsns[:0:0]
	for _, l := range lsns {
		if !seen[l] {
			seen[l] = true
			out = append(out, l)
		}
	}
	return out
}
