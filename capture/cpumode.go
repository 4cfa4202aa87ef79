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

	// The scheduling group's nice value while tailing (Config.TailNice; 0
	// in the other modes), set by setNice (nil: it cannot be set here,
	// niceWhy says why; cpunice_linux.go). It is lowered back to 0 while
	// tailing too once the capture is niceHigh behind (a quarter of
	// high: the source is busier than a burst), and raised again within
	// niceLow.
	tailNice          int
	niceHigh, niceLow int64
	setNice           func(int) error
	niceWhy           string

	mu      sync.Mutex
	mode    string
	backlog int64 // WAL bytes behind at the last check
	niceOn  bool  // tailing at tailNice (else 0)
	nice    int   // the nice value last set (0 at start)
	niceErr error // the last setNice's error, until one succeeds
}

// newCPUGovernor is the governor for cfg, nil when it has nothing to do:
// TailCPUs 0 (every CPU always), or at least the CPUs the process may use
// and no TailNice.
func newCPUGovernor(cfg *Config) *cpuGovernor {
	all := runtime.GOMAXPROCS(0)
	if cfg.TailCPUs <= 0 || cfg.TailCPUs >= all && cfg.TailNice == 0 {
		return nil
	}
	g := &cpuGovernor{all: all, tail: min(cfg.TailCPUs, all), high: cfg.CatchUpBytes, low: min(1<<20, cfg.CatchUpBytes/4),
		set: runtime.GOMAXPROCS, mode: CPUModeAll, tailNice: cfg.TailNice}
	g.niceHigh = cfg.CatchUpBytes / 4
	g.niceLow = g.niceHigh / 4
	if cfg.TailNice > 0 {
		g.setNice, g.niceWhy = autogroupNice()
	}
	return g
}

// nextNice says whether the capture tails at tailNice after a check that
// found it backlog bytes behind in mode, niced (on) until now. A burst of
// the source's deletes goes first while the capture trails it by less
// than niceHigh; past that the source is busier than a burst, and a
// capture that keeps yielding to it would trail it by ever more (up to
// high, seconds of lag): it competes as an equal again, on its tail CPUs,
// until it is within niceLow.
func (g *cpuGovernor) nextNice(mode string, backlog int64, on bool) bool {
	switch {
	case mode != CPUModeTail || g.tailNice == 0:
		return false
	case on && backlog >= g.niceHigh:
		return false
	case !on && backlog <= g.niceLow:
		return true
	}
	return on
}

// niceFor is the scheduling group's nice value: tailNice when on.
func (g *cpuGovernor) niceFor(on bool) int {
	if on {
		return g.tailNice
	}
	return 0
}

// applyNice sets the nice value for on if it is not set yet (a failed
// set is tried again at the next check: an unprivileged process may set
// its autogroup's nice at most every 100 ms, and that limit is the whole
// machine's). It reports an error the first time it happens. Called with
// g.mu held.
func (g *cpuGovernor) applyNice(on bool) (changed bool, err error) {
	g.niceOn = on
	want := g.niceFor(on)
	if g.setNice == nil || want == g.nice && g.niceErr == nil {
		return false, nil
	}
	if err := g.setNice(want); err != nil {
		first := g.niceErr == nil
		g.niceErr = err
		if first {
			return false, err
		}
		return false, nil
	}
	g.nice, g.niceErr = want, nil
	return true, nil
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

// niceState is the scheduling group's nice value the capture set (0:
// none) and, when --tail-nice asks for one that cannot be set here, why,
// for /status.
func (s *Service) niceState() (nice int, why string) {
	g := s.cpu
	if g == nil || g.tailNice == 0 {
		return 0, ""
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	switch {
	case g.setNice == nil:
		why = g.niceWhy
	case g.niceErr != nil:
		why = "setting the autogroup's nice value failed: " + g.niceErr.Error()
	}
	return g.nice, why
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
	on := g.nextNice(mode, backlog, g.niceOn)
	niceChanged, niceErr := g.applyNice(on)
	nice := g.nice
	if niceChanged {
		s.m.cpuNice.Set(float64(nice))
	}
	g.mu.Unlock()
	if niceErr != nil {
		s.log.Warn("could not set the nice value of the capture's autogroup (tried again at every check)", "nice", g.niceFor(on), "err", niceErr)
	}
	if mode == prev {
		if niceChanged {
			s.log.Info("tailing: the capture's autogroup nice changed with its backlog", "autogroup_nice", nice, "backlog_bytes", backlog,
				"nice_until_bytes", g.niceHigh)
		}
		return
	}
	if mode == CPUModeCatchUp {
		s.log.Info("catching up: using every CPU", "cpus", cpus, "autogroup_nice", nice, "backlog_bytes", backlog, "received_lsn", event.LSN(s.received.Load()).String())
		return
	}
	s.log.Info("tailing the source: limited to --tail-cpus and --tail-nice", "cpus", cpus, "autogroup_nice", nice, "backlog_bytes", backlog, "catch_up_bytes", g.high)
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
		if changed, _ := g.applyNice(false); changed {
			s.m.cpuNice.Set(0)
		}
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
