package main

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/epitaph-dev/epitaph/internal/bench"
)

// snapshotApply is one apply of the snapshot phase into a fresh database,
// with public.orders as snapshot root or without snapshots.
type snapshotApply struct {
	rate float64  // rows/s, as e.apply measures it
	cpu  cpuTimes // CPU seconds of the apply (projector process, Postgres)
	docs documentFigures
}

// snapshotCase is one case of the snapshot phase: the n events of source
// (orders of them snapshot roots) in round, applied in pageSize pages (0:
// the default), its figures named by label.
type snapshotCase struct {
	round         int
	source, label string
	pageSize      int
	n, orders     int64
}

// snapshotRound is the snapshot phase of a round for source's stream:
// e.snapPairs pairs of applies, each into a fresh database, one without
// snapshots and one with public.orders as snapshot root. The pairs are
// interleaved and the order alternates from pair to pair (without first,
// then with first), so a load that drifts through the phase favours
// neither side. Each pair's ratio and the CPU its documents added are
// printed; the median and the min of the ratios, the median CPU per
// document and the worst pair's document delays are added to snaps (by
// "name|unit") for the rounds' medians.
func (e *env) snapshotRound(ctx context.Context, c snapshotCase, snaps map[string][]float64) error {
	name := "projector.snapshots." + c.label + "."
	record := func(figure string, v float64, unit string) {
		e.figure(name+figure, v, unit)
		snaps[name+figure+"|"+unit] = append(snaps[name+figure+"|"+unit], v)
	}
	pairs := max(1, e.snapPairs)
	var ratios, procUS, pgUS []float64
	var withs []snapshotApply
	for p := 1; p <= pairs; p++ {
		bench.LoadNote(fmt.Sprintf("before snapshots %s pair %d", c.label, p))
		var with, without snapshotApply
		for _, snapshots := range pairOrder(p) {
			a, err := e.snapshotApply(ctx, c, p, snapshots)
			if err != nil {
				return err
			}
			if snapshots {
				with = a
			} else {
				without = a
			}
		}
		ratio := with.rate / without.rate
		proc := (with.cpu.proc - without.cpu.proc) / float64(c.orders) * 1e6
		pg := (with.cpu.postgres - without.cpu.postgres) / float64(c.orders) * 1e6
		pair := fmt.Sprintf("pair%d.", p)
		e.figure(name+pair+"apply_ratio", ratio, fmt.Sprintf("x of the apply without snapshots (%.0f / %.0f rows/s)", with.rate, without.rate))
		e.figure(name+pair+"cpu_seconds_projector", with.cpu.proc, fmt.Sprintf("s with snapshots, %.2f s without", without.cpu.proc))
		e.figure(name+pair+"cpu_seconds_postgres", with.cpu.postgres, fmt.Sprintf("s with snapshots, %.2f s without", without.cpu.postgres))
		e.figure(name+pair+"cpu_us_per_document", proc+pg, fmt.Sprintf("us of CPU added per document (projector %.1f + Postgres %.1f)", proc, pg))
		ratios, procUS, pgUS = append(ratios, ratio), append(procUS, proc), append(pgUS, pg)
		withs = append(withs, with)
	}
	bench.LoadNote(fmt.Sprintf("after snapshots %s", c.label))
	record("apply_ratio", bench.Median(ratios), fmt.Sprintf("x of the apply without snapshots, median of %d interleaved pairs (target >= 0.80)", pairs))
	record("apply_ratio_min", slices.Min(ratios), fmt.Sprintf("x, the lowest of the %d pairs (target >= 0.80)", pairs))
	record("cpu_us_per_document_projector", bench.Median(procUS), "us of projector CPU added per document (median of the pairs)")
	record("cpu_us_per_document_postgres", bench.Median(pgUS), "us of Postgres CPU added per document (median of the pairs)")
	sum := make([]float64, len(procUS))
	for i := range procUS {
		sum[i] = procUS[i] + pgUS[i]
	}
	record("cpu_us_per_document", bench.Median(sum), "us of CPU added per document, projector + Postgres (median of the pairs; steadier than the rates, but CPU per unit of work also grows with the machine's load)")
	e.recordDocuments(withs, record)
	return nil
}

// pairOrder is the order of pair p's applies: false without snapshots,
// true with; odd pairs start without, even pairs with.
func pairOrder(p int) []bool {
	if p%2 == 1 {
		return []bool{false, true}
	}
	return []bool{true, false}
}

// recordDocuments records the document figures of the with-applies: the
// worst pair's (largest delays and last-document age, smallest in-page
// share), the median p50 and the batcher figures' medians.
func (e *env) recordDocuments(withs []snapshotApply, record func(string, float64, string)) {
	pick := func(f func(documentFigures) float64) []float64 {
		xs := make([]float64, len(withs))
		for i, w := range withs {
			xs[i] = f(w.docs)
		}
		return xs
	}
	record("last_document_age_seconds", slices.Max(pick(func(d documentFigures) float64 { return d.lastAge.Seconds() })),
		"s from the last archived row to the last document complete (the slowest pair)")
	record("document_delay_max_seconds", slices.Max(pick(func(d documentFigures) float64 { return d.maxDelay })),
		"s from the commit of the apply transaction that applied a group's commit to the commit that wrote its document complete, the slowest of every pair (target <= 2)")
	record("document_delay_p99_seconds", slices.Max(pick(func(d documentFigures) float64 { return d.p99Delay })), "s, 99th percentile (the slowest pair)")
	record("document_delay_p50_seconds", bench.Median(pick(func(d documentFigures) float64 { return d.p50Delay })), "s, median (median of the pairs)")
	record("document_delay_from_apply_start_max_seconds", slices.Max(pick(func(d documentFigures) float64 { return d.maxFromStart })),
		"s from the start of that apply transaction (the job's created_at) to completed_at, the slowest")
	if batches := pick(func(d documentFigures) float64 { return float64(d.batches) }); slices.Max(batches) > 0 {
		record("batcher_batches", bench.Median(batches), "batches that completed documents (the rest were assembled in the apply; median of the pairs)")
		record("batcher_documents_per_batch", bench.Median(pick(func(d documentFigures) float64 { return d.perBatch })), "documents per batch (mean; median of the pairs)")
	}
	record("in_page_share", slices.Min(pick(func(d documentFigures) float64 { return d.inPage })), "of the documents assembled in the apply transaction (the lowest pair)")
}

// snapshotApply applies source's n events into a fresh database, with
// public.orders as snapshot root when snapshots is set (then waiting for
// the orders documents), in pageSize pages (0: the default), and drops the
// database.
func (e *env) snapshotApply(ctx context.Context, c snapshotCase, pair int, snapshots bool) (a snapshotApply, err error) {
	suffix := e.suffix
	defer func() { e.suffix, e.snapshotRoots, e.afterArchive, e.pageSize = suffix, "", nil, 0 }()
	side := "without"
	if snapshots {
		side = "with"
	}
	url, err := bench.CreateDatabase(ctx, e.pg, fmt.Sprintf("%s_%s_%d_%d", c.label, side, c.round, pair))
	if err != nil {
		return a, err
	}
	e.pageSize = c.pageSize
	e.suffix = fmt.Sprintf(".snapshots.%s.pair%d.%s%s", c.label, pair, side, suffix)
	// pg_stat_statements of the first pair's with-apply only: one listing a case.
	stats := e.pgStats && snapshots && pair == 1
	if snapshots {
		e.snapshotRoots = "public.orders"
		e.afterArchive = func(ctx context.Context, url string, _ time.Time) error {
			var err error
			a.docs, err = waitDocuments(ctx, url, c.orders)
			return err
		}
		if stats {
			if err := pgStatsReset(ctx, url); err != nil {
				return a, err
			}
		}
	}
	e.lastCPU = cpuTimes{}
	if a.rate, err = e.apply(ctx, url, c.source, c.n); err != nil {
		return a, err
	}
	a.cpu = e.lastCPU
	if stats {
		if err := pgStatsPrint(ctx, url, "snapshots."+c.label); err != nil {
			return a, err
		}
	}
	return a, dropDatabase(ctx, e.pg, url)
}
