package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/epitaph-dev/epitaph/handler/revalidate"
)

// revalidationRound is the handlers round again with revalidation on: every
// delivery is revalidated against the source the stream was captured from
// (its orders are deleted: every key is absent, every delivery sends).
// Figures: the delivery rate against the plain round's (target >= 0.75:
// revalidation costs at most a quarter of it on the cheap path), and,
// measured in this process on the delivered rows once they are done, the
// cost per evaluation on the cheap path and with the full read.
func (e *env) revalidationRound(ctx context.Context, c handlersCase, plain float64, out map[string][]float64) error {
	e.revalidate, e.sourceURL = true, e.pg.URL("source")
	defer func() { e.revalidate, e.sourceURL = false, "" }()
	with, err := e.handlersRound(ctx, c, out)
	if err != nil {
		return err
	}
	name := fmt.Sprintf("projector.handlers.p%d.revalidate.ratio_deliveries_to_plain", c.parallelism)
	unit := "x of the deliveries/s without revalidation (target >= 0.75)"
	e.figure(name, with/plain, unit)
	out[name+"|"+unit] = append(out[name+"|"+unit], with/plain)
	return nil
}

// revalidationCost times Evaluate over the round's deliveries (done by
// then; evaluation does not look at the state): the cheap path, then with
// every pair made to differ (the sets unchanged), the full read. Only in
// the revalidation round.
func (e *env) revalidationCost(ctx context.Context, targetURL string, record func(string, float64, string)) error {
	if !e.revalidate {
		return nil
	}
	pool, err := pgxpool.New(ctx, targetURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	ev, err := revalidate.New(pool, revalidate.Config{SourceURL: e.sourceURL, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		return err
	}
	defer ev.Close()
	rows, err := pool.Query(ctx, `SELECT id::text FROM epitaph.deliveries ORDER BY id LIMIT 5000`)
	if err != nil {
		return err
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil || len(ids) == 0 {
		return err
	}
	for _, phase := range []struct{ path, prepare string }{
		{revalidate.PathCheap, ``},
		{revalidate.PathFull, `UPDATE archive_v1.rows SET archived_at = archived_at + interval '1 hour'`},
	} {
		if phase.prepare != "" {
			if _, err := pool.Exec(ctx, phase.prepare); err != nil {
				return err
			}
		}
		took, err := evaluateAll(ctx, ev, ids, phase.path)
		if err != nil {
			return err
		}
		record("evaluation_us_"+phase.path, float64(took.Microseconds())/float64(len(ids)),
			fmt.Sprintf("µs per delivery (wall, 4 at once, %d deliveries)", len(ids)))
	}
	return nil
}

func evaluateAll(ctx context.Context, ev *revalidate.Evaluator, ids []string, path string) (time.Duration, error) {
	var mu sync.Mutex
	var failed error
	next := 0
	var wg sync.WaitGroup
	start := time.Now()
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				mu.Lock()
				if next == len(ids) || failed != nil {
					mu.Unlock()
					return
				}
				id := ids[next]
				next++
				mu.Unlock()
				res, err := ev.Evaluate(ctx, id)
				if err == nil && (res.Outcome != revalidate.Send || res.Path != path) {
					err = fmt.Errorf("delivery %s: %s (%s) on the %s path, want send on the %s path", id, res.Outcome, res.Reason, res.Path, path)
				}
				if err != nil {
					mu.Lock()
					failed = err
					mu.Unlock()
					return
				}
			}
		}()
	}
	wg.Wait()
	return time.Since(start), failed
}
