package e2e_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/bench"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

// binaries builds the real capture and projector for one test.
func binaries(t *testing.T) map[string]string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	bins, err := bench.Build(ctx, t.TempDir(), "capture", "projector")
	require.NoError(t, err)
	return bins
}

// supervised keeps one process running, like systemd or Kubernetes would:
// whenever it exits (killed by the test, or failing on its own because
// Postgres or NATS went away) it is started again after a short pause.
type supervised struct {
	t        *testing.T
	name     string
	bin      string
	env      []string
	args     []string
	dir      string
	rng      *rand.Rand
	mu       sync.Mutex
	proc     *bench.Proc
	starts   int
	kills    int
	selfExit int         // exits the test did not cause (e.g. Postgres restarted)
	killed   *bench.Proc // the process the test last killed
	stop     chan struct{}
	done     chan struct{}
}

func supervise(t *testing.T, name, bin string, env []string, seed uint64, args ...string) *supervised {
	t.Helper()
	s := &supervised{t: t, name: name, bin: bin, env: env, args: args, dir: t.TempDir(),
		rng: rand.New(rand.NewPCG(seed, 1)), stop: make(chan struct{}), done: make(chan struct{})}
	require.NoError(t, s.start())
	go s.loop()
	t.Cleanup(func() {
		s.Stop()
		if t.Failed() {
			t.Logf("---- log of %s (last 6000 bytes) ----\n%s", s.name, s.logTail(6000))
		}
	})
	return s
}

func (s *supervised) start() error {
	p, err := bench.StartProc(s.name, s.bin, s.env, s.dir, s.args...)
	if err != nil {
		return err
	}
	s.mu.Lock()
	s.proc = p
	s.starts++
	s.mu.Unlock()
	return nil
}

func (s *supervised) current() *bench.Proc {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.proc
}

func (s *supervised) loop() {
	defer close(s.done)
	for {
		p := s.current()
		select {
		case <-s.stop:
			return
		case <-p.Done():
		}
		s.mu.Lock()
		if s.killed != p {
			s.selfExit++
		}
		s.mu.Unlock()
		// A random pause before the restart, as a real supervisor's
		// backoff would give.
		select {
		case <-s.stop:
			return
		case <-time.After(time.Duration(100+s.rng.IntN(500)) * time.Millisecond):
		}
		if err := s.start(); err != nil {
			s.t.Errorf("restart %s: %v", s.name, err)
			return
		}
	}
}

// Kill SIGKILLs the running process; the supervisor restarts it.
func (s *supervised) Kill() {
	p := s.current()
	s.mu.Lock()
	s.kills++
	s.killed = p
	s.mu.Unlock()
	p.Kill()
}

// Stop ends supervision and stops the process (SIGTERM, then SIGKILL).
func (s *supervised) Stop() {
	select {
	case <-s.stop:
		return
	default:
	}
	close(s.stop)
	<-s.done
	_ = s.current().Stop(20 * time.Second)
}

// Stats: how many times the process was started, killed by the test, and
// exited on its own.
func (s *supervised) Stats() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return fmt.Sprintf("%s: starts=%d kills=%d self_exits=%d", s.name, s.starts, s.kills, s.selfExit)
}

func (s *supervised) logTail(n int) string {
	b, err := os.ReadFile(filepath.Join(s.dir, s.name+".log"))
	if err != nil {
		return ""
	}
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}

// Alive reports whether the process is running now.
func (s *supervised) Alive() bool {
	done, _ := s.current().Exited()
	return !done
}

// chaos runs actions at random intervals (min..max apart), in a shuffled
// order, and returns a log of what it did.
func chaos(ctx context.Context, rng *rand.Rand, minGap, maxGap time.Duration, actions map[string]func()) []string {
	var names []string
	for n := range actions {
		names = append(names, n)
	}
	// Map order is random; sort then shuffle with the seeded rng so a seed
	// reproduces the order.
	sort.Strings(names)
	rng.Shuffle(len(names), func(i, j int) { names[i], names[j] = names[j], names[i] })
	var done []string
	start := time.Now()
	for _, n := range names {
		gap := minGap + time.Duration(rng.Int64N(int64(maxGap-minGap)+1))
		select {
		case <-ctx.Done():
			return done
		case <-time.After(gap):
		}
		actions[n]()
		done = append(done, fmt.Sprintf("%s@%.1fs", n, time.Since(start).Seconds()))
	}
	return done
}

func joinEnv(env []string, extra ...string) []string {
	return append(append([]string(nil), env...), extra...)
}

func summary(lines []string) string { return strings.Join(lines, ", ") }
