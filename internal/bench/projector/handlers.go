package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/internal/bench"
	"github.com/epitaph-dev/epitaph/migrations"
)

// handlersCase is one case of the handlers phase: the n events of source
// on tables, in round, with parallelism deliveries at once, against the
// plain apply of the same round.
type handlersCase struct {
	round, parallelism int
	source             string
	n                  int64
	tables             []string
	plain              plainApply
}

// handlersRound is the row handlers phase (`make bench-handlers`): the
// apply of the same stream with a webhook handler on every table of it
// (one delivery per archived row) to a local server that answers 200 at
// once, against a plain apply of the same round. Figures: deliveries per
// second (from the projector's start to the last delivery done) beside the
// apply rate of the same run, their ratio (target >= 0.8), and the apply
// rate with the handler against the one without (target: at most 15% less).
//
// With e.revalidate (revalidate.go) the handlers revalidate every delivery
// against the source before sending it; the figures are named
// projector.handlers.p<N>.revalidate.*. It returns the delivery rate.
func (e *env) handlersRound(ctx context.Context, c handlersCase, out map[string][]float64) (float64, error) {
	without := c.plain.rate
	suffix := e.suffix
	defer func() { e.suffix, e.afterArchive, e.beforeStart, e.handlerParallelism = suffix, nil, nil, 0 }()
	e.handlerParallelism = c.parallelism
	prefix := fmt.Sprintf("projector.handlers.p%d.", c.parallelism)
	batch := max(e.handlerBatch, 1)
	if batch > 1 {
		prefix = fmt.Sprintf("projector.handlers.p%d.b%d.", c.parallelism, batch)
	}
	if e.revalidate {
		prefix += "revalidate."
	}
	record := func(figure string, v float64, unit string) {
		e.figure(prefix+figure, v, unit)
		out[prefix+figure+"|"+unit] = append(out[prefix+figure+"|"+unit], v)
	}
	var hits, bodyBytes atomic.Int64
	receivedDeliveries.Store(0)
	ln, srv, err := webhookServer(&hits, &bodyBytes)
	if err != nil {
		return 0, err
	}
	defer srv.Close()
	// Every handler signs (Standard Webhooks and the deprecated
	// Epitaph-Signature), as a webhook in production would: the floor
	// below signs too.
	secretFile := filepath.Join(e.dir, "webhook-secret")
	if err := os.WriteFile(secretFile, []byte(benchSecret+"\n"), 0o600); err != nil {
		return 0, err
	}

	url, err := bench.CreateDatabase(ctx, e.pg, fmt.Sprintf("handlers_%d_p%d_b%d_%t", c.round, c.parallelism, batch, e.revalidate))
	if err != nil {
		return 0, err
	}
	defer func() { _ = dropDatabase(context.WithoutCancel(ctx), e.pg, url) }()
	e.suffix = fmt.Sprintf(".handlers.p%d.b%d%s", c.parallelism, batch, suffix)
	// The handlers exist before the projector starts (after its migrate).
	e.beforeStart = e.addHandlers(c.tables, "http://"+ln.Addr().String()+"/hook", secretFile, batch)
	var deliveredAt time.Time
	var lim limitInputs
	start := time.Now()
	busy0, total0, err := cpuBusy()
	if err != nil {
		return 0, err
	}
	e.afterArchive = func(ctx context.Context, url string, _ time.Time) error {
		// The apply with handlers ends here: its CPU (projector process +
		// Postgres, from the projector's start) is the last apply's.
		lim.withCPU = e.lastCPU
		if e.pgStats {
			if err := pgStatsPrint(ctx, url, "handlers-apply"); err != nil {
				return err
			}
		}
		deadline := time.Now().Add(15 * time.Minute)
		// One connection, and a question the partial indexes of open
		// deliveries answer: a count(*) of the whole table ten times a
		// second cost Postgres a quarter of the drain's CPU, charged to the
		// dispatcher it competed with.
		conn, err := pgx.Connect(ctx, url)
		if err != nil {
			return err
		}
		defer conn.Close(context.WithoutCancel(ctx))
		// Postgres CPU per delivery while only the dispatcher runs (from the
		// last archived row to the last delivery done): meaningful on a
		// loaded machine, where the rates are not. The deliveries done by
		// then are the receiver's count (a count(*) of the deliveries here
		// cost Postgres 68 ms of the drain's CPU, charged to the
		// dispatcher; the batches in flight at either end are at most
		// --handler-parallelism each way). The bench asks Postgres nothing
		// until the receiver has every delivery.
		cpu0 := e.cpu(e.projectorPid())
		done0 := receivedDeliveries.Load()
		for receivedDeliveries.Load() < c.n && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
		for {
			var open bool
			if err := conn.QueryRow(ctx, openDeliveriesSQL, c.source).Scan(&open); err != nil {
				return err
			}
			if !open {
				// The last delivery done is the last settle's time, not this
				// poll's: the poll's 250 ms (and its own query) are not the
				// dispatcher's. Same host, same clock.
				var done int64
				var last *time.Time
				if err := conn.QueryRow(ctx, `SELECT count(*), max(settled_at) FROM epitaph.deliveries WHERE state = 'done'`).Scan(&done, &last); err != nil {
					return err
				}
				deliveredAt = time.Now()
				if last != nil && last.Before(deliveredAt) {
					deliveredAt = *last
				}
				if done != c.n {
					missingRows(ctx, conn, c.source)
					return fmt.Errorf("deliveries: %d of %d done, none open", done, c.n)
				}
				// Every delivery reached the receiver once: its rows are
				// unique by id, and the receiver counted the deliveries of
				// every POST.
				if got := receivedDeliveries.Load(); got != c.n {
					return fmt.Errorf("deliveries: the receiver got %d, want %d", got, c.n)
				}
				bench.Note("handlers: %d deliveries done, %d received, one each", done, receivedDeliveries.Load())
				return e.drained(ctx, url, &lim, drainProbe{n: c.n, done0: done0, cpu0: cpu0, parallelism: c.parallelism, hits: &hits, bodyBytes: &bodyBytes,
					secretFile: secretFile, busy0: busy0, total0: total0}, record)
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("deliveries still open after 15 minutes")
			}
			time.Sleep(250 * time.Millisecond)
		}
	}
	with, err := e.apply(ctx, url, c.source, c.n)
	if err != nil {
		return 0, err
	}

	e.suffix = suffix
	applyTook := float64(c.n) / with
	deliveries := float64(c.n) / deliveredAt.Sub(start).Seconds()
	record("apply_rows_per_sec", with, "rows/s (apply with a webhook handler on every table)")
	record("deliveries_per_sec", deliveries, fmt.Sprintf("deliveries/s (webhook, --handler-parallelism %d, --batch-size %d; from the projector's start to the last done)", c.parallelism, batch))
	record("ratio_deliveries_to_apply", deliveries/with, "x of the apply rate of the same run (target >= 0.80)")
	record("apply_ratio", with/without, "x of the apply without handlers (target >= 0.85)")
	record("drain_seconds_after_archive", deliveredAt.Sub(start).Seconds()-applyTook, "s from the last archived row to the last delivery done")
	bench.Note("handlers: %d webhook calls for %d deliveries", hits.Load(), c.n)
	if !e.revalidate && batch == 1 {
		lim.n, lim.plain, lim.deliveries, lim.wall = c.n, c.plain, deliveries, deliveredAt.Sub(start).Seconds()
		lim.record(record)
	}
	return deliveries, nil
}

// drainProbe is what drained needs of the round for the limit.
type drainProbe struct {
	n, done0        int64    // the round's events, and the deliveries received when the last row was archived
	cpu0            cpuTimes // the projector's CPU at its start
	parallelism     int
	hits, bodyBytes *atomic.Int64
	secretFile      string
	busy0, total0   float64 // cpuBusy at the projector's start
}

// drained, once every delivery is done, takes the limit's drain figures
// into lim, records the drain's (drainFigures) and, in a plain round,
// measures the floor of one webhook call while the projector idles.
func (e *env) drained(ctx context.Context, url string, lim *limitInputs, p drainProbe, record func(string, float64, string)) error {
	var err error
	if lim.busy, err = busySince(p.busy0, p.total0); err != nil {
		return err
	}
	lim.drainCPU, lim.done0 = e.cpu(e.projectorPid()).sub(p.cpu0), p.done0
	if err := e.drainFigures(ctx, url, p.n, p.done0, p.cpu0, record); err != nil {
		return err
	}
	if e.revalidate {
		return nil
	}
	lim.bodySize = int(p.bodyBytes.Load() / max(p.hits.Load(), 1))
	lim.floor, err = e.webhookFloor(ctx, p.parallelism, lim.bodySize, p.secretFile)
	return err
}

// drainFigures records the drain's figures once every delivery is done:
// the CPU per delivery since the last archived row (cpu0, done0 then),
// the lone revalidations, the drain's statements with -pgstats, and the
// revalidation cost.
func (e *env) drainFigures(ctx context.Context, url string, n, done0 int64, cpu0 cpuTimes, record func(string, float64, string)) error {
	if n > done0 {
		cpu := e.cpu(e.projectorPid()).sub(cpu0)
		record("drain_postgres_cpu_us_per_delivery", cpu.postgres*1e6/float64(n-done0),
			fmt.Sprintf("µs of Postgres CPU per delivery done after the last archived row (%d of them)", n-done0))
		record("drain_projector_cpu_us_per_delivery", cpu.proc*1e6/float64(n-done0),
			fmt.Sprintf("µs of projector process CPU per delivery done after the last archived row (%d of them)", n-done0))
	}
	if err := e.loneRevalidations(ctx, record); err != nil {
		return err
	}
	if e.pgStats {
		if e.revalidate {
			// The source's statements first, kept for the target's print
			// (its reset clears every database's).
			if err := pgStatsShow(ctx, e.sourceURL, "handlers-drain-source", false); err != nil {
				return err
			}
		}
		if err := pgStatsPrint(ctx, url, "handlers-drain"); err != nil {
			return err
		}
	}
	return e.revalidationCost(ctx, url, record)
}

// projectorPid is the first projector of the running apply (0 in-process:
// no process CPU figure of its own).
func (e *env) projectorPid() int {
	if e.inProcess || len(e.procs) == 0 {
		return 0
	}
	return e.procs[0].Pid()
}

// loneRevalidations records, in the revalidation round, how many attempts
// the projectors revalidated alone (their claimed batch's verdict missing
// or older than a second when a worker took them), from their metrics.
func (e *env) loneRevalidations(ctx context.Context, record func(string, float64, string)) error {
	if !e.revalidate {
		return nil
	}
	var n float64
	for _, addr := range e.metricsAddrs {
		m, err := bench.Scrape(ctx, addr)
		if err != nil {
			return fmt.Errorf("lone revalidations: %w", err)
		}
		n += m["epitaph_projector_delivery_revalidations_alone_total"]
	}
	record("revalidations_alone", n, "attempts revalidated alone (batch verdict missing or older than 1 s), of every delivery of the round")
	return nil
}

// openDeliveriesSQL: is any delivery pending (released or not) or in
// flight? Each part is answered by a partial index.
// A cursor handler's open deliveries are its claimed batch and the rows of
// its table after its cursor (read through rows_key from the cursor on).
const openDeliveriesSQL = `SELECT EXISTS (SELECT 1 FROM epitaph.deliveries WHERE state = 'pending' AND released_at IS NOT NULL)
	OR EXISTS (SELECT 1 FROM epitaph.deliveries WHERE state = 'pending' AND released_at IS NULL)
	OR EXISTS (SELECT 1 FROM epitaph.deliveries WHERE state = 'in_flight')
	OR EXISTS (SELECT 1 FROM epitaph.handler_cursors WHERE claim_token IS NOT NULL)
	OR EXISTS (SELECT 1 FROM epitaph.handler_cursors c JOIN epitaph.handlers h ON h.id = c.handler_id
	           WHERE EXISTS (SELECT 1 FROM archive_v1.rows a WHERE a.source = $1 AND (a.commit_lsn, a.seq) > (c.commit_lsn, c.seq)
	                         AND a.schema_name = h.schema_name AND a.table_name = h.table_name))`

func splitTable(t string) (string, string) {
	for i := range len(t) {
		if t[i] == '.' {
			return t[:i], t[i+1:]
		}
	}
	return "public", t
}

// eventTables lists the tables of the delete events.
func eventTables(events []*event.Event) []string {
	seen := map[string]bool{}
	var out []string
	for _, e := range events {
		if t := e.QualifiedTable(); !seen[t] {
			seen[t] = true
			out = append(out, t)
		}
	}
	return out
}

// addHandlers is the handlers round's beforeStart: a webhook handler to
// hook on every table (batch: its --batch-size), after the migrations.
func (e *env) addHandlers(tables []string, hook, secretFile string, batch int) func(ctx context.Context, url string) error {
	return func(ctx context.Context, url string) error {
		pool, err := pgxpool.New(ctx, url)
		if err != nil {
			return err
		}
		defer pool.Close()
		if err := migrations.Apply(ctx, pool); err != nil {
			return err
		}
		for i, t := range tables {
			s, tb := splitTable(t)
			if err := handler.Add(ctx, pool, handler.Def{ID: fmt.Sprintf("00000000-0000-4000-8000-%012d", i+1), Schema: s, Table: tb,
				Kind: handler.KindWebhook, Target: hook, MaxAttempts: 5, Backoff: time.Second,
				ClaimTimeout: time.Minute, Revalidate: e.revalidate, SecretFile: secretFile,
				BatchSize: batch, BatchWait: 20 * time.Millisecond}); err != nil {
				return err
			}
		}
		if e.pgStats {
			if e.revalidate {
				// The source's statements are printed for the drain too.
				if err := pgStatsReset(ctx, e.sourceURL); err != nil {
					return err
				}
			}
			return pgStatsReset(ctx, url)
		}
		return nil
	}
}

// missingRows prints the archived rows without a delivery done, by
// transaction, beside the cursors: what a lost range looks like.
func missingRows(ctx context.Context, conn *pgx.Conn, source string) {
	rows, err := conn.Query(ctx, `SELECT a.table_name || ' ' || a.commit_lsn::text || ' rows=' || count(*) || ' verified=' || bool_and(a.verified)
			|| ' archived=' || min(a.archived_at)::text || '..' || max(a.archived_at)::text
		FROM archive_v1.rows a JOIN epitaph.handlers h ON h.schema_name = a.schema_name AND h.table_name = a.table_name
		WHERE a.source = $1 AND NOT EXISTS (SELECT 1 FROM epitaph.deliveries d WHERE d.handler_id = h.id
		      AND d.commit_lsn = a.commit_lsn AND d.seq = a.seq)
		GROUP BY a.table_name, a.commit_lsn ORDER BY 1 LIMIT 20`, source)
	if err == nil {
		lines, _ := pgx.CollectRows(rows, pgx.RowTo[string])
		for _, l := range lines {
			bench.Note("missing: %s", l)
		}
	}
	rows, err = conn.Query(ctx, `SELECT h.table_name || ' cursor=' || c.commit_lsn::text || '/' || c.seq || ' updated=' || c.updated_at::text
		FROM epitaph.handler_cursors c JOIN epitaph.handlers h ON h.id = c.handler_id ORDER BY 1`)
	if err == nil {
		lines, _ := pgx.CollectRows(rows, pgx.RowTo[string])
		for _, l := range lines {
			bench.Note("cursor: %s", l)
		}
	}
	rows, err = conn.Query(ctx, `SELECT partition || ' ' || source_lsn::text FROM epitaph.progress WHERE projection = 'archive' ORDER BY partition`)
	if err == nil {
		lines, _ := pgx.CollectRows(rows, pgx.RowTo[string])
		bench.Note("watermarks: %v", lines)
	}
}
