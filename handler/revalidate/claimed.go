package revalidate

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/epitaph-dev/epitaph/handler"
)

// EvaluateClaimed decides for deliveries the dispatcher has just claimed
// what EvaluateBatch decides for their ids, in fewer statements: the claim
// read the deliveries' own columns (identity, key, the stamped promise,
// none of which a claimed delivery's attempt changes before it settles),
// so the target is read once for what can have changed, in one statement:
// the handlers, the later-delivery check, the live version, the groups'
// cheap pairs and each delivery's own archive row. The source is read
// while that statement runs (its keys are known from the claim), not after
// it: a few more source reads (of deliveries the target then stops), the
// same outcomes, decided in the same order (handler, later delivery,
// archive, source, set). Every call reads afresh.
//
// Two inputs of those reads are taken from the previous call and checked
// against this call's fresh read, never trusted: the live archive schema
// the statement's text names (a promotion since then: read again with the
// live one) and each handler's source_url_file (changed or unknown: its
// deliveries' source is read again after the statement, as EvaluateBatch
// reads it). What can happen to a claimed delivery meanwhile (erased,
// revoked, discarded) is read from the archive and the handlers, or
// refused by the settle's claim-token guard.
func (e *Evaluator) EvaluateClaimed(ctx context.Context, ds []handler.Delivery) []Result {
	results := e.evaluateClaimed(ctx, ds)
	for _, res := range results {
		if res.d.id != "" {
			e.metrics.observe(res.d.handlerID, res)
		}
	}
	return results
}

// claimedObs is what claimedSQL read for one delivery.
type claimedObs struct {
	ok            bool
	c             set
	present, live bool
}

func (e *Evaluator) evaluateClaimed(ctx context.Context, ds []handler.Delivery) []Result {
	results := make([]Result, len(ds))
	base := make([]delivery, len(ds))
	for i, d := range ds {
		base[i] = delivery{id: d.ID, handlerID: d.HandlerID, source: d.Source, lsn: d.CommitLSN, seq: d.Seq,
			generation: d.Generation, schemaName: d.Schema, table: d.Table, key: d.Key, correlationID: d.CorrelationID,
			fingerprint: d.Fingerprint, groupRows: d.GroupRows, groupMax: d.GroupMax}
	}
	// The source, concurrently, for the deliveries whose handler's
	// source_url_file is known from an earlier call.
	early := make([]Result, len(ds))
	earlyFile := make([]*string, len(ds))
	asked := make([]bool, len(ds))
	var pre []*pending
	for i, d := range base {
		if file, ok := e.urlFileSeen(d.handlerID); ok {
			d.sourceURLFile, earlyFile[i], asked[i] = file, file, true
			pre = append(pre, &pending{i: i, d: d})
		}
	}
	var wg sync.WaitGroup
	if len(pre) > 0 {
		wg.Add(1)
		go func() { defer wg.Done(); e.decideSources(ctx, pre, early) }()
	}
	obs, err := e.readClaimed(ctx, base)
	wg.Wait()
	if err != nil {
		e.cfg.Logger.Warn("revalidation deferred: target unreadable", "deliveries", len(ds), "err", err)
		for i := range results {
			results[i] = Result{Outcome: Defer, Reason: ReasonTargetUnreadable, d: base[i]}
		}
		return results
	}
	var late, open []*pending
	for i, d := range base {
		e.seeURLFile(d)
		p := &pending{i: i, d: d}
		res := e.decideHandler(d)
		if res.Outcome == "" && d.liveSchema == nil {
			res = Result{Outcome: Defer, Reason: ReasonNoLiveVersion}
		}
		if !settle(results, p, res) {
			continue
		}
		if !obs[i].ok {
			e.cfg.Logger.Warn("revalidation deferred: archive unreadable", "delivery", d.id)
			settle(results, p, Result{Outcome: Defer, Reason: ReasonTargetUnreadable})
			continue
		}
		p.a = e.archiveResult(ctx, d, obs[i].c, obs[i].present, obs[i].live)
		switch {
		case !settle(results, p, p.a):
		case !asked[i] || !sameFile(earlyFile[i], d.sourceURLFile):
			late = append(late, p) // its source is read now, with the file just read
		case !settle(results, p, early[i]):
		default:
			open = append(open, p)
		}
	}
	open = append(open, e.decideSources(ctx, late, results)...)
	for _, p := range open {
		results[p.i] = e.decideSet(ctx, p.d, p.a)
		results[p.i].d = p.d
	}
	return results
}

func sameFile(a, b *string) bool { return (a == nil) == (b == nil) && (a == nil || *a == *b) }

// urlFileSeen is the source_url_file of handler id as the last call read
// it (ok false: not read yet).
func (e *Evaluator) urlFileSeen(id string) (*string, bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	f, ok := e.urlFiles[id]
	return f, ok
}

func (e *Evaluator) seeURLFile(d delivery) {
	if !d.handlerExists {
		return
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.urlFiles == nil {
		e.urlFiles = map[string]*string{}
	}
	e.urlFiles[d.handlerID] = d.sourceURLFile
}

// liveSQL reads the live archive schema alone (the first call, or after
// the guessed one was gone).
const liveSQL = `SELECT (SELECT schema_name FROM epitaph.projection_versions WHERE projection = 'archive' AND state = 'live')`

// readClaimed runs claimedSQL over base, filling each delivery's fresh
// fields (handler, later delivery, live schema, erasures) and returning the
// archive's observations. The statement names the live schema guessed from
// the previous call and reads the live one with it: when they differ (a
// promotion), or the guessed schema is gone, it runs again with the live
// one.
func (e *Evaluator) readClaimed(ctx context.Context, base []delivery) ([]claimedObs, error) {
	e.mu.Lock()
	guess := e.live
	e.mu.Unlock()
	for range 3 {
		if guess == nil {
			var live *string
			if err := e.db.QueryRow(ctx, liveSQL).Scan(&live); err != nil {
				return nil, fmt.Errorf("read the live archive version: %w", err)
			}
			if live == nil {
				guess = new(string) // none live: the statement without the archive
			} else {
				guess = live
			}
		}
		obs, live, err := e.readClaimedIn(ctx, *guess, base)
		var pe *pgconn.PgError
		switch {
		case errors.As(err, &pe) && pe.Code == "42P01" && *guess != "":
			guess = nil // the guessed schema was dropped: read the live one
			continue
		case err != nil:
			return nil, err
		}
		e.mu.Lock()
		e.live = live
		e.mu.Unlock()
		if (live == nil && *guess == "") || (live != nil && *live == *guess) {
			return obs, nil
		}
		guess = live
	}
	return nil, errors.New("the live archive version kept changing")
}

// claimedSQL is the target's read of a claimed batch, one row per delivery
// (by ordinal): the handler, the later-delivery check, the live version and
// whether erasures can be asked, and, when schema (the live version's, as
// guessed) is not empty, the cheap pair of each distinct group of the
// batch (aggregated once, as cheapBatchSQL) and the delivery's own archive
// row. The handler ids are text[] cast by the server (as settleSQL's ids).
func claimedSQL(schema string) string {
	archive, archiveJoin := `NULL::int, NULL::text, NULL::boolean, NULL::boolean`, ``
	with := ``
	if schema != "" {
		with = `,
` + groupPairsSQL(schema)
		archive = `g.n, g.mx, m.present, m.live`
		archiveJoin = `
LEFT JOIN g ON g.corr = b.corr AND g.sch = b.sch AND g.tbl = b.tbl` + ownRowSQL(schema)
	}
	return `
WITH b AS (
    SELECT * FROM unnest($1::text[]::uuid[], $2::text[], $3::text[], $4::jsonb[], $5::text[], $6::pg_lsn[], $7::int[], $8::text[])
        WITH ORDINALITY AS b(hid, sch, tbl, key, src, lsn, seq, corr, i))` + with + `
SELECT b.i::int, h.id IS NOT NULL, COALESCE(h.enabled, false), h.revoked_at IS NOT NULL,
       COALESCE(h.revalidate, true), h.source_url_file,
       EXISTS (SELECT 1 FROM epitaph.deliveries l
               WHERE l.handler_id = b.hid AND l.schema_name = b.sch AND l.table_name = b.tbl AND jsonb_hash(l.key) = jsonb_hash(b.key) AND l.key = b.key
                 AND l.source = b.src AND (l.commit_lsn, l.seq) > (b.lsn, b.seq)
                 -- A row not (yet) authenticated is no later deletion.
                 AND l.verified AND l.outcome IS DISTINCT FROM 'unverified'),
       (SELECT schema_name FROM epitaph.projection_versions WHERE projection = 'archive' AND state = 'live'),
       to_regclass('epitaph.erasures') IS NOT NULL, ` + archive + `
FROM b
LEFT JOIN epitaph.handlers h ON h.id = b.hid` + archiveJoin
}

func (e *Evaluator) readClaimedIn(ctx context.Context, schema string, base []delivery) ([]claimedObs, *string, error) {
	n := len(base)
	hid, sch, tbl, src, lsn, corr := make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]string, n)
	keys := make([][]byte, n)
	seq := make([]int32, n)
	for i, d := range base {
		hid[i], sch[i], tbl[i], src[i], lsn[i], corr[i], seq[i] = d.handlerID, d.schemaName, d.table, d.source, d.lsn, d.correlationID, int32(d.seq)
		if len(d.key) > 0 {
			keys[i] = d.key
		}
	}
	rows, err := e.db.Query(ctx, claimedSQL(schema), hid, sch, tbl, keys, src, lsn, seq, corr)
	if err != nil {
		return nil, nil, fmt.Errorf("read %d claimed deliveries: %w", n, err)
	}
	obs := make([]claimedObs, n)
	var live *string
	var j int
	var f delivery
	var cn *int
	var cmax *string
	var present, alive *bool
	_, err = pgx.ForEachRow(rows, []any{&j, &f.handlerExists, &f.enabled, &f.revoked, &f.revalidate, &f.sourceURLFile,
		&f.laterDelivery, &f.liveSchema, &f.erasures, &cn, &cmax, &present, &alive}, func() error {
		if j < 1 || j > n {
			return fmt.Errorf("ordinal %d of %d", j, n)
		}
		d := &base[j-1]
		d.handlerExists, d.enabled, d.revoked, d.revalidate = f.handlerExists, f.enabled, f.revoked, f.revalidate
		d.laterDelivery, d.erasures = f.laterDelivery, f.erasures
		// Copies: the scan targets are reused from row to row.
		d.sourceURLFile, d.liveSchema = copyString(f.sourceURLFile), copyString(f.liveSchema)
		live = d.liveSchema
		if cn != nil && cmax != nil && present != nil && alive != nil {
			obs[j-1] = claimedObs{ok: true, c: set{rows: *cn, max: *cmax}, present: *present, live: *alive}
		}
		return nil
	})
	if err != nil {
		return nil, nil, fmt.Errorf("read %d claimed deliveries: %w", n, err)
	}
	return obs, live, nil
}

func copyString(s *string) *string {
	if s == nil {
		return nil
	}
	c := *s
	return &c
}
