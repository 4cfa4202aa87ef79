package revalidate

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// EvaluateBatch decides for the deliveries ids together, what Evaluate
// decides for each one alone, in a constant number of statements for the
// cheap path whatever the batch's size: one read of the deliveries (their
// handlers and the later-delivery check included), one cheap aggregate per
// distinct group of the batch (not per delivery: a group's n deliveries
// claimed together read its rows once), one read of the source per table
// (and source URL), then the full read only for the deliveries whose pair
// differs. Every call reads afresh; nothing is cached between calls.
// results[i] and errs[i] answer ids[i]; errs[i] is non-nil only for a
// delivery that does not exist (ErrNoDelivery).
func (e *Evaluator) EvaluateBatch(ctx context.Context, ids []string) ([]Result, []error) {
	results, errs := e.evaluateBatch(ctx, ids)
	for _, res := range results {
		if res.d.id != "" {
			e.metrics.observe(res.d.handlerID, res)
		}
	}
	return results, errs
}

// pending is a delivery of the batch whose outcome is not decided yet.
type pending struct {
	i int
	d delivery
	a Result // the archive check's result (the cheap pair's path)
}

func (e *Evaluator) evaluateBatch(ctx context.Context, ids []string) ([]Result, []error) {
	results, errs := make([]Result, len(ids)), make([]error, len(ids))
	byID, err := e.readDeliveries(ctx, ids)
	if err != nil {
		e.cfg.Logger.Warn("revalidation deferred: target unreadable", "deliveries", len(ids), "err", err)
		for i := range results {
			results[i] = Result{Outcome: Defer, Reason: ReasonTargetUnreadable}
		}
		return results, errs
	}
	var open []*pending
	for i, id := range ids {
		d, ok := byID[id]
		if !ok {
			errs[i] = fmt.Errorf("delivery %s: %w", id, ErrNoDelivery)
			continue
		}
		results[i] = e.decideHandler(d)
		if results[i].Outcome == "" && d.liveSchema == nil {
			results[i] = Result{Outcome: Defer, Reason: ReasonNoLiveVersion}
		}
		results[i].d = d
		if results[i].Outcome == "" {
			open = append(open, &pending{i: i, d: d})
		}
	}
	open = e.decideArchives(ctx, open, results)
	open = e.decideSources(ctx, open, results)
	for _, p := range open {
		results[p.i] = e.decideSet(ctx, p.d, p.a)
		results[p.i].d = p.d
	}
	return results, errs
}

// settle records the decided outcome of p and tells whether p is still
// open.
func settle(results []Result, p *pending, res Result) bool {
	if res.Outcome == "" {
		return true
	}
	res.d = p.d
	results[p.i] = res
	return false
}

// cheapBatchSQL is the cheap path of a batch in one statement: the pair of
// every distinct group (correlation id, table) of the batch, aggregated
// once over the group's index, and whether each delivery's own row is
// there (a probe of the primary key), one row per delivery (by ordinal).
// The pair is pairMax and count over setPredicate (the delivery's own
// row counted apart: expired, it stops the delivery as completed).
func cheapBatchSQL(schema string) string {
	return `
WITH b AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::pg_lsn[], $6::int[])
        WITH ORDINALITY AS b(corr, sch, tbl, src, lsn, seq, i)),
` + groupPairsSQL(schema) + `
SELECT b.i::int, g.n, g.mx, m.present, m.live
FROM b JOIN g ON g.corr = b.corr AND g.sch = b.sch AND g.tbl = b.tbl
` + ownRowSQL(schema)
}

// groupPairsSQL is the CTE g: the cheap pair (n, mx) of each distinct
// (correlation id, table) of the batch b, aggregated once over the group's
// index. cheapBatchSQL and claimedSQL share it, so both paths decide on the
// same pair.
func groupPairsSQL(schema string) string {
	return `g AS MATERIALIZED (
    SELECT k.corr, k.sch, k.tbl, a.n, a.mx
    FROM (SELECT DISTINCT corr, sch, tbl FROM b) k
    CROSS JOIN LATERAL (
        SELECT count(*) FILTER (WHERE live)::int AS n,
               COALESCE(max(seq) FILTER (WHERE live)::text || '@' ||
                   (extract(epoch FROM max(archived_at) FILTER (WHERE live)) * 1000000)::bigint::text, '') AS mx
        FROM (SELECT r.seq, r.archived_at, (r.expires_at IS NULL OR r.expires_at > now()) AS live
              FROM ` + rowsTable(schema) + ` r
              WHERE r.correlation_id = k.corr AND r.schema_name = k.sch AND r.table_name = k.tbl AND r.verified) r) a)`
}

// ownRowSQL is the lateral m: whether each delivery's own archive row of b
// is there and live (a probe of the primary key).
func ownRowSQL(schema string) string {
	return `
CROSS JOIN LATERAL (
    SELECT count(*) > 0 AS present, COALESCE(bool_or(r.expires_at IS NULL OR r.expires_at > now()), false) AS live
    FROM ` + rowsTable(schema) + ` r
    WHERE r.source = b.src AND r.commit_lsn = b.lsn AND r.seq = b.seq
      AND r.correlation_id = b.corr AND r.schema_name = b.sch AND r.table_name = b.tbl AND r.verified) m`
}

// decideArchives runs the cheap path for the open deliveries, one
// statement per live archive schema (one in practice), and returns those
// still open, with the pair's path.
func (e *Evaluator) decideArchives(ctx context.Context, open []*pending, results []Result) []*pending {
	bySchema := map[string][]*pending{}
	var schemas []string
	for _, p := range open {
		s := *p.d.liveSchema
		if _, ok := bySchema[s]; !ok {
			schemas = append(schemas, s)
		}
		bySchema[s] = append(bySchema[s], p)
	}
	var still []*pending
	for _, s := range schemas {
		still = append(still, e.decideArchivesIn(ctx, s, bySchema[s], results)...)
	}
	return still
}

func (e *Evaluator) decideArchivesIn(ctx context.Context, schema string, ps []*pending, results []Result) []*pending {
	n := len(ps)
	corr, sch, tbl, src, lsn := make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]string, n)
	seq := make([]int, n)
	for j, p := range ps {
		corr[j], sch[j], tbl[j], src[j], lsn[j], seq[j] = p.d.correlationID, p.d.schemaName, p.d.table, p.d.source, p.d.lsn, p.d.seq
	}
	type obs struct {
		c             set
		present, live bool
		ok            bool
	}
	seen := make([]obs, n)
	rows, err := e.db.Query(ctx, cheapBatchSQL(schema), corr, sch, tbl, src, lsn, seq)
	if err == nil {
		var j int
		var o obs
		_, err = pgx.ForEachRow(rows, []any{&j, &o.c.rows, &o.c.max, &o.present, &o.live}, func() error {
			if j < 1 || j > n {
				return fmt.Errorf("cheap path: ordinal %d of %d", j, n)
			}
			o.ok = true
			seen[j-1] = o
			return nil
		})
	}
	if err != nil {
		err = fmt.Errorf("read the pairs of %d deliveries: %w", n, err)
	}
	var still []*pending
	for j, p := range ps {
		if err != nil || !seen[j].ok {
			e.cfg.Logger.Warn("revalidation deferred: archive unreadable", "delivery", p.d.id, "err", err)
			settle(results, p, Result{Outcome: Defer, Reason: ReasonTargetUnreadable})
			continue
		}
		p.a = e.archiveResult(ctx, p.d, seen[j].c, seen[j].present, seen[j].live)
		if settle(results, p, p.a) {
			still = append(still, p)
		}
	}
	return still
}
