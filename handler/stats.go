package handler

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// analyzeGrown is the statistics of the tables the dispatcher and
// revalidation query per delivery: epitaph.deliveries and the live
// archive's rows. Autovacuum analyzes a table once a minute at best; a
// backlog queued at thousands of rows a second (a fresh target, a burst)
// doubles them many times in between, and plans made on the old figures
// pick the wrong index: the priority check of every due delivery sorted per
// claim, a later-delivery check reading every delivery of the handler, the
// cheap path reading every archive row of the table (auto_explain,
// bench-handlers). A table that holds more than twice the rows it held at
// its last analyze (and at least analyzeMinRows more) is analyzed now: a
// handful of ANALYZEs (a bounded sample each) while a table grows from
// nothing to millions, none in a steady state (the settles' updates are
// autovacuum's business: they changed nothing the plans depend on as much).
// Only while they are queried: the deliveries while a handler queues rows
// (a cursor handler's claims read the archive; its settled rows, written
// once, plan nothing: analyzing them cost a drain of 30k deliveries 1.1 s
// of its Postgres time), the
// archive's rows while a handler revalidates (every projector runs a
// dispatcher; one without handlers analyzed a growing archive for nothing,
// two ANALYZEs during bench-projector's 100k-row apply).
//
// Only the columns the per-delivery statements filter and join on are
// analyzed (not the payloads and row images, whose statistics cost the most
// and plan nothing here), in the background of the claim loop: the claims
// never wait for it.
//
// An archive's rows table partitioned by commit time has no row in
// pg_stat_user_tables and autovacuum never analyzes it, only its
// partitions; the planner estimates a query of the parent (every reader
// view) with the parent's own statistics. Its rows are counted over its
// partitions (pg_partition_tree; a plain table by its own row), and
// ANALYZE of the parent samples them all and analyzes each partition too.
const analyzeGrownSQL = `
SELECT n.nspname, c.relname, c.relname = 'deliveries'
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.oid IN (SELECT to_regclass('epitaph.deliveries') WHERE EXISTS (SELECT 1 FROM epitaph.handlers h
                WHERE NOT (` + CursorHandlerSQL + `))
                UNION ALL
                SELECT to_regclass(format('%I.rows', v.schema_name)) FROM epitaph.projection_versions v
                WHERE v.projection = 'archive' AND v.state = 'live'
                  AND EXISTS (SELECT 1 FROM epitaph.handlers WHERE revalidate))
  AND (SELECT coalesce(sum(s.n_live_tup), 0) FROM pg_stat_user_tables s
       WHERE s.relid = c.oid OR s.relid IN (SELECT relid FROM pg_partition_tree(c.oid) WHERE isleaf))
      > $1 + 2 * greatest(c.reltuples, 0)`

// analyzeMinRows: smaller tables are left to autovacuum.
const analyzeMinRows = 1000

// The columns analyzed: of epitaph.deliveries, and of an archive's rows.
const (
	analyzeDeliveries = `(handler_id, source, commit_lsn, seq, generation, schema_name, table_name, key, correlation_id,
		state, priority, released_at, next_attempt_at, claim_expires_at, fingerprint, verified, outcome)`
	analyzeRows = `(source, commit_lsn, seq, schema_name, table_name, key, correlation_id, expires_at)`
)

// keepStatistics runs analyzeGrown in the background unless a run is
// still going; wg tracks it (the claim loop waits for it when it stops).
func (d *Dispatcher) keepStatistics(ctx context.Context, wg *sync.WaitGroup) {
	if !d.analyzing.CompareAndSwap(false, true) {
		return
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer d.analyzing.Store(false)
		if err := d.analyzeGrown(ctx); err != nil && ctx.Err() == nil {
			d.log.Warn("keeping table statistics failed; retrying", "err", err)
		}
	}()
}

func (d *Dispatcher) analyzeGrown(ctx context.Context) error {
	rows, err := d.pool.Query(ctx, analyzeGrownSQL, analyzeMinRows)
	if err != nil {
		return fmt.Errorf("look up table statistics: %w", err)
	}
	type table struct {
		name, columns string
	}
	tables, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (table, error) {
		var schema, name string
		var deliveries bool
		err := r.Scan(&schema, &name, &deliveries)
		t := table{name: pgx.Identifier{schema, name}.Sanitize(), columns: analyzeRows}
		if deliveries {
			t.columns = analyzeDeliveries
		}
		return t, err
	})
	if err != nil {
		return fmt.Errorf("look up table statistics: %w", err)
	}
	for _, t := range tables {
		name := t.name
		d.mu.Lock()
		skip := d.noAnalyze[name]
		d.mu.Unlock()
		if skip {
			continue
		}
		_, err := d.pool.Exec(ctx, `ANALYZE `+name+` `+t.columns)
		var pe *pgconn.PgError
		if errors.As(err, &pe) && pe.Code == "42501" {
			// Not the table's owner: autovacuum's statistics only.
			d.log.Info("cannot analyze a table that grew (not its owner); its statistics are autovacuum's", "table", name)
			d.mu.Lock()
			d.noAnalyze[name] = true
			d.mu.Unlock()
			continue
		}
		if err != nil {
			return fmt.Errorf("analyze %s: %w", name, err)
		}
		d.log.Debug("analyzed a table that grew since its statistics", "table", name)
	}
	return nil
}
