package capture

import (
	"context"
	"encoding/json"
	"errors"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
)

func TestCPUModeHysteresis(t *testing.T) {
	t.Parallel()
	g := &cpuGovernor{all: 4, tail: 1, high: 64 << 20, low: 1 << 20}
	for _, c := range []struct {
		cur     string
		backlog int64
		want    string
	}{
		{CPUModeAll, 0, CPUModeTail},              // the first decision
		{CPUModeAll, 1 << 20, CPUModeTail},        // within the caught-up mark
		{CPUModeAll, 1<<20 + 1, CPUModeCatchUp},   // a backlog found at start: caught up first
		{CPUModeTail, 63 << 20, CPUModeTail},      // a burst below the mark: ridden on the tail CPUs
		{CPUModeTail, 64 << 20, CPUModeCatchUp},   // one CPU does not follow
		{CPUModeCatchUp, 2 << 20, CPUModeCatchUp}, // hysteresis: not yet caught up
		{CPUModeCatchUp, 1 << 20, CPUModeTail},
	} {
		require.Equal(t, c.want, g.next(c.cur, c.backlog), "%+v", c)
	}
	require.Equal(t, 1, g.procs(CPUModeTail))
	require.Equal(t, 4, g.procs(CPUModeCatchUp))

	// Not limited: no governor.
	all := runtime.GOMAXPROCS(0)
	require.Nil(t, newCPUGovernor(&Config{TailCPUs: 0}))
	require.Nil(t, newCPUGovernor(&Config{TailCPUs: 0, TailNice: 19}), "--tail-cpus 0: never limited")
	require.Nil(t, newCPUGovernor(&Config{TailCPUs: all}))
	// As many tail CPUs as there are, but a nice value to set: governed.
	g = newCPUGovernor(&Config{TailCPUs: all + 1, TailNice: 19, CatchUpBytes: DefaultCatchUpBytes})
	require.NotNil(t, g)
	require.Equal(t, all, g.procs(CPUModeTail))
	require.Equal(t, int64(16<<20), g.niceHigh, "a quarter of --catch-up-bytes")
	require.Equal(t, int64(4<<20), g.niceLow)
	for _, c := range []struct {
		mode    string
		backlog int64
		on      bool
		want    bool
	}{
		{CPUModeTail, 0, false, true},          // tailing: niced
		{CPUModeTail, 4 << 20, false, true},    // within niceLow
		{CPUModeTail, 4<<20 + 1, false, false}, // hysteresis: not yet back
		{CPUModeTail, 16<<20 - 1, true, true},  // a burst: the source goes first
		{CPUModeTail, 16 << 20, true, false},   // busier than a burst: an equal again
		{CPUModeCatchUp, 0, true, false},       // catching up: never niced
		{CPUModeAll, 0, true, false},           // stopped or not decided
	} {
		require.Equal(t, c.want, g.nextNice(c.mode, c.backlog, c.on), "%+v", c)
	}
	require.Equal(t, 19, g.niceFor(true))
	require.Equal(t, 0, g.niceFor(false))
	g.tailNice = 0
	require.False(t, g.nextNice(CPUModeTail, 0, false), "--tail-nice 0: never")
}

// A nice value that could not be set is tried again at the next check and
// reported once; one already set is not set again.
func TestTailNiceRetried(t *testing.T) {
	t.Parallel()
	var calls []int
	fail := 1
	g := &cpuGovernor{tailNice: 19, setNice: func(n int) error {
		calls = append(calls, n)
		if fail > 0 {
			fail--
			return errors.New("resource temporarily unavailable")
		}
		return nil
	}}
	changed, err := g.applyNice(true)
	require.False(t, changed)
	require.Error(t, err, "the first failure is reported")
	require.Equal(t, 0, g.nice)
	changed, err = g.applyNice(true)
	require.True(t, changed)
	require.NoError(t, err)
	require.Equal(t, 19, g.nice)
	changed, err = g.applyNice(true)
	require.False(t, changed, "already set")
	require.NoError(t, err)
	changed, _ = g.applyNice(false)
	require.True(t, changed)
	require.Equal(t, []int{19, 19, 0}, calls)
	require.Equal(t, 0, g.nice)

	// Failing again and again: reported once, still tried.
	fail = 3
	_, err = g.applyNice(true)
	require.Error(t, err)
	_, err = g.applyNice(true)
	require.NoError(t, err, "reported once")
	require.NotNil(t, g.niceErr)
	_, err = g.applyNice(true)
	require.NoError(t, err)
	changed, err = g.applyNice(true)
	require.True(t, changed)
	require.NoError(t, err)
	require.Nil(t, g.niceErr)
	require.Equal(t, []int{19, 19, 0, 19, 19, 19, 19}, calls)
}

// A real capture started with a backlog catches up on every CPU and drops
// to --tail-cpus once caught up; a lag past --catch-up-bytes while it
// tails (here: the capture held at a commit while the source writes WAL)
// gives it every CPU again, until it has caught up again. Every switch is
// asserted on the metrics, /status and the process's GOMAXPROCS; the rows
// on the stream. Not parallel: the mode sets the test process's GOMAXPROCS.
func TestCPUModeFollowsTheBacklog(t *testing.T) {
	all := runtime.GOMAXPROCS(0)
	if all < 2 {
		t.Skip("one CPU: nothing to limit")
	}
	defer runtime.GOMAXPROCS(all)
	e := setup(t)
	const rows = 6000 // ~2.5 MB of WAL deleted (REPLICA IDENTITY FULL): past the 512 KiB caught-up mark
	e.exec(t, `CREATE TABLE items (id int PRIMARY KEY, pad text); ALTER TABLE items REPLICA IDENTITY FULL;
		INSERT INTO items SELECT i, (SELECT string_agg(md5(i::text || '.' || j::text), '') FROM generate_series(1, 10) j)
			FROM generate_series(1, 6001) i; -- 320 incompressible bytes a row
		CREATE TABLE filler (id bigserial PRIMARY KEY, pad text)`)
	// The slot and stream first, then the backlog while no capture runs.
	first := e.start(t, nil)
	require.NoError(t, first.Stop(context.Background()))
	require.NoError(t, first.Wait())
	e.exec(t, `DELETE FROM items WHERE id <= 6000`)

	cfg := e.config()
	cfg.TailCPUs, cfg.CatchUpBytes = 1, 2<<20 // caught up within 512 KiB
	cfg.TailNice = 19
	cfg.HeartbeatInterval = time.Second // commits through the slot even when idle: the received position follows
	svc := newService(t, cfg)
	// The test process does not lead its session: its autogroup is not
	// the capture's to set (cpunice_linux.go). The nice values the modes
	// set are recorded instead (TestTailNiceSetsTheAutogroup sets a real
	// one).
	var niceMu sync.Mutex
	var niceSet []int
	svc.cpu.setNice = func(n int) error {
		niceMu.Lock()
		defer niceMu.Unlock()
		niceSet = append(niceSet, n)
		return nil
	}
	lastNice := func() []int {
		niceMu.Lock()
		defer niceMu.Unlock()
		return slices.Clone(niceSet)
	}
	var hold atomic.Bool
	held, release := make(chan struct{}), make(chan struct{})
	done := make(chan struct{})
	t.Cleanup(func() { close(done) }) // never leave the capture held (runs before its stop)
	svc.hooks = &testHooks{beforeCommit: func(event.LSN) {
		if hold.CompareAndSwap(true, false) {
			close(held)
			select {
			case <-release:
			case <-done:
			}
		}
	}}
	require.NoError(t, svc.Start(context.Background()))
	switches := func(mode string) float64 { return metricValue(t, svc.m.cpuModeSwitches.WithLabelValues(mode)) }

	// Started with the backlog: catching up from the first row.
	require.Equal(t, 1.0, switches(CPUModeCatchUp), "a start with a backlog catches up")
	require.Equal(t, 0.0, switches(CPUModeTail))

	waitMode := func(mode string, cpus int, n float64) {
		t.Helper()
		deadline := time.Now().Add(120 * time.Second)
		for {
			st := svc.CurrentStatus()
			if st.CPUMode == mode && switches(mode) == n {
				require.Equal(t, cpus, st.CPUs)
				require.Equal(t, float64(cpus), metricValue(t, svc.m.cpus))
				require.Equal(t, cpus, runtime.GOMAXPROCS(0))
				want := 0.0
				if mode == CPUModeCatchUp {
					want = 1
				}
				require.Equal(t, want, metricValue(t, svc.m.catchingUp))
				require.GreaterOrEqual(t, st.BacklogBytes, int64(0))
				wantNice := 0
				if mode == CPUModeTail {
					wantNice = 19
				}
				require.Equal(t, wantNice, st.CPUNice)
				require.Empty(t, st.CPUNiceUnavailable)
				require.Equal(t, float64(wantNice), metricValue(t, svc.m.cpuNice))
				if set := lastNice(); len(set) > 0 || wantNice != 0 {
					require.Equal(t, wantNice, set[len(set)-1])
				}
				return
			}
			require.True(t, time.Now().Before(deadline), "waiting for mode %s (switch %v): status %s %d cpus, backlog %d, switches %v", mode, n, st.CPUMode, st.CPUs, st.BacklogBytes, switches(mode))
			time.Sleep(50 * time.Millisecond)
		}
	}
	// Caught up: tailing on one CPU, every row on the stream.
	waitMode(CPUModeTail, 1, 1)
	ms := e.deletes(t, "main", rows)
	require.Len(t, ms, rows)
	seen := map[int]bool{}
	for _, m := range ms {
		var k struct{ ID int }
		require.NoError(t, json.Unmarshal(m.ev.Key, &k))
		seen[k.ID] = true
	}
	require.Len(t, seen, rows)
	require.Equal(t, 1.0, switches(CPUModeCatchUp), "no switch while tailing within the mark")

	// Lag past --catch-up-bytes while tailing: the capture is held at the
	// next commit while the source writes ~4.5 MB of WAL.
	hold.Store(true)
	e.exec(t, `DELETE FROM items WHERE id = 6001`)
	select {
	case <-held:
	case <-time.After(120 * time.Second):
		t.Fatal("the capture did not reach the commit")
	}
	e.exec(t, `INSERT INTO filler (pad) SELECT md5(i::text) || md5((-i)::text) FROM generate_series(1, 40000) i`)
	waitMode(CPUModeCatchUp, all, 2)

	// Released, it catches up and tails again.
	close(release)
	waitMode(CPUModeTail, 1, 2)
	require.Len(t, e.deletes(t, "main", rows+1), rows+1)

	// Stopped, the process has every CPU back.
	require.NoError(t, svc.Stop(context.Background()))
	require.NoError(t, svc.Wait())
	require.Equal(t, all, runtime.GOMAXPROCS(0))
	require.Equal(t, CPUModeAll, svc.CurrentStatus().CPUMode)
	// Caught up from the start at nice 0 (nothing to set), tailing at 19,
	// catching up at 0, tailing at 19, and 0 again when stopped.
	require.Equal(t, []int{19, 0, 19, 0}, lastNice())
	require.Equal(t, 0, svc.CurrentStatus().CPUNice)
}
