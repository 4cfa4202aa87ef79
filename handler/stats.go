package handler

import (
	"context"
	"errors"
	"fmt"

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
// bench-handlers). A table modified by more rows than it held at its last
// analyze (and at least analyzeMinRows) is analyzed now: a handful of
// ANALYZEs (a bounded sample each) while a table grows from nothing to
// millions, none in a steady state.
const analyzeGrownSQL = `
SELECT n.nspname, c.relname
FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE s.relid IN (SELECT to_regclass('epitaph.deliveries')
                  UNION ALL
                  SELECT to_regclass(format('%I.rows', v.schema_name)) FROM epitaph.projection_versions v
                  WHERE v.projection = 'archive' AND v.state = 'live')
  AND s.n_mod_since_analyze > $1 + greatest(c.reltuples, 0)`

// analyzeMinRows: smaller tables are left to autovacuum.
const analyzeMinRows = 1000

func (d *Dispatcher) analyzeGrown(ctx context.Context) error {
	rows, err := d.pool.Query(ctx, analyzeGrownSQL, analyzeMinRows)
	if err != nil {
		return fmt.Errorf("look up table statistics: %w", err)
	}
	tables, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (pgx.Identifier, error) {
		var schema, table string
		err := r.Scan(&schema, &table)
		return pgx.Identifier{schema, table}, err
	})
	if err != nil {
		return fmt.Errorf("look up table statistics: %w", err)
	}
	for _, t := range tables {
		name := t.Sanitize()
		d.mu.Lock()
		skip := d.noAnalyze[name]
		d.mu.Unlock()
		if skip {
			continue
		}
		_, err := d.pool.Exec(ctx, `ANALYZE `+name)
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
