package main

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/epitaph-dev/epitaph/internal/bench"
	"github.com/epitaph-dev/epitaph/internal/cpuprofile"
)

// profile starts the CPU profile (-cpuprofile, its name with "."+name)
// of the last pair's Flush; the returned function stops it.
func (e *env) profile(name string, last bool) (func(), error) {
	if e.o.cpuProfile == "" || !last {
		return func() {}, nil
	}
	stop, err := cpuprofile.Start(e.o.cpuProfile + "." + name)
	if err != nil {
		return nil, fmt.Errorf("start the CPU profile: %w", err)
	}
	return stop, nil
}

// pgStatsReset forgets the statements so far (-pgstats).
func (e *env) pgStatsReset(ctx context.Context) error {
	if !e.o.pgStats {
		return nil
	}
	_, err := e.target.Exec(ctx, "CREATE EXTENSION IF NOT EXISTS pg_stat_statements; SELECT pg_stat_statements_reset()")
	if err != nil {
		return fmt.Errorf("reset pg_stat_statements: %w", err)
	}
	return nil
}

// pgStatsPrint prints the statements of every database since the reset
// (the target's and the source's), the most expensive first, per
// delivery: calls, execution and planning time, buffers.
func (e *env) pgStatsPrint(ctx context.Context, phase string, deliveries int) error {
	if !e.o.pgStats {
		return nil
	}
	rows, err := e.target.Query(ctx, `SELECT d.datname, s.calls, s.total_exec_time, s.total_plan_time, s.shared_blks_hit + s.shared_blks_read,
			regexp_replace(left(s.query, 100), '\s+', ' ', 'g')
		FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid
		WHERE s.query NOT LIKE '%pg_stat_statements%'
		ORDER BY s.total_exec_time + s.total_plan_time DESC LIMIT 16`)
	if err != nil {
		return fmt.Errorf("read pg_stat_statements: %w", err)
	}
	var db, q string
	var calls, blocks int64
	var exec, plan float64
	_, err = pgx.ForEachRow(rows, []any{&db, &calls, &exec, &plan, &blocks, &q}, func() error {
		n := float64(deliveries)
		bench.Note("pgstats %s: %-6s %6d calls %7.1f µs exec %6.1f µs plan %6.1f buffers per delivery  %s",
			phase, db, calls, exec*1000/n, plan*1000/n, float64(blocks)/n, q)
		return nil
	})
	if err != nil {
		return fmt.Errorf("read pg_stat_statements: %w", err)
	}
	return nil
}
