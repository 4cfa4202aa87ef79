package main

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/epitaph-dev/epitaph/internal/bench"
)

// sampler counts, every 20 ms, what the backends of the bench's database
// (and autovacuum) are doing: per class (apply, cleanup, autovacuum), the
// wait event of each active backend ("CPU" when it waits for nothing), and
// the CPU seconds the backends used between samples (from /proc) by the
// class of their statement.
type sampler struct {
	mu      sync.Mutex
	samples int
	waits   map[string]map[string]int // class -> wait -> count
	last    map[int]float64           // pid -> CPU seconds at the last sample
	cpu     map[string]float64        // class -> CPU seconds between samples
	cancel  context.CancelFunc
	done    chan struct{}
}

func startSampler(ctx context.Context, pool *pgxpool.Pool) *sampler {
	ctx, cancel := context.WithCancel(ctx)
	s := &sampler{waits: map[string]map[string]int{}, last: map[int]float64{}, cpu: map[string]float64{}, cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(s.done)
		t := time.NewTicker(20 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			s.sample(ctx, pool)
		}
	}()
	return s
}

func (s *sampler) sample(ctx context.Context, pool *pgxpool.Pool) {
	rows, err := pool.Query(ctx, `SELECT pid, backend_type, state = 'active', COALESCE(wait_event_type || ':' || wait_event, 'CPU'),
		query LIKE '%expires_at <= now()%', query LIKE '%pg_stat_activity%' OR query LIKE '%FROM archive_v1.rows WHERE%' OR query LIKE '%w(p, lsn)%'
		FROM pg_stat_activity
		WHERE pid <> pg_backend_pid() AND (datname = current_database() OR backend_type IN ('autovacuum worker', 'checkpointer', 'background writer', 'walwriter'))`)
	if err != nil {
		return
	}
	defer rows.Close()
	s.mu.Lock()
	defer s.mu.Unlock()
	s.samples++
	for rows.Next() {
		var pid int
		var btype, wait string
		var active, cleanup, benchq bool
		if rows.Scan(&pid, &btype, &active, &wait, &cleanup, &benchq) != nil {
			return
		}
		class := btype
		switch {
		case btype != "client backend":
		case benchq:
			continue
		case cleanup:
			class = "cleanup"
		default:
			class = "apply"
		}
		// The CPU a backend used since the last sample goes to the class
		// of its current (or, idle, its last) statement: the cleaner and
		// the apply share the pool's connections.
		if c, err := procTicks(pid); err == nil {
			if prev, ok := s.last[pid]; ok {
				s.cpu[class] += c - prev
			}
			s.last[pid] = c
		}
		if !active && class != "checkpointer" && class != "background writer" && class != "walwriter" {
			continue
		}
		if class == "checkpointer" || class == "background writer" || class == "walwriter" {
			if !strings.HasPrefix(wait, "Activity:") {
				wait = "busy:" + wait
			} else {
				continue
			}
		}
		if s.waits[class] == nil {
			s.waits[class] = map[string]int{}
		}
		s.waits[class][wait]++
	}
}

// report stops the sampler and prints its counts as NOTE lines.
func (s *sampler) report(name string) {
	s.cancel()
	<-s.done
	s.mu.Lock()
	defer s.mu.Unlock()
	bench.Note("%s: %d samples of pg_stat_activity (every 20 ms); active backends by class and wait event:", name, s.samples)
	for _, class := range slices.Sorted(maps.Keys(s.waits)) {
		w := s.waits[class]
		keys := slices.SortedFunc(maps.Keys(w), func(a, b string) int { return w[b] - w[a] })
		var parts []string
		total := 0
		for _, k := range keys {
			total += w[k]
		}
		for _, k := range keys {
			parts = append(parts, fmt.Sprintf("%s %d", k, w[k]))
		}
		bench.Note("  %-18s %6d: %s", class, total, strings.Join(parts, ", "))
	}
	var parts []string
	for _, class := range slices.Sorted(maps.Keys(s.cpu)) {
		parts = append(parts, fmt.Sprintf("%s %.2f s", class, s.cpu[class]))
	}
	bench.Note("  CPU of the backends between samples, by the class of their statement: %s", strings.Join(parts, ", "))
}

// topStatements prints the statements of pool's database by total time.
func topStatements(ctx context.Context, pool *pgxpool.Pool, name string, n int) {
	rows, err := pool.Query(ctx, `SELECT calls, total_exec_time, mean_exec_time, shared_blks_hit, shared_blks_read, shared_blks_dirtied, shared_blks_written,
		regexp_replace(left(query, 110), '\s+', ' ', 'g') FROM pg_stat_statements
		WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) AND query NOT LIKE '%pg_stat%'
		ORDER BY total_exec_time DESC LIMIT $1`, n)
	if err != nil {
		bench.Note("pg_stat_statements: %v", err)
		return
	}
	defer rows.Close()
	bench.Note("%s: top statements by total time (calls, total ms, mean ms, blocks hit/read/dirtied/written):", name)
	for rows.Next() {
		var calls, hit, read, dirtied, written int64
		var total, mean float64
		var q string
		if err := rows.Scan(&calls, &total, &mean, &hit, &read, &dirtied, &written, &q); err != nil {
			bench.Note("pg_stat_statements: %v", err)
			return
		}
		bench.Note("  %6d %9.0f %8.2f %9d/%d/%d/%d %s", calls, total, mean, hit, read, dirtied, written, q)
	}
}

// dbStats prints what the run cost the server beside the statements: WAL,
// buffers written by whom, and the archive's vacuums.
type serverStats struct {
	walBytes, buffersBackend, buffersClean, buffersCheckpoint, checkpoints float64
	autovacuums, autoanalyzes                                              float64
}

func readServerStats(ctx context.Context, pool *pgxpool.Pool) serverStats {
	var s serverStats
	_ = pool.QueryRow(ctx, `SELECT (SELECT wal_bytes::float8 FROM pg_stat_wal),
		buffers_backend::float8, buffers_clean::float8, buffers_checkpoint::float8, (checkpoints_timed + checkpoints_req)::float8,
		(SELECT COALESCE(sum(autovacuum_count), 0)::float8 FROM pg_stat_user_tables
		 WHERE relid IN (SELECT relid FROM pg_partition_tree('archive_v1.rows') WHERE isleaf)),
		(SELECT COALESCE(sum(autoanalyze_count), 0)::float8 FROM pg_stat_user_tables
		 WHERE relid IN (SELECT relid FROM pg_partition_tree('archive_v1.rows') WHERE isleaf))
		FROM pg_stat_bgwriter`).Scan(&s.walBytes, &s.buffersBackend, &s.buffersClean, &s.buffersCheckpoint, &s.checkpoints, &s.autovacuums, &s.autoanalyzes)
	return s
}

func (a serverStats) note(name string, b serverStats) {
	bench.Note("%s: WAL %.0f MB, buffers written by backends %.0f, bgwriter %.0f, checkpoints %.0f (%.0f buffers); archive autovacuums %.0f, autoanalyzes %.0f",
		name, (b.walBytes-a.walBytes)/1e6, b.buffersBackend-a.buffersBackend, b.buffersClean-a.buffersClean,
		b.checkpoints-a.checkpoints, b.buffersCheckpoint-a.buffersCheckpoint, b.autovacuums-a.autovacuums, b.autoanalyzes-a.autoanalyzes)
}
