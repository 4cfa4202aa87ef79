package projection

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/handler/revalidate"
	"github.com/epitaph-dev/epitaph/projection/archive"
)

// queueDeliveries is the row handlers' part of a page's transaction:
// deliveries of rows that verification dropped are stopped, the page's
// archived rows get one delivery per handler of their table (live version
// only: handler.Enqueue checks it in the statement), and the deliveries of
// transactions whose commit this page applied are released. Nothing at all
// (no query) while no handler exists. rows are the rows of page p that
// were archived.
//
// A cursor handler gets no delivery row for a row its cursor will reach.
// A row at or behind its partition's watermark before the page (the
// position the page's transaction advances from, fenced by its lease) may
// be behind a cursor: a replayed quarantined event, a row re-applied after
// the partition rewound, a row re-inserted verified by the slow path of
// verification. Such a row of a table with cursor handlers is marked late
// when this transaction inserted it (one look-up), and Enqueue queues it
// for the handlers whose cursor claimed past it. A row ahead of the
// watermark costs nothing more.
func (s *Service) queueDeliveries(ctx context.Context, tx pgx.Tx, p *applyPlan, rows []*archiveRow) error {
	v, commits, inPage, vd := p.v, p.commits, p.inPage, p.vd
	if s.handlers == nil || !s.handlers.Any() {
		return nil
	}
	if len(vd.drop) > 0 {
		lsns, seqs := rowIDArgs(vd.drop)
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
	var behind []int // rows of queue at or behind the watermark, of tables with cursor handlers
	for _, r := range rows {
		e := r.ev
		defs := s.handlers.For(e.QualifiedTable())
		if r.item.category != "" || len(defs) == 0 {
			continue
		}
		hr := handler.Row{Source: e.Source, Schema: e.Schema, Table: e.Table, Key: e.Key, Image: r.row,
			CorrelationID: e.CorrelationID(), CommitLSN: e.CommitLSN.String(), Seq: e.Seq,
			Verified: !r.pending, Committed: committed[e.CommitLSN]}
		if !e.CommitTime.IsZero() {
			t := e.CommitTime
			hr.CommitTime = &t
		}
		if e.CommitLSN <= p.pos.SourceLSN && anyCursor(defs) {
			behind = append(behind, len(queue))
		}
		queue = append(queue, hr)
	}
	if err := markLate(ctx, tx, v.Schema, s.cfg.SourceName, queue, behind); err != nil {
		return err
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

// anyCursor reports whether one of defs is a cursor handler.
func anyCursor(defs []handler.Def) bool {
	for _, d := range defs {
		if d.UsesCursor() {
			return true
		}
	}
	return false
}

// insertedNowSQL returns which of the rows (ordinal, from 1) this
// transaction inserted: archived_at is its inserting transaction's now().
// A row there before (a rewound partition applies its page again) was
// judged by the transaction that inserted it.
const insertedNowSQL = `
SELECT u.i FROM unnest($2::text[], $3::int[]) WITH ORDINALITY AS u(lsn, seq, i)
WHERE EXISTS (SELECT 1 FROM %s r WHERE r.source = $1 AND r.commit_lsn = u.lsn::pg_lsn AND r.seq = u.seq
                AND r.archived_at = now())`

// markLate marks late the rows of queue at the indexes behind that this
// transaction inserted (one query; none without such rows).
func markLate(ctx context.Context, tx pgx.Tx, schema, source string, queue []handler.Row, behind []int) error {
	if len(behind) == 0 {
		return nil
	}
	lsns, seqs := make([]string, len(behind)), make([]int32, len(behind))
	for i, q := range behind {
		lsns[i], seqs[i] = queue[q].CommitLSN, int32(queue[q].Seq)
	}
	rows, err := tx.Query(ctx, fmt.Sprintf(insertedNowSQL, archive.Ident(schema, "rows")), source, lsns, seqs)
	if err != nil {
		return fmt.Errorf("look up late rows: %w", err)
	}
	ords, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return fmt.Errorf("look up late rows: %w", err)
	}
	for _, o := range ords {
		queue[behind[o-1]].Late = true
	}
	return nil
}
