package e2e_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/capture"
	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/bench"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

// captureReadyTimeout is how long a test waits for a capture's stream and
// slot: creating the slot waits for every transaction running in the shared
// cluster, other tests' too (a seed, a 100 MiB row, a 50,000-row delete),
// and a capture may restart first (bench.WaitCaptureReady says what it
// waits for when this runs out).
const captureReadyTimeout = 3 * time.Minute

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
	selfExit int           // exits the test did not cause (e.g. Postgres restarted)
	killed   *bench.Proc   // the process the test last killed
	held     chan struct{} // non-nil: the next restart waits until it is closed (KillHeld)
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
			// Keep the whole log past the test's temp dir for diagnosis.
			kept := filepath.Join(os.TempDir(), fmt.Sprintf("epitaph-e2e-%s-%s-%d.log", t.Name(), s.name, os.Getpid()))
			if b, err := os.ReadFile(filepath.Join(s.dir, s.name+".log")); err == nil {
				_ = os.WriteFile(kept, b, 0o644)
			}
			t.Logf("---- log of %s (whole log kept in %s; last 3000 bytes) ----\n%s", s.name, kept, s.logTail(3000))
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
		s.mu.Lock()
		held := s.held
		s.mu.Unlock()
		if held != nil {
			select {
			case <-s.stop:
				return
			case <-held:
			}
		}
		if err := s.start(); err != nil {
			s.t.Errorf("restart %s: %v", s.name, err)
			return
		}
	}
}

// KillHeld SIGKILLs the running process and holds its restart until
// Release: what the test does in between happens while it is down.
func (s *supervised) KillHeld() {
	s.mu.Lock()
	s.held = make(chan struct{})
	s.mu.Unlock()
	s.Kill()
}

// Release lets the supervisor restart the process KillHeld killed.
func (s *supervised) Release() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.held != nil {
		close(s.held)
		s.held = nil
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

// Quit ends supervision and SIGQUITs the process: its goroutine stacks go
// to its log (a stall's diagnosis).
func (s *supervised) Quit() {
	select {
	case <-s.stop:
		return
	default:
	}
	close(s.stop)
	<-s.done
	s.current().Quit()
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

// LogCount counts the lines of the process's log (every run) containing sub.
func (s *supervised) LogCount(sub string) int {
	b, err := os.ReadFile(filepath.Join(s.dir, s.name+".log"))
	if err != nil {
		return 0
	}
	return strings.Count(string(b), sub)
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

// superviseProjectors starts n supervised `projector run` workers
// (worker-0 …) against url and natsURL with a 3 s lease and the extra
// environment, each killed at random from its own seed.
func superviseProjectors(t *testing.T, bin, url, natsURL string, n int, seed uint64, extra ...string) []*supervised {
	t.Helper()
	workers := make([]*supervised, 0, n)
	for i := range n {
		m, err := bench.LocalAddr()
		require.NoError(t, err)
		env := joinEnv(bench.ProjectorEnv(url, natsURL, m, "main", fmt.Sprintf("worker-%d", i)), append([]string{"EPITAPH_LEASE_TTL=3s"}, extra...)...)
		workers = append(workers, supervise(t, fmt.Sprintf("projector-%d", i), bin, env, seed+uint64(i)+1, "run"))
	}
	return workers
}

func joinEnv(env []string, extra ...string) []string {
	return append(append([]string(nil), env...), extra...)
}

func summary(lines []string) string { return strings.Join(lines, ", ") }

// pipelineState describes where rows are when the archive falls short:
// deletes in the stream per partition, each partition's progress row, the
// quarantine, and archived rows per table.
func pipelineState(ctx context.Context, url string, watch *bench.StreamWatch) string {
	var b strings.Builder
	if n, err := watch.Deletes(ctx); err == nil {
		fmt.Fprintf(&b, "stream deletes: %d\n", n)
	}
	if s, err := watch.JetStream().Stream(ctx, "EPITAPH_MAIN"); err == nil {
		if info, err := s.Info(ctx); err == nil {
			fmt.Fprintf(&b, "stream: msgs=%d first=%d last=%d\n", info.State.Msgs, info.State.FirstSeq, info.State.LastSeq)
		}
		for p := 0; p < 8; p++ {
			info, err := s.Info(ctx, jetstream.WithSubjectFilter(fmt.Sprintf("epitaph.main.%d.>", p)))
			if err != nil {
				continue
			}
			var n uint64
			for _, c := range info.State.Subjects {
				n += c
			}
			fmt.Fprintf(&b, "  partition %d: %d messages\n", p, n)
		}
	}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return b.String()
	}
	defer conn.Close(ctx)
	for _, q := range []string{
		`SELECT format('progress p%s cursor=%s last=%s/%s owner=%s epoch=%s expires=%s attempts=%s failure=%s',
			partition, cursor, last_commit_lsn, last_seq, owner, epoch, lease_expires_at, attempts, last_failure_category)
			FROM epitaph.progress ORDER BY partition`,
		`SELECT format('quarantine %s %s: %s', partition, category, left(error, 200)) FROM epitaph.quarantine`,
		`SELECT format('archived %s: %s', t, n) FROM (SELECT schema_name || '.' || table_name AS t, count(*) AS n
			FROM archive.rows GROUP BY 1) x ORDER BY 1`,
		// Rows archived but not visible: their transaction's commit never verified.
		`SELECT format('unverified commit_lsn=%s rows=%s seqs=%s..%s', commit_lsn, count(*), min(seq), max(seq))
			FROM archive_v1.rows WHERE NOT verified GROUP BY commit_lsn ORDER BY commit_lsn`,
		`SELECT format('backend pid=%s app=%s state=%s wait=%s/%s running=%s query=%s', pid, application_name, state,
			wait_event_type, wait_event, now() - query_start, left(regexp_replace(query, '\s+', ' ', 'g'), 100))
			FROM pg_stat_activity WHERE datname = current_database() AND state <> 'idle' AND pid <> pg_backend_pid()`,
	} {
		rows, err := conn.Query(ctx, q)
		if err != nil {
			fmt.Fprintf(&b, "%v\n", err)
			continue
		}
		lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			fmt.Fprintf(&b, "%v\n", err)
		}
		for _, l := range lines {
			b.WriteString(l + "\n")
		}
	}
	return b.String()
}

// keepStreamDump writes every message of the source's stream (sequence,
// subject, Nats-Msg-Id, Epitaph-Position, expected last id, and the event's
// op, xid, commit LSN, table and key) to a file that outlives the test, for
// diagnosing a failure, and returns its path.
func keepStreamDump(t *testing.T, natsURL, source string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	path := filepath.Join(os.TempDir(), fmt.Sprintf("epitaph-e2e-%s-stream-%d.txt", t.Name(), os.Getpid()))
	nc, err := natsgo.Connect(natsURL)
	if err != nil {
		return fmt.Sprintf("(no dump: %v)", err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return fmt.Sprintf("(no dump: %v)", err)
	}
	stream, err := js.Stream(ctx, event.StreamName(source))
	if err != nil {
		return fmt.Sprintf("(no dump: %v)", err)
	}
	info, err := stream.Info(ctx)
	if err != nil {
		return fmt.Sprintf("(no dump: %v)", err)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "first %d last %d msgs %d\n", info.State.FirstSeq, info.State.LastSeq, info.State.Msgs)
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq && seq > 0; seq++ {
		m, err := stream.GetMsg(ctx, seq)
		if err != nil {
			fmt.Fprintf(&b, "%d: %v\n", seq, err)
			continue
		}
		line := fmt.Sprintf("%d %s id=%s pos=%s", seq, m.Subject, m.Header.Get(jetstream.MsgIDHeader), m.Header.Get(capture.HeaderPosition))
		if e, err := event.Decode(m.Data); err == nil {
			line += fmt.Sprintf(" op=%s xid=%d commit=%s lsn=%s %s key=%s", e.Op, e.XID, e.CommitLSN, e.LSN, e.QualifiedTable(), e.Key)
		}
		b.WriteString(line + "\n")
	}
	if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
		return fmt.Sprintf("(no dump: %v)", err)
	}
	return path
}

// testSeed is the seed of a randomized test: EPITAPH_E2E_SEED when set (to
// replay a failure: the workload and the order and spacing of the faults
// follow from it), else the clock.
func testSeed(t *testing.T) uint64 {
	t.Helper()
	if v := os.Getenv("EPITAPH_E2E_SEED"); v != "" {
		seed, err := strconv.ParseUint(v, 10, 64)
		require.NoError(t, err, "EPITAPH_E2E_SEED")
		return seed
	}
	return uint64(time.Now().UnixNano())
}
