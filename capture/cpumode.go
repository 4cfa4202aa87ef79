package capture

import (
	"context"
	"runtime"
	"sync"
	"time"

	"github.com/epitaph-dev/epitaph/event"
)

// CPU modes (Config.TailCPUs, Status.CPUMode). A capture on the source's
// machine shares its cores with the backends whose deletes it reads: while
// it merely follows them it keeps to TailCPUs (the process's GOMAXPROCS),
// leaving the other cores to the source; with a real backlog (a start after
// downtime, or a source that one CPU cannot follow) it uses every CPU the
// process had at start. So a burst of deletes slows the source less and
// builds up lag in the capture, caught up after it; and a backlog is
// drained at full speed.
const (
	// CPUModeAll: not limited (TailCPUs 0, or at least the CPUs there are).
	CPUModeAll = "all"
	// CPUModeTail: within CatchUpBytes of the source, on TailCPUs.
	CPUModeTail = "tail"
	// CPUModeCatchUp: a backlog, on every CPU.
	CPUModeCatchUp = "catch_up"
)

// DefaultCatchUpBytes is Config.CatchUpBytes unless set: 64 MiB of WAL is
// ~500,000 deleted rows of bench-capture's shop (REPLICA IDENTITY FULL,
// ~130 bytes of WAL a row), several seconds of work for a capture on one
// CPU (~100,000 rows/s there): a burst of deletes stays under it (the
// 300,020-row source-cost burst, deleted as fast as two cores allow, left
// the capture 4-31 MB behind at its end, at most its whole 38 MB), while a
// capture that cannot follow a sustained rate on one CPU crosses it within
// seconds.
const DefaultCatchUpBytes = 64 << 20

// minCatchUpBytes is the least Config.CatchUpBytes.
const minCatchUpBytes = 1 << 20

// cpuCheckInterval is how often the backlog is measured (one
// query of the WAL insert position) while TailCPUs limits the capture.
const cpuCheckInterval = time.Second

// sqlWALEnd is where the source's WAL ends: the insert position (with
// synchronous_commit off a commit is in the WAL before it is written), or
// what a standby has replayed.
const sqlWALEnd = `SELECT (CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_insert_lsn() END)::text`

// cpuGovernor switches the process between the tail and catch-up modes.
type cpuGovernor struct {
	all, tail int   // GOMAXPROCS at start; while tailing
	high, low int64 // catch up at or above high behind; tail again at or below low
	set       func(int) int

	mu      sync.Mutex
	mode    string
	backlog int64 // WAL bytes behind at the last check
}

// newCPUGovernor is the governor for cfg, nil when TailCPUs does not limit
// the process (0, or at least the CPUs it may use).
func newCPUGovernor(cfg *Config) *cpuGovernor {
	all := runtime.GOMAXPROCS(0)
	if cfg.TailCPUs <= 0 || cfg.TailCPUs >= all {
		return nil
	}
	return &cpuGovernor{all: all, tail: cfg.TailCPUs, high: cfg.CatchUpBytes, low: min(1<<20, cfg.CatchUpBytes/4),
		set: runtime.GOMAXPROCS, mode: CPUModeAll}
}

// next is the mode after a check that found the capture backlog bytes
// behind the source, in mode cur. The first decision (cur all: at the
// start, or after checks that failed until now): a backlog above the
// caught-up mark is downtime's, caught up on every CPU. While streaming,
// lag up to high is a burst the capture rides on its tail CPUs; past high
// one CPU does not follow the source.
func (g *cpuGovernor) next(cur string, backlog int64) string {
	switch {
	case cur == CPUModeAll && backlog > g.low:
		return CPUModeCatchUp
	case cur == CPUModeAll:
		return CPUModeTail
	case cur == CPUModeTail && backlog >= g.high:
		return CPUModeCatchUp
	case cur == CPUModeCatchUp && backlog <= g.low:
		return CPUModeTail
	}
	return cur
}

// procs is GOMAXPROCS in mode.
func (g *cpuGovernor) procs(mode string) int {
	if mode == CPUModeTail {
		return g.tail
	}
	return g.all
}

// cpuState is the mode, the CPUs it uses and the backlog at the last
// check, for /status.
func (s *Service) cpuState() (mode string, cpus int, backlog int64) {
	g := s.cpu
	if g == nil {
		return CPUModeAll, runtime.GOMAXPROCS(0), -1
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.mode, g.procs(g.mode), g.backlog
}

// checkCPUs measures the backlog (the source's WAL position minus what
// the stream loop has received) and switches the mode if it says so.
func (s *Service) checkCPUs(ctx context.Context) {
	g := s.cpu
	var text string
	err := s.pool.QueryRow(ctx, sqlWALEnd).Scan(&text)
	var cur event.LSN
	if err == nil {
		cur, err = event.ParseLSN(text)
	}
	if err != nil {
		if ctx.Err() == nil {
			s.log.Debug("read the source's WAL position for the CPU mode", "err", redactErr(err))
		}
		return
	}
	backlog := max(int64(cur)-int64(s.received.Load()), 0)
	s.m.backlogBytes.Set(float64(backlog))
	// The switch is made under the lock, the counter last: whoever sees
	// the new mode (cpuState) or the count sees the CPUs set.
	g.mu.Lock()
	prev := g.mode
	g.backlog = backlog
	mode := g.next(prev, backlog)
	cpus := g.procs(mode)
	if mode != prev {
		g.set(cpus)
		g.mode = mode
		s.m.cpus.Set(float64(cpus))
		catching := 0.0
		if mode == CPUModeCatchUp {
			catching = 1
		}
		s.m.catchingUp.Set(catching)
		s.m.cpuModeSwitches.WithLabelValues(mode).Inc()
	}
	g.mu.Unlock()
	if mode == prev {
		return
	}
	if mode == CPUModeCatchUp {
		s.log.Info("catching up: using every CPU", "cpus", cpus, "backlog_bytes", backlog, "received_lsn", event.LSN(s.received.Load()).String())
		return
	}
	s.log.Info("tailing the source: limited to --tail-cpus", "cpus", cpus, "backlog_bytes", backlog, "catch_up_bytes", g.high)
}

// governCPUs checks the backlog every cpuCheckInterval until ctx ends,
// then gives the process every CPU back.
func (s *Service) governCPUs(ctx context.Context) {
	defer s.bgWG.Done()
	g := s.cpu
	defer func() {
		g.mu.Lock()
		defer g.mu.Unlock()
		g.set(g.all)
		g.mode = CPUModeAll
		s.m.cpus.Set(float64(g.all))
		s.m.catchingUp.Set(0)
	}()
	t := time.NewTicker(cpuCheckInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			s.checkCPUs(ctx)
		}
	}
}
