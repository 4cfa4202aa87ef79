package e2e_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	natsgo "github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	capturepkg "github.com/epitaph-dev/epitaph/capture"
	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/internal/bench"
	"github.com/epitaph-dev/epitaph/internal/broker"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/internal/workload"
)

// readyGrace: a sample is a violation only for rows whose deletes committed
// at least this long before it (the capture's publish, the workers' lag
// sample every 5 s and its application all take time).
const readyGrace = 20 * time.Second

// soakReadyMaxLag is the workers' --ready-max-lag: small, so the readiness
// check is sharp, but above the heartbeats an idle stream always has in
// flight (one a second to each of 8 partitions: an idle archive's sampled
// lag is rarely 0).
const soakReadyMaxLag = 20

// soakHandlerID is the webhook handler on public.orders of the first
// target.
const soakHandlerID = "5a5a5a5a-5a5a-4a5a-8a5a-5a5a5a5a5a5a"

// soakCursorID is the first target's cursor handler on public.orders: a
// webhook batching without revalidation, beside soakHandlerID on the same
// rows and the same receiver.
const soakCursorID = "c5c5c5c5-c5c5-4c5c-8c5c-c5c5c5c5c5c5"

// soakHandlers are the first target's handlers the oracle checks.
var soakHandlers = []string{soakHandlerID, soakCursorID}

type rowKey struct {
	table string
	id    int64
	gen   int
}

func (k rowKey) String() string { return fmt.Sprintf("%s id=%d gen=%d", k.table, k.id, k.gen) }

// erasedRow is one archived row an erasure removed.
type erasedRow struct {
	rowKey
	commitLSN   string
	seq         int
	correlation string
	customerID  int64 // orders only
	at          time.Time
	purged      bool
}

// archRow is one row of a target's live archive at a checkpoint.
type archRow struct {
	rowKey
	commitLSN   string
	seq         int
	correlation string
	raw         string
	row         map[string]any // numbers as json.Number
}

func (a archRow) ref(col string) int64 {
	switch v := a.row[col].(type) {
	case float64:
		return int64(v)
	case json.Number:
		n, _ := v.Int64()
		return n
	}
	return -1
}

type soakTarget struct {
	name    string
	url     string
	workers []*supervised
	// erasedRows: archive rows erased on this target (for the readiness
	// lower bound), counted as each erase starts.
	erasedRows int
}

type histPoint struct {
	at      time.Time
	deleted int64
}

// flakyHook is the soak's webhook: it fails ~30% of requests, hangs ~5%
// past the claim timeout before accepting, and records every delivery it
// accepted (each delivery of a batch as if it had come alone).
type flakyHook struct {
	mu sync.Mutex
	// "handler table key correlation" -> delivery id -> accepted in time
	// (false: only after hanging past the claim timeout, when the sender
	// had given the attempt up).
	accepted map[string]map[string]bool
	acceptAt map[string][]time.Time // the same key -> when each accepted request arrived
	ids      map[string]bool
	requests int
	failed   int
	hung     int
	batches  int // requests carrying a batch
	// acceptedBy: per handler, the delivery ids it accepted.
	acceptedBy map[string]map[string]bool
	// members: per webhook-id of a batch, its delivery ids; batchesOf: per
	// delivery id, the webhook-ids of the batches that carried it
	// (accepted or not).
	members   map[string][]string
	batchesOf map[string]map[string]bool
	stop      chan struct{}
	// calm: the storm is over; every request is accepted.
	calm atomic.Bool
}

func (h *flakyHook) handle(w http.ResponseWriter, r *http.Request) {
	var batch handler.BatchBody
	if r.Header.Get(handler.HeaderBatchSize) != "" {
		if err := json.NewDecoder(r.Body).Decode(&batch); err != nil || len(batch.Deliveries) == 0 {
			w.WriteHeader(400)
			return
		}
	} else {
		var body handler.Body
		if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
			w.WriteHeader(400)
			return
		}
		body.DeliveryID = r.Header.Get(handler.HeaderDeliveryID)
		batch.Deliveries = []handler.Body{body}
	}
	arrived := time.Now()
	x := rand.IntN(100)
	if h.calm.Load() {
		x = 100
	}
	inTime := true
	h.mu.Lock()
	h.requests++
	if wid := r.Header.Get(handler.HeaderWebhookID); r.Header.Get(handler.HeaderBatchSize) != "" {
		h.batches++
		if h.members[wid] == nil {
			for _, d := range batch.Deliveries {
				h.members[wid] = append(h.members[wid], d.DeliveryID)
				if h.batchesOf[d.DeliveryID] == nil {
					h.batchesOf[d.DeliveryID] = map[string]bool{}
				}
				h.batchesOf[d.DeliveryID][wid] = true
			}
		}
	}
	h.mu.Unlock()
	switch {
	case x < 30:
		h.mu.Lock()
		h.failed++
		h.mu.Unlock()
		w.WriteHeader(http.StatusServiceUnavailable)
		return
	case x < 35:
		// Past the 3 s claim timeout: the attempt is taken back and made
		// again, while this one is accepted late (a duplicate of the same
		// delivery id, which the receiver must tolerate).
		h.mu.Lock()
		h.hung++
		h.mu.Unlock()
		select {
		case <-time.After(4 * time.Second):
		case <-h.stop:
			return
		}
		inTime = false
	}
	h.mu.Lock()
	for _, body := range batch.Deliveries {
		id := body.DeliveryID
		k := fmt.Sprintf("%s %s %s %s", body.HandlerID, body.Table, compactJSON(body.Key), body.CorrelationID)
		if h.accepted[k] == nil {
			h.accepted[k] = map[string]bool{}
		}
		h.accepted[k][id] = h.accepted[k][id] || inTime
		// When the request arrived: a request sent before an erasure may be
		// answered after it.
		h.acceptAt[k] = append(h.acceptAt[k], arrived)
		h.ids[id] = true
		if h.acceptedBy[body.HandlerID] == nil {
			h.acceptedBy[body.HandlerID] = map[string]bool{}
		}
		h.acceptedBy[body.HandlerID][id] = true
	}
	h.mu.Unlock()
	w.WriteHeader(http.StatusOK)
}

func compactJSON(b json.RawMessage) string {
	var v any
	if json.Unmarshal(b, &v) != nil {
		return string(b)
	}
	out, _ := json.Marshal(v)
	return string(out)
}

type soak struct {
	t       *testing.T
	ctx     context.Context
	seed    uint64
	rng     *rand.Rand
	bins    map[string]string
	src     string
	natsURL string
	creds   string
	// eraseCreds: the erase role's credentials (erase --purge-stream).
	eraseCreds string
	credsOpts  []natsgo.Option
	// jetStream is the external broker the schedule restarts; nil with
	// the embedded one.
	jetStream *testenv.NATS
	targets   []*soakTarget
	capture   *supervised
	hook      *flakyHook
	watch     *bench.StreamWatch

	mu       sync.Mutex
	phase    string
	erased   map[rowKey]*erasedRow
	restored map[rowKey]int
	restRows map[rowKey]workload.Row
	held     map[int64]bool
	history  []histPoint
	kills    map[string][]time.Time // "capture" or target name -> kill times
	problems []string
	last     []archRow // the first target's archive at the last checkpoint
	counts   map[string]int
	purgedAt time.Time
	tried    map[string]bool
}

func (s *soak) note(action string) {
	s.mu.Lock()
	s.counts[action]++
	s.mu.Unlock()
}

func (s *soak) violation(format string, args ...any) {
	s.mu.Lock()
	defer s.mu.Unlock()
	msg := fmt.Sprintf("seed %d, phase %s: ", s.seed, s.phase) + fmt.Sprintf(format, args...)
	s.problems = append(s.problems, msg)
	s.t.Log("VIOLATION " + msg)
}

// projector runs the projector CLI against target tg and returns its output
// and exit status.
func (s *soak) projector(tg *soakTarget, timeout time.Duration, args ...string) (string, int) {
	return s.projectorAs(s.creds, tg, timeout, args...)
}

// projectorAs is projector with the credentials file creds (none: "").
func (s *soak) projectorAs(creds string, tg *soakTarget, timeout time.Duration, args ...string) (string, int) {
	ctx, cancel := context.WithTimeout(s.ctx, timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, s.bins["projector"], args...)
	cmd.Env = append(os.Environ(), soakEnv(tg.url, s.src, s.natsURL, "cli")...)
	cmd.Env = append(cmd.Env, "EPITAPH_METRICS_ADDR=")
	if creds != "" {
		cmd.Env = append(cmd.Env, "EPITAPH_NATS_CREDS="+creds)
	}
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return string(out), ee.ExitCode()
	}
	if err != nil {
		return string(out) + err.Error(), -1
	}
	return string(out), 0
}

func soakEnv(target, source, natsURL, worker string) []string {
	env := bench.ProjectorEnv(target, natsURL, "", "main", worker)
	for i, e := range env {
		if strings.HasPrefix(e, "EPITAPH_SOURCE_URL=") {
			env[i] = "EPITAPH_SOURCE_URL=" + source
		}
	}
	return env
}

// TestSoakWholeSystem runs every feature at once against the real binaries,
// for SOAK_DURATION (default 2 minutes), from a seed (EPITAPH_SOAK_SEED
// reproduces the schedule): the cascading workload and Django-shaped
// transactions (savepoints, rollbacks, children deleted before their
// parent), SIGKILLs of the capture and of the projector workers of two
// targets (two consumer groups), restarts of the external JetStream server
// (EPITAPH_SOAK_BROKER=embedded uses the capture's own broker instead,
// restarted with each kill of the capture), erasures
// (fenced or purged), legal holds refusing an erasure, retention cleanups,
// a flaky webhook, restores, and one rebuild with compare, promote and
// rollback. After every phase (deletes paused, both targets complete up to
// the source's LSN) and at the end it checks, row by row, against one
// oracle (the workload's ledger and the soak's record of erasures and
// restores): every deleted row archived once with equal values unless
// erased, an erased row nowhere, nothing forged, every accepted delivery
// once per row and none after its row's erasure; all along it samples
// archive.status and fails a sample that says ready while rows deleted
// long enough before are missing or while its own lag is above
// --ready-max-lag (and the soak when no sample could be judged).
func TestSoakWholeSystem(t *testing.T) {
	t.Parallel()
	duration := 2 * time.Minute
	if v := os.Getenv("SOAK_DURATION"); v != "" {
		d, err := time.ParseDuration(v)
		require.NoError(t, err, "SOAK_DURATION")
		duration = d
	}
	seed := uint64(time.Now().UnixNano())
	if v := os.Getenv("EPITAPH_SOAK_SEED"); v != "" {
		n, err := strconv.ParseUint(v, 10, 64)
		require.NoError(t, err, "EPITAPH_SOAK_SEED")
		seed = n
	}
	t.Logf("soak seed %d (EPITAPH_SOAK_SEED=%d reproduces the schedule), duration %s", seed, seed, duration)
	bins := binaries(t)
	ctx, cancel := context.WithTimeout(context.Background(), duration+15*time.Minute)
	defer cancel()

	src := testenv.NewDatabase(t)
	require.NoError(t, workload.Setup(ctx, src))
	_, err := workload.Seed(ctx, src, workload.SeedConfig{Customers: 150, OrdersPerCustomer: 8})
	require.NoError(t, err)

	hook := &flakyHook{accepted: map[string]map[string]bool{}, acceptAt: map[string][]time.Time{}, ids: map[string]bool{},
		acceptedBy: map[string]map[string]bool{}, members: map[string][]string{}, batchesOf: map[string]map[string]bool{}, stop: make(chan struct{})}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	hs := &http.Server{Handler: http.HandlerFunc(hook.handle), ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = hs.Serve(ln) }()
	defer func() {
		close(hook.stop)
		_ = hs.Close()
	}()

	// The broker: an external JetStream server in the test (the default),
	// which the schedule restarts, or with EPITAPH_SOAK_BROKER=embedded the
	// capture's own, which restarts with every kill of the capture.
	embedded := os.Getenv("EPITAPH_SOAK_BROKER") == "embedded"
	metrics, err := bench.LocalAddr()
	require.NoError(t, err)
	dataDir := t.TempDir()
	const slot = "epitaph_e2e_soak"
	var (
		natsURL, projectorCreds, eraseCreds string
		credsOpts                           []natsgo.Option
		jetStream                           *testenv.NATS
		cenv                                []string
	)
	if embedded {
		listen, err := bench.LocalAddr()
		require.NoError(t, err)
		natsURL = "nats://" + listen
		cenv = bench.CaptureEnv(src, "", listen, dataDir, metrics, "main", slot)
		projectorCreds = broker.ProjectorCreds(capturepkg.EmbeddedCredsDir(dataDir))
		eraseCreds = broker.EraseCreds(capturepkg.EmbeddedCredsDir(dataDir))
	} else {
		jetStream = testenv.NewNATS(t)
		natsURL = jetStream.URL
		cenv = bench.CaptureEnv(src, natsURL, "", dataDir, metrics, "main", slot)
	}
	capture := supervise(t, "capture", bins["capture"], joinEnv(cenv, "EPITAPH_HEARTBEAT_INTERVAL=1s"), seed)
	if embedded {
		creds, err := bench.WaitCreds(ctx, projectorCreds, time.Minute)
		require.NoError(t, err)
		credsOpts = append(credsOpts, creds)
	}
	t.Logf("broker: %s", map[bool]string{true: "the capture's embedded JetStream", false: "an external JetStream server"}[embedded])
	watch, err := bench.WatchStream(natsURL, "main", credsOpts...)
	require.NoError(t, err)
	defer watch.Close()
	require.NoError(t, bench.WaitCaptureReady(ctx, watch, src, slot, captureReadyTimeout, nil))

	s := &soak{t: t, ctx: ctx, seed: seed, rng: rand.New(rand.NewPCG(seed, 36)), bins: bins, src: src, natsURL: natsURL,
		creds: projectorCreds, eraseCreds: eraseCreds, credsOpts: credsOpts, jetStream: jetStream, capture: capture, hook: hook, watch: watch, phase: "setup",
		erased: map[rowKey]*erasedRow{}, restored: map[rowKey]int{}, restRows: map[rowKey]workload.Row{}, held: map[int64]bool{},
		kills: map[string][]time.Time{}, counts: map[string]int{}, tried: map[string]bool{}}
	s.targets = []*soakTarget{{name: "target-a", url: testenv.NewDatabase(t)}, {name: "target-b", url: testenv.NewDatabase(t)}}

	secretFile := filepath.Join(t.TempDir(), "hook.secret")
	require.NoError(t, os.WriteFile(secretFile, []byte(handler.NewSecret()+"\n"), 0o600))
	for _, tg := range s.targets {
		out, code := s.projector(tg, time.Minute, "migrate", "up")
		require.Zero(t, code, out)
	}
	out, code := s.projector(s.targets[0], time.Minute, "handlers", "add", "--id", soakHandlerID, "--table", "public.orders",
		"--kind", "webhook", "--target", "http://"+ln.Addr().String()+"/hook", "--backoff", "100ms", "--claim-timeout", "3s",
		"--max-attempts", "60", "--secret-file", secretFile)
	require.Zero(t, code, out)
	out, code = s.projector(s.targets[0], time.Minute, "handlers", "add", "--id", soakCursorID, "--table", "public.orders",
		"--kind", "webhook", "--target", "http://"+ln.Addr().String()+"/hook", "--backoff", "100ms", "--claim-timeout", "3s",
		"--max-attempts", "60", "--secret-file", secretFile, "--batch-size", "10", "--batch-wait", "100ms", "--no-revalidate")
	require.Zero(t, code, out)
	for ti, tg := range s.targets {
		n := 2
		if ti == 1 {
			n = 1
		}
		for i := range n {
			m, err := bench.LocalAddr()
			require.NoError(t, err)
			env := joinEnv(soakEnv(tg.url, src, natsURL, fmt.Sprintf("%s-w%d", tg.name, i)),
				"EPITAPH_METRICS_ADDR="+m, "EPITAPH_LEASE_TTL=3s",
				"EPITAPH_READY_MAX_LAG="+strconv.Itoa(soakReadyMaxLag), "EPITAPH_SNAPSHOT_ROOTS=public.orders", "EPITAPH_ARCHIVE_TTL=*=8760h")
			if projectorCreds != "" {
				env = append(env, "EPITAPH_NATS_CREDS="+projectorCreds)
			}
			tg.workers = append(tg.workers, supervise(t, fmt.Sprintf("%s-w%d", tg.name, i), bins["projector"], env, seed+uint64(10*ti+i)+1, "run"))
		}
	}

	// The readiness sampler and the oracle's history run for the whole soak.
	sampleCtx, stopSampling := context.WithCancel(ctx)
	var samplers sync.WaitGroup
	samplers.Add(2)
	go func() { defer samplers.Done(); s.recordHistory(sampleCtx) }()
	readySamples := map[string]int{}
	var readyMu sync.Mutex
	go func() {
		defer samplers.Done()
		s.sampleReadiness(sampleCtx, func(name string) {
			readyMu.Lock()
			readySamples[name]++
			readyMu.Unlock()
		})
	}()

	// Phases of 20 s, and of a minute or more past 30 phases: each
	// checkpoint reads everything so far (the oracle, both archives, the
	// stream), so a long soak spends its time on phases, not checkpoints.
	phases := max(3, min(int(duration/(20*time.Second)), max(30, int(duration/time.Minute))))
	phaseLen := duration / time.Duration(phases)
	// The rebuild comes early, after the first phases' purges (of rows
	// inside shared transactions too), which it never sees in the stream.
	rebuildAt := 1
	start := time.Now()
	for p := range phases {
		s.setPhase(fmt.Sprintf("%d/%d", p+1, phases))
		s.runPhase(p, phaseLen)
		s.checkpoint(p == rebuildAt)
		s.mu.Lock()
		bad := len(s.problems)
		s.mu.Unlock()
		if bad > 0 {
			break
		}
	}
	s.setPhase("final")
	s.checkpoint(false)
	stopSampling()
	samplers.Wait()
	// A readiness check that judged no sample checked nothing.
	for _, tg := range s.targets {
		if n := readySamples[tg.name+":ready-judged"]; n == 0 {
			s.violation("%s: no readiness sample was judged (samples %v): the readiness check checked nothing", tg.name, readySamples)
		}
	}

	// Every delivery the first target settled as done was accepted by the
	// webhook.
	s.finalDeliveries()

	var deleted int64 // rows deleted at the source, last sampled
	s.mu.Lock()
	if len(s.history) > 0 {
		deleted = s.history[len(s.history)-1].deleted
	}
	s.mu.Unlock()
	readyMu.Lock()
	t.Logf("soak %s over %d phases: deleted rows=%d; actions %v; readiness samples %v; webhook requests=%d (batches %d) failed=%d hung=%d accepted ids=%d (cursor handler %d)",
		time.Since(start).Round(time.Second), phases, deleted, s.counts, readySamples, hook.requests, hook.batches, hook.failed, hook.hung,
		len(hook.ids), len(hook.acceptedBy[soakCursorID]))
	readyMu.Unlock()
	t.Logf("%s", capture.Stats())
	for _, tg := range s.targets {
		for _, w := range tg.workers {
			t.Logf("%s", w.Stats())
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.problems) > 0 {
		shown := s.problems
		if len(shown) > 15 {
			shown = shown[:15]
		}
		t.Fatalf("soak seed %d: %d violations:\n%s\n%s", seed, len(s.problems), strings.Join(shown, "\n"), pipelineState(ctx, s.targets[0].url, watch))
	}
}

func (s *soak) setPhase(p string) {
	s.mu.Lock()
	s.phase = p
	s.mu.Unlock()
	s.t.Logf("soak phase %s at %s", p, time.Now().UTC().Format("15:04:05"))
}

// runPhase runs the deletes and, beside them, a seeded schedule of faults
// and operations, for d.
func (s *soak) runPhase(p int, d time.Duration) {
	ctx, cancel := context.WithTimeout(s.ctx, d)
	defer cancel()
	// Keep orders to delete.
	var live int64
	if err := s.retrySource(func(ctx context.Context) error {
		var err error
		live, err = bench.Count(ctx, s.src, "SELECT count(*) FROM public.orders")
		return err
	}); err == nil && live < 400 {
		_, err := workload.Seed(s.ctx, s.src, workload.SeedConfig{Customers: 60, OrdersPerCustomer: 8})
		if err != nil {
			s.violation("seed more orders: %v", err)
		}
	}
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		plan := workload.Plan{Seed: s.seed + uint64(p)*1000, MaxOrdersPerTx: 40, Reinserts: 1, Pause: 40 * time.Millisecond,
			Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))}
		if p == 1 {
			plan.BigTxRows = 3000
			plan.BigTxAt = 5
		}
		if _, err := workload.Run(ctx, s.src, plan); err != nil {
			s.violation("workload: %v", err)
		}
	}()
	go func() {
		defer wg.Done()
		s.djangoDeletes(ctx, rand.New(rand.NewPCG(s.seed+uint64(p), 99)))
	}()
	// Faults are two actions in five: between them, long enough quiet
	// stretches for the readiness samples to be judged.
	faults := []string{"kill-capture", "kill-a0", "kill-a1", "kill-b0"}
	if s.jetStream != nil {
		faults = append(faults, "restart-jetstream")
	}
	operations := []string{"erase", "erase", "hold", "cleanup", "restore"}
	rng := rand.New(rand.NewPCG(s.seed, uint64(p)))
	for ctx.Err() == nil {
		gap := time.Duration(1000+rng.IntN(3000)) * time.Millisecond
		select {
		case <-ctx.Done():
		case <-time.After(gap):
		}
		if ctx.Err() != nil {
			break
		}
		a := operations[rng.IntN(len(operations))]
		// Every kind of operation early, so a short soak has them all.
		s.mu.Lock()
		for _, o := range operations {
			if !s.tried[o] && len(s.last) > 0 {
				a = o
				break
			}
		}
		if len(s.last) > 0 {
			s.tried[a] = true
		}
		s.mu.Unlock()
		if rng.IntN(5) < 2 {
			a = faults[rng.IntN(len(faults))]
		}
		s.act(a, rng)
	}
	wg.Wait()
}

func (s *soak) act(a string, rng *rand.Rand) {
	now := time.Now()
	switch a {
	case "kill-capture":
		s.capture.Kill()
		s.mu.Lock()
		s.kills["capture"] = append(s.kills["capture"], now)
		s.mu.Unlock()
	case "restart-jetstream":
		// Every client loses the broker at once; readiness samples are
		// judged after it as after a capture kill.
		s.mu.Lock()
		s.kills["capture"] = append(s.kills["capture"], now)
		s.mu.Unlock()
		s.jetStream.Restart()
	case "kill-a0", "kill-a1", "kill-b0":
		tg := s.targets[0]
		if a == "kill-b0" {
			tg = s.targets[1]
		}
		i := int(a[len(a)-1] - '0')
		tg.workers[i].Kill()
		s.mu.Lock()
		s.kills[tg.name] = append(s.kills[tg.name], now)
		s.mu.Unlock()
	case "erase":
		if !s.erase(rng, false) {
			return
		}
	case "hold":
		if !s.erase(rng, true) {
			return
		}
	case "cleanup":
		tg := s.targets[rng.IntN(len(s.targets))]
		if out, code := s.projector(tg, time.Minute, "cleanup", "--json"); code != 0 {
			s.violation("cleanup on %s: exit %d: %s", tg.name, code, out)
		}
	case "restore":
		if !s.restore(rng) {
			return
		}
	}
	s.note(a)
}

// djangoDeletes runs transactions shaped like an ORM's: a savepoint rolled
// back beside one released, a whole transaction rolled back, and a
// collector deleting the children before their parent, statement by
// statement.
func (s *soak) djangoDeletes(ctx context.Context, rng *rand.Rand) {
	conn, err := pgx.Connect(ctx, s.src)
	if err != nil {
		return
	}
	defer conn.Close(context.WithoutCancel(ctx))
	pick := func(tx pgx.Tx) (int64, error) {
		var id int64
		err := tx.QueryRow(ctx, `SELECT id FROM public.orders WHERE id >= (SELECT min(id) + $1 * (max(id) - min(id)) FROM public.orders)
			ORDER BY id LIMIT 1`, rng.Float64()).Scan(&id)
		return id, err
	}
	for ctx.Err() == nil {
		kind := rng.IntN(3)
		err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			a, err := pick(tx)
			if err != nil {
				return err
			}
			switch kind {
			case 0:
				if _, err := tx.Exec(ctx, "SAVEPOINT s1"); err != nil {
					return err
				}
				if _, err := tx.Exec(ctx, "DELETE FROM public.orders WHERE id = $1", a); err != nil {
					return err
				}
				if _, err := tx.Exec(ctx, "ROLLBACK TO SAVEPOINT s1"); err != nil {
					return err
				}
				b, err := pick(tx)
				if err != nil {
					return err
				}
				if _, err := tx.Exec(ctx, "SAVEPOINT s2"); err != nil {
					return err
				}
				if _, err := tx.Exec(ctx, "DELETE FROM public.order_lines WHERE order_id = $1", b); err != nil {
					return err
				}
				if _, err := tx.Exec(ctx, "DELETE FROM public.orders WHERE id = $1", b); err != nil {
					return err
				}
				_, err = tx.Exec(ctx, "RELEASE SAVEPOINT s2")
				return err
			case 1:
				if _, err := tx.Exec(ctx, "DELETE FROM public.orders WHERE id = $1", a); err != nil {
					return err
				}
				return errRollback
			default:
				for _, q := range []string{
					"DELETE FROM public.shipment_items WHERE shipment_id IN (SELECT id FROM public.shipments WHERE order_id = $1)",
					"DELETE FROM public.shipments WHERE order_id = $1",
					"DELETE FROM public.order_lines WHERE order_id = $1",
					"DELETE FROM public.orders WHERE id = $1",
				} {
					if _, err := tx.Exec(ctx, q, a); err != nil {
						return err
					}
				}
				return nil
			}
		})
		if err != nil && !errors.Is(err, errRollback) && ctx.Err() == nil && !errors.Is(err, pgx.ErrNoRows) {
			if conn.IsClosed() {
				if conn, err = pgx.Connect(ctx, s.src); err != nil {
					return
				}
			}
		}
		select {
		case <-ctx.Done():
		case <-time.After(time.Duration(50+rng.IntN(150)) * time.Millisecond):
		}
	}
}

var errRollback = errors.New("rolled back on purpose")

func (s *soak) retrySource(f func(context.Context) error) error {
	return workload.WaitFor(s.ctx, time.Minute, 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		err := f(ctx)
		return err == nil, err
	})
}

// eraseCandidate picks an order of the first target's archive at the last
// checkpoint that may be erased (not erased, not restored, under no hold),
// with shared one whose source transaction holds other rows when there is
// one, and returns it, what erasing it with its children removes, and
// whether that is the whole of its source transaction.
func (s *soak) eraseCandidate(rng *rand.Rand, shared bool) (int64, []archRow, bool, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	restoredLSN := map[string]bool{}
	for _, r := range s.last {
		if s.restored[r.rowKey] > 0 {
			restoredLSN[r.commitLSN] = true
		}
	}
	var orders []int64
	seen := map[int64]bool{}
	for _, r := range s.last {
		if r.table == "public.orders" && !seen[r.id] && !s.held[r.id] {
			seen[r.id] = true
			orders = append(orders, r.id)
		}
	}
	sort.Slice(orders, func(i, j int) bool { return orders[i] < orders[j] })
	rng.Shuffle(len(orders), func(i, j int) { orders[i], orders[j] = orders[j], orders[i] })
	type candidate struct {
		order int64
		set   []archRow
	}
	var fallback *candidate // a whole transaction, when shared finds none
	for _, o := range orders {
		set := erasedSet(s.last, o)
		ok := true
		inSet := map[rowKey]bool{}
		lsns := map[string]bool{}
		for _, r := range set {
			if s.erased[r.rowKey] != nil || restoredLSN[r.commitLSN] {
				ok = false
				break
			}
			inSet[r.rowKey] = true
			lsns[r.commitLSN] = true
		}
		if !ok {
			continue
		}
		// The whole transaction erased?
		whole := true
		for _, r := range s.last {
			if lsns[r.commitLSN] && !inSet[r.rowKey] {
				whole = false
				break
			}
		}
		if whole && shared {
			if fallback == nil {
				fallback = &candidate{o, set}
			}
			continue
		}
		return o, set, whole, true
	}
	if fallback != nil {
		return fallback.order, fallback.set, true, true
	}
	return 0, nil, false, false
}

// erasedSet is what `erase --table public.orders --key {"id":o}
// --with-children` removes: every archived version of the order and, in
// each one's transaction, the rows referencing it by foreign key,
// transitively.
func erasedSet(rows []archRow, o int64) []archRow {
	var out []archRow
	for _, r := range rows {
		if r.table != "public.orders" || r.id != o {
			continue
		}
		out = append(out, r)
		lines, ships := map[int64]bool{}, map[int64]bool{}
		for _, c := range rows {
			if c.commitLSN != r.commitLSN {
				continue
			}
			switch c.table {
			case "public.order_lines":
				if c.ref("order_id") == o {
					lines[c.id] = true
					out = append(out, c)
				}
			case "public.shipments":
				if c.ref("order_id") == o {
					ships[c.id] = true
					out = append(out, c)
				}
			}
		}
		for _, c := range rows {
			if c.commitLSN == r.commitLSN && c.table == "public.shipment_items" && (lines[c.ref("order_line_id")] || ships[c.ref("shipment_id")]) {
				out = append(out, c)
			}
		}
	}
	return out
}

// erase erases an archived order with its children on every target, most
// often purged from the stream too, whether its source transaction holds
// other rows or not; the first purge is of an order inside a transaction
// that holds others when there is one (before the rebuild: erasures start
// in the phase that ends with it). With hold, a legal hold on the order
// first makes the erasure refused (exit 3) and is removed again, the order
// kept.
func (s *soak) erase(rng *rand.Rand, hold bool) bool {
	s.mu.Lock()
	first := !hold && s.counts["erase-purged"] == 0
	s.mu.Unlock()
	o, set, whole, ok := s.eraseCandidate(rng, first)
	if !ok {
		return false
	}
	key := fmt.Sprintf(`{"id": %d}`, o)
	a := s.targets[0]
	if hold {
		out, code := s.projector(a, time.Minute, "hold", "add", "--table", "public.orders", "--key", key, "--reason", "soak", "--json")
		if code != 0 {
			s.violation("hold add order %d: exit %d: %s", o, code, out)
			return false
		}
		var h struct {
			ID any `json:"id"`
		}
		if i := strings.Index(out, "{"); i < 0 || json.Unmarshal([]byte(out[i:]), &h) != nil || h.ID == nil {
			s.violation("hold add order %d: no id in %s", o, out)
			return false
		}
		holdID := fmt.Sprint(h.ID)
		out, code = s.projector(a, time.Minute, "erase", "--table", "public.orders", "--key", key, "--with-children", "--yes")
		if code != 3 {
			s.violation("erase of held order %d: exit %d, want 3 (refused): %s", o, code, out)
		}
		out, code = s.projector(a, time.Minute, "hold", "remove", holdID)
		if code != 0 {
			s.violation("hold remove %s: exit %d: %s", holdID, code, out)
		}
		return true
	}
	// Two in three purge the stream's messages; the others only fence.
	purge := first || rng.IntN(3) > 0
	var at time.Time // when the first target, the webhook's, finished erasing
	for i, tg := range s.targets {
		args := []string{"erase", "--table", "public.orders", "--key", key, "--with-children", "--reason", "soak", "--yes"}
		creds := s.creds
		if purge && i == 0 {
			// The erase role (the embedded broker's; an external server
			// here has no users).
			args = append(args, "--purge-stream")
			creds = s.eraseCreds
		}
		// Counted before the erase runs: its rows leave this target's
		// archive at its commit, before the command returns, and a
		// readiness sample in between must not take them for lost.
		s.mu.Lock()
		tg.erasedRows += len(set)
		s.mu.Unlock()
		out, code := s.projectorAs(creds, tg, 2*time.Minute, args...)
		if code != 0 {
			s.violation("erase order %d on %s (purge=%v): exit %d: %s", o, tg.name, purge && i == 0, code, out)
			return false
		}
		if i == 0 {
			at = time.Now()
		}
	}
	s.mu.Lock()
	for _, r := range set {
		s.erased[r.rowKey] = &erasedRow{rowKey: r.rowKey, commitLSN: r.commitLSN, seq: r.seq, correlation: r.correlation,
			customerID: r.ref("customer_id"), at: at, purged: purge}
	}
	if purge {
		s.purgedAt = at
		s.counts["erase-purged"]++
		if !whole {
			if s.counts["erase-purged-shared-tx"] == 0 {
				s.t.Logf("order %d erased with --purge-stream inside a transaction that holds other rows (%d rows erased)", o, len(set))
			}
			s.counts["erase-purged-shared-tx"]++
		}
	}
	s.counts["erased-rows"] += len(set)
	s.mu.Unlock()
	return true
}

// restore puts back one archived transaction of orders (with their
// children) whose rows are all gone from the source, none erased, after a
// dry run.
func (s *soak) restore(rng *rand.Rand) bool {
	s.mu.Lock()
	byCorr := map[string][]archRow{}
	var corrs []string
	for _, r := range s.last {
		if byCorr[r.correlation] == nil {
			corrs = append(corrs, r.correlation)
		}
		byCorr[r.correlation] = append(byCorr[r.correlation], r)
	}
	erasedLSN := map[string]bool{}
	for _, e := range s.erased {
		erasedLSN[e.commitLSN] = true
	}
	s.mu.Unlock()
	sort.Strings(corrs)
	rng.Shuffle(len(corrs), func(i, j int) { corrs[i], corrs[j] = corrs[j], corrs[i] })
	conn, err := pgx.Connect(s.ctx, s.src)
	if err != nil {
		return false
	}
	defer conn.Close(context.WithoutCancel(s.ctx))
	for _, c := range corrs {
		rows := byCorr[c]
		if len(rows) > 60 || erasedLSN[rows[0].commitLSN] {
			continue
		}
		hasOrder, ok := false, true
		s.mu.Lock()
		for _, r := range rows {
			if r.table == "public.customers" || s.restored[r.rowKey] > 0 {
				ok = false
			}
			hasOrder = hasOrder || r.table == "public.orders"
		}
		s.mu.Unlock()
		if !ok || !hasOrder {
			continue
		}
		// Every row absent from the source, every parent outside the
		// transaction present.
		for _, r := range rows {
			var n int64
			q := "SELECT count(*) FROM " + pgx.Identifier(strings.Split(r.table, ".")).Sanitize() + " WHERE id = $1"
			if conn.QueryRow(s.ctx, q, r.id).Scan(&n) != nil || n > 0 {
				ok = false
				break
			}
			if r.table == "public.orders" {
				if conn.QueryRow(s.ctx, "SELECT count(*) FROM public.customers WHERE id = $1", r.ref("customer_id")).Scan(&n) != nil || n == 0 {
					ok = false
					break
				}
			}
		}
		if !ok {
			continue
		}
		a := s.targets[0]
		out, code := s.projector(a, time.Minute, "restore", "--correlation", c, "--dry-run")
		if code != 0 {
			s.violation("restore --dry-run %s: exit %d: %s", c, code, out)
			return false
		}
		out, code = s.projector(a, 2*time.Minute, "restore", "--correlation", c)
		if code != 0 {
			// A concurrent delete of the customer makes it fail as a
			// whole (a foreign key), and so does the soak's end (killed):
			// nothing was written. Any other failure, or a row of it in
			// the source, is the restore's fault.
			s.t.Logf("restore %s: exit %d (nothing restored): %s", c, code, out)
			s.checkFailedRestore(conn, c, code, out, rows)
			return false
		}
		s.mu.Lock()
		for _, r := range rows {
			s.restored[r.rowKey]++
			s.restRows[r.rowKey] = workload.Row{Table: r.table, ID: r.id, Gen: r.gen, Row: json.RawMessage(r.raw)}
		}
		s.counts["restored-rows"] += len(rows)
		s.mu.Unlock()
		return true
	}
	return false
}

// checkFailedRestore judges a restore of correlation c that exited code
// with out: only a concurrent delete of its customer (a foreign key) or
// the soak's end (killed) may fail it, and a failed restore wrote none of
// its rows.
func (s *soak) checkFailedRestore(conn *pgx.Conn, c string, code int, out string, rows []archRow) {
	if code != -1 && (code != 1 || !strings.Contains(out, "foreign key")) {
		s.violation("restore %s failed for another reason than a concurrent delete of its customer: exit %d: %s", c, code, out)
	}
	for _, r := range rows {
		var n int64
		q := "SELECT count(*) FROM " + pgx.Identifier(strings.Split(r.table, ".")).Sanitize() + " WHERE id = $1"
		if err := conn.QueryRow(context.WithoutCancel(s.ctx), q, r.id).Scan(&n); err == nil && n > 0 {
			s.violation("restore %s failed (exit %d) yet %s %d is in the source: a restore is all or nothing", c, code, r.table, r.id)
		}
	}
}

// recordHistory samples how many ledger rows are deleted, every half
// second: the readiness check's view of what was committed when.
func (s *soak) recordHistory(ctx context.Context) {
	for ctx.Err() == nil {
		n, err := bench.Count(ctx, s.src, `SELECT (SELECT count(*) FROM workload.ledger) - (
			(SELECT count(*) FROM public.customers) + (SELECT count(*) FROM public.orders) +
			(SELECT count(*) FROM public.order_lines) + (SELECT count(*) FROM public.shipments) +
			(SELECT count(*) FROM public.shipment_items))`)
		if err == nil {
			s.mu.Lock()
			s.history = append(s.history, histPoint{at: time.Now(), deleted: n})
			s.mu.Unlock()
		}
		select {
		case <-ctx.Done():
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// sampleReadiness reads archive.status of each target's live version and,
// when it says ready, counts the archive: a ready archive holding fewer
// rows than were deleted readyGrace before (less what was erased there) is
// a violation, and so is a ready status whose lag is above
// soakReadyMaxLag. The oracle's figure is taken before status is read.
func (s *soak) sampleReadiness(ctx context.Context, counted func(string)) {
	conns := map[string]*pgx.Conn{}
	contradicted := map[string]bool{}
	defer func() {
		for _, c := range conns {
			c.Close(context.WithoutCancel(ctx))
		}
	}()
	for ctx.Err() == nil {
		for _, tg := range s.targets {
			now := time.Now()
			s.mu.Lock()
			var want int64 = -1
			for i := len(s.history) - 1; i >= 0; i-- {
				if s.history[i].at.Before(now.Add(-readyGrace)) {
					want = s.history[i].deleted
					break
				}
			}
			judged := want >= 0 && !recent(s.kills["capture"], now, readyGrace+10*time.Second)
			phase := s.phase
			s.mu.Unlock()
			conn := conns[tg.name]
			if conn == nil || conn.IsClosed() {
				c, err := pgx.Connect(ctx, tg.url)
				if err != nil {
					continue
				}
				conns[tg.name], conn = c, c
			}
			var ready bool
			var version int
			var lag *int64
			var reasons []string
			if err := conn.QueryRow(ctx, `SELECT ready, version, lag_events, not_ready_reasons FROM archive.status WHERE state = 'live'`).Scan(&ready, &version, &lag, &reasons); err != nil {
				counted(tg.name + ":error")
				continue
			}
			if !ready {
				counted(tg.name + ":not-ready")
				if len(reasons) > 0 {
					counted(tg.name + ":not-ready:" + strings.Map(func(r rune) rune {
						if r >= '0' && r <= '9' {
							return 'N'
						}
						return r
					}, reasons[0]))
				}
				continue
			}
			// Ready says the lag is within --ready-max-lag: a ready status
			// whose own lag is above it contradicts itself, whatever the
			// archive holds (the rows check below needs a lag of readyGrace).
			if (lag == nil || *lag > soakReadyMaxLag) && !contradicted[tg.name+" "+phase] {
				contradicted[tg.name+" "+phase] = true // once per target and phase
				s.violation("%s (during %s): archive.status v%d ready with lag %v events, above --ready-max-lag %d",
					tg.name, phase, version, deref(lag), soakReadyMaxLag)
			}
			var have int64
			if err := conn.QueryRow(ctx, `SELECT count(*) FROM archive.rows WHERE source = 'main'`).Scan(&have); err != nil {
				continue
			}
			s.mu.Lock()
			erased := int64(tg.erasedRows)
			s.mu.Unlock()
			if !judged {
				counted(tg.name + ":ready-unjudged")
				continue
			}
			counted(tg.name + ":ready-judged")
			if have+erased < want {
				s.violation("%s (during %s): archive.status v%d ready (lag %v) while the archive holds %d rows (+%d erased) of %d deleted %s before",
					tg.name, phase, version, deref(lag), have, erased, want, readyGrace)
			}
		}
		select {
		case <-ctx.Done():
		case <-time.After(300 * time.Millisecond):
		}
	}
}

func deref(p *int64) any {
	if p == nil {
		return "null"
	}
	return *p
}

func recent(times []time.Time, now time.Time, d time.Duration) bool {
	for _, t := range times {
		if now.Sub(t) < d {
			return true
		}
	}
	return false
}

// checkpoint waits until every target is complete up to the source's
// current LSN, checks the invariants on each, and with rebuild also
// rebuilds the first target's archive, compares, promotes, checks, rolls
// back and checks again.
func (s *soak) checkpoint(rebuild bool) {
	var lsn string
	if err := s.retrySource(func(ctx context.Context) error {
		c, err := pgx.Connect(ctx, s.src)
		if err != nil {
			return err
		}
		defer c.Close(ctx)
		return c.QueryRow(ctx, "SELECT pg_current_wal_insert_lsn()::text").Scan(&lsn)
	}); err != nil {
		s.violation("read the source's LSN: %v", err)
		return
	}
	for _, tg := range s.targets {
		out, code := s.projector(tg, 5*time.Minute, "wait", "--lsn", lsn, "--timeout", "4m")
		if code != 0 {
			s.violation("%s: wait --lsn %s: exit %d: %s\n%s", tg.name, lsn, code, out, pipelineState(s.ctx, tg.url, s.watch))
			return
		}
	}
	s.checkAll()
	if !rebuild {
		return
	}
	a := s.targets[0]
	steps := [][]string{{"rebuild", "archive", "--wait"}, {"compare", "archive", "1", "2"}, {"promote", "archive", "2"}}
	for _, st := range steps {
		out, code := s.projector(a, 6*time.Minute, st...)
		s.t.Logf("projector %s: exit %d\n%s", strings.Join(st, " "), code, lastLines(out, 12))
		if code != 0 {
			s.violation("projector %s on %s: exit %d: %s\n%s", strings.Join(st, " "), a.name, code, lastLines(out, 20), versionsState(s.ctx, a.url))
			return
		}
	}
	s.note("rebuild-promote")
	s.checkAll()
	out, code := s.projector(a, 2*time.Minute, "rollback", "archive")
	s.t.Logf("projector rollback archive: exit %d\n%s", code, lastLines(out, 6))
	if code != 0 {
		s.violation("rollback on %s: exit %d: %s", a.name, code, out)
		return
	}
	s.note("rollback")
	s.checkAll()
}

// versionsState says why versions are not ready: their status, the first
// pending snapshot documents and open quarantine entries.
func versionsState(ctx context.Context, url string) string {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err.Error()
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var b strings.Builder
	queries := []string{
		`SELECT format('v%s %s ready=%s lag=%s reasons=%s', version, state, ready, lag_events, not_ready_reasons) FROM archive.status ORDER BY version`,
		`SELECT format('quarantine v%s %s: %s', version, category, left(error, 150)) FROM epitaph.quarantine WHERE status = 'open' LIMIT 5`,
	}
	rows, err := conn.Query(ctx, `SELECT nspname FROM pg_namespace n WHERE nspname ~ '^archive_v[0-9]+$'
		AND EXISTS (SELECT 1 FROM pg_class c WHERE c.relnamespace = n.oid AND c.relname = 'snapshots') ORDER BY 1`)
	if err == nil {
		schemas, _ := pgx.CollectRows(rows, pgx.RowTo[string])
		for _, sc := range schemas {
			queries = append(queries, `SELECT format('`+sc+` snapshot pending since %s: %s %s: %s', pending_since, correlation_id, root_key, left(failure_reason, 200))
				FROM `+pgx.Identifier{sc, "snapshots"}.Sanitize()+` WHERE status = 'pending' ORDER BY pending_since LIMIT 3`)
		}
	}
	for _, q := range queries {
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

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

func (s *soak) checkAll() {
	expected, err := workload.Expected(s.ctx, s.src)
	if err != nil {
		s.violation("read the oracle: %v", err)
		return
	}
	for i, tg := range s.targets {
		rows := s.checkTarget(tg, expected)
		if i == 0 && rows != nil {
			s.mu.Lock()
			s.last = rows
			s.mu.Unlock()
		}
	}
	s.checkStream()
	s.checkDeliveries()
}

// readArchive reads the live archive of a target with each row's position.
func readArchive(ctx context.Context, url string) ([]archRow, error) {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return nil, err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	rows, err := conn.Query(ctx, `SELECT schema_name || '.' || table_name, coalesce((row->>'id')::bigint, -1),
		coalesce((row->>'gen')::int, -1), commit_lsn::text, seq, correlation_id, coalesce(row::text, 'null')
		FROM archive.rows WHERE source = 'main'`)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []archRow
	for rows.Next() {
		var r archRow
		var text string
		if err := rows.Scan(&r.table, &r.id, &r.gen, &r.commitLSN, &r.seq, &r.correlation, &text); err != nil {
			return nil, err
		}
		r.raw = text
		dec := json.NewDecoder(strings.NewReader(text))
		dec.UseNumber()
		if err := dec.Decode(&r.row); err != nil {
			r.row = nil
		}
		out = append(out, r)
	}
	return out, rows.Err()
}

// checkTarget checks invariants 1 and 2 on one target, row by row, and the
// erased rows' absence from every version, snapshot, quarantine entry and
// delivery payload; it returns the archive it read.
func (s *soak) checkTarget(tg *soakTarget, expected []workload.Row) []archRow {
	got, err := readArchive(s.ctx, tg.url)
	if err != nil {
		s.violation("%s: read archive: %v", tg.name, err)
		return nil
	}
	s.mu.Lock()
	want := map[rowKey]int{}
	values := map[rowKey]workload.Row{}
	for _, r := range expected {
		k := rowKey{r.Table, r.ID, r.Gen}
		want[k]++
		values[k] = r
	}
	for k, n := range s.restored {
		want[k] += n
		if _, ok := values[k]; !ok {
			values[k] = s.restRows[k]
		}
	}
	erased := map[rowKey]*erasedRow{}
	for k, e := range s.erased {
		erased[k] = e
	}
	s.mu.Unlock()
	have := map[rowKey]int{}
	first := map[rowKey]archRow{}
	at := map[rowKey][]string{}
	for _, r := range got {
		have[r.rowKey]++
		at[r.rowKey] = append(at[r.rowKey], r.correlation+"#"+strconv.Itoa(r.seq))
		if _, ok := first[r.rowKey]; !ok {
			first[r.rowKey] = r
		}
	}
	var missing, dup, forged, present []string
	for k, n := range want {
		if erased[k] != nil {
			continue
		}
		switch {
		case have[k] < n:
			missing = append(missing, fmt.Sprintf("%s (archived %d of %d)", k, have[k], n))
		case have[k] > n:
			dup = append(dup, fmt.Sprintf("%s (archived %d times, deleted %d: %s)", k, have[k], n, strings.Join(at[k], ", ")))
		}
	}
	for k, n := range have {
		if erased[k] != nil {
			present = append(present, fmt.Sprintf("%s x%d (erased at %s)", k, n, erased[k].at.UTC().Format("15:04:05.000")))
		} else if want[k] == 0 {
			forged = append(forged, fmt.Sprintf("%s at %s/%d", k, first[k].commitLSN, first[k].seq))
		}
	}
	for _, l := range []struct {
		what string
		xs   []string
	}{{"deleted, not archived", missing}, {"archived more than deleted", dup}, {"forged (never deleted)", forged}, {"erased, still archived", present}} {
		if len(l.xs) > 0 {
			sort.Strings(l.xs)
			s.violation("%s: %d rows %s: %s", tg.name, len(l.xs), l.what, strings.Join(l.xs[:min(5, len(l.xs))], "; "))
		}
	}
	// Values, compared as the table's row type in the source.
	var exp, gotRows []workload.Row
	for k, r := range first {
		if v, ok := values[k]; ok && erased[k] == nil {
			exp = append(exp, v)
			gotRows = append(gotRows, workload.Row{Table: k.table, ID: k.id, Gen: k.gen, Row: json.RawMessage(r.raw), Origin: r.commitLSN})
		}
	}
	rep, err := workload.Compare(s.ctx, s.src, exp, gotRows)
	if err != nil {
		s.violation("%s: compare values: %v", tg.name, err)
	} else if rep.DifferentCount > 0 {
		s.violation("%s: %d archived rows differ from what was deleted: %s", tg.name, rep.DifferentCount, strings.Join(rep.Different[:min(5, len(rep.Different))], "; "))
	}
	if len(erased) > 0 {
		s.checkErasedGone(tg, erased)
	}
	return got
}

// snapshotQuery finds the erased orders (soak_erased) in the snapshot
// documents of the table %s.
const snapshotQuery = `WITH o AS (
	SELECT DISTINCT x->'id' AS id, x->'customer_id' AS c
	  FROM %s s, jsonb_path_query(to_jsonb(s), 'strict $.** ? (exists(@.id) && exists(@.customer_id))') AS x)
	SELECT e.t || ' id=' || e.id || ' gen=' || e.gen FROM soak_erased e JOIN o ON o.id = to_jsonb(e.id) AND o.c = to_jsonb(e.cust)
	WHERE e.t = 'public.orders'`

// checkErasedGone looks for erased rows in every archive version, the
// snapshots (the live ones and every version's), the quarantine and the
// delivery payloads of a target.
func (s *soak) checkErasedGone(tg *soakTarget, erased map[rowKey]*erasedRow) {
	conn, err := pgx.Connect(s.ctx, tg.url)
	if err != nil {
		s.violation("%s: connect: %v", tg.name, err)
		return
	}
	defer conn.Close(context.WithoutCancel(s.ctx))
	type er struct {
		Table   string `json:"t"`
		ID      int64  `json:"id"`
		Gen     int    `json:"gen"`
		LSN     string `json:"lsn"`
		Seq     int    `json:"seq"`
		OrderOf int64  `json:"cust"`
	}
	var list []er
	for _, e := range erased {
		list = append(list, er{e.table, e.id, e.gen, e.commitLSN, e.seq, e.customerID})
	}
	js, _ := json.Marshal(list)
	if _, err := conn.Exec(s.ctx, `CREATE TEMP TABLE soak_erased AS SELECT * FROM jsonb_to_recordset($1::jsonb)
		AS x(t text, id bigint, gen int, lsn pg_lsn, seq int, cust bigint)`, string(js)); err != nil {
		s.violation("%s: load erased rows: %v", tg.name, err)
		return
	}
	var schemas []string
	rows, err := conn.Query(s.ctx, `SELECT nspname FROM pg_namespace WHERE nspname ~ '^archive_v[0-9]+$' ORDER BY 1`)
	if err == nil {
		schemas, err = pgx.CollectRows(rows, pgx.RowTo[string])
	}
	if err != nil {
		s.violation("%s: list versions: %v", tg.name, err)
		return
	}
	queries := map[string]string{
		"quarantine entry": `SELECT e.t || ' id=' || e.id || ' gen=' || e.gen FROM soak_erased e JOIN epitaph.quarantine q
			ON convert_from(q.data, 'UTF8') LIKE '%' || split_part(e.t, '.', 2) || '%' AND convert_from(q.data, 'UTF8') ~ ('"id": ?' || e.id || '[,}]')`,
		"delivery payload": `SELECT e.t || ' id=' || e.id || ' gen=' || e.gen || ' delivery ' || d.id FROM soak_erased e JOIN epitaph.deliveries d
			ON d.commit_lsn = e.lsn AND d.seq = e.seq WHERE d.payload IS NOT NULL`,
		// A cursor handler's batch in flight over the erasure settles
		// after it: its delivery row must not bring the key back.
		"delivery key": `SELECT e.t || ' id=' || e.id || ' gen=' || e.gen || ' delivery ' || d.id FROM soak_erased e JOIN epitaph.deliveries d
			ON d.commit_lsn = e.lsn AND d.seq = e.seq WHERE d.key IS NOT NULL`,
		// Every object of every document that has an id and a
		// customer_id, read once (joined by hash, not evaluated per
		// erased row and document).
		"snapshot": fmt.Sprintf(snapshotQuery, "archive.snapshots"),
	}
	for _, sc := range schemas {
		// Every version's documents: an erasure deletes them in each.
		var snapshots bool
		if err := conn.QueryRow(s.ctx, `SELECT to_regclass($1) IS NOT NULL`, pgx.Identifier{sc, "snapshots"}.Sanitize()).Scan(&snapshots); err != nil {
			s.violation("%s: look up %s.snapshots: %v", tg.name, sc, err)
			return
		}
		if snapshots {
			queries["snapshot of "+sc] = fmt.Sprintf(snapshotQuery, pgx.Identifier{sc, "snapshots"}.Sanitize())
		}
		// By position, or by table, id and generation: two joins (one
		// with an OR would compare every erased row with every row).
		r := pgx.Identifier{sc, "rows"}.Sanitize()
		queries["row of "+sc] = `SELECT e.t || ' id=' || e.id || ' gen=' || e.gen || ' at ' || r.commit_lsn || '/' || r.seq FROM soak_erased e JOIN ` +
			r + ` r ON r.commit_lsn = e.lsn AND r.seq = e.seq AND r.row IS NOT NULL
			UNION ALL
			SELECT e.t || ' id=' || e.id || ' gen=' || e.gen || ' at ' || r.commit_lsn || '/' || r.seq FROM soak_erased e JOIN ` +
			r + ` r ON r.schema_name || '.' || r.table_name = e.t AND (r.row->>'id')::bigint = e.id AND (r.row->>'gen')::int = e.gen`
	}
	names := make([]string, 0, len(queries))
	for n := range queries {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		rows, err := conn.Query(s.ctx, queries[n]+" LIMIT 5")
		if err != nil {
			if strings.Contains(err.Error(), "does not exist") && n == "snapshot" {
				continue
			}
			s.violation("%s: look for erased rows in %s: %v", tg.name, n, err)
			continue
		}
		found, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			s.violation("%s: look for erased rows in %s: %v", tg.name, n, err)
			continue
		}
		if len(found) > 0 {
			s.violation("%s: erased rows still in a %s: %s", tg.name, n, strings.Join(found, "; "))
		}
	}
}

// checkStream: no purged row is left in the stream.
func (s *soak) checkStream() {
	s.mu.Lock()
	purged := map[rowKey]bool{}
	for k, e := range s.erased {
		if e.purged {
			purged[k] = true
		}
	}
	s.mu.Unlock()
	if len(purged) == 0 {
		return
	}
	events, err := workload.StreamDeletes(s.ctx, s.natsURL, "main", s.credsOpts...)
	if err != nil {
		s.violation("read the stream: %v", err)
		return
	}
	got, err := workload.EventRows(events)
	if err != nil {
		s.violation("read the stream: %v", err)
		return
	}
	var left []string
	for _, r := range got {
		if purged[rowKey{r.Table, r.ID, r.Gen}] {
			left = append(left, r.String()+" ("+r.Origin+")")
		}
	}
	if len(left) > 0 {
		s.violation("%d purged rows still in the stream: %s", len(left), strings.Join(left[:min(5, len(left))], "; "))
	}
}

// checkDeliveries: the webhook accepted each (handler, row) under one
// delivery id at most, and nothing for an erased row after its erasure.
func (s *soak) checkDeliveries() {
	s.mu.Lock()
	erasedAt := map[string]time.Time{}
	erasedIDs := map[string]bool{}
	for _, e := range s.erased {
		if e.table == "public.orders" {
			erasedIDs[handler.DeliveryID(soakCursorID, "main", e.commitLSN, e.seq, 0)] = true
			for _, h := range soakHandlers {
				erasedAt[fmt.Sprintf("%s public.orders {\"id\":%d} %s", h, e.id, e.correlation)] = e.at
			}
		}
	}
	s.mu.Unlock()
	s.hook.mu.Lock()
	defer s.hook.mu.Unlock()
	var twice, late []string
	for k, ids := range s.hook.accepted {
		var inTime []string
		for id, ok := range ids {
			if ok {
				inTime = append(inTime, id)
			}
		}
		if len(inTime) > 1 {
			sort.Strings(inTime)
			twice = append(twice, fmt.Sprintf("%s (delivery ids %s)", k, strings.Join(inTime, ", ")))
		}
		if at, ok := erasedAt[k]; ok {
			for _, a := range s.hook.acceptAt[k] {
				if a.After(at) {
					late = append(late, fmt.Sprintf("%s accepted %s after its erasure", k, a.Sub(at).Round(time.Millisecond)))
				}
			}
		}
	}
	// A batch is resent whole under its webhook-id: a delivery in two
	// batches is sent twice to a receiver that deduplicates by webhook-id,
	// unless the batches differ only by erased rows (an erasure takes its
	// rows out of a batch being retried).
	var regrouped []string
	for id, wids := range s.hook.batchesOf {
		if len(wids) < 2 {
			continue
		}
		count := map[string]int{}
		for wid := range wids {
			for _, m := range s.hook.members[wid] {
				count[m]++
			}
		}
		for m, n := range count {
			if n < len(wids) && !erasedIDs[m] {
				regrouped = append(regrouped, fmt.Sprintf("delivery %s in %d batches that differ by %s", id, len(wids), m))
				break
			}
		}
	}
	sort.Strings(regrouped)
	if len(regrouped) > 0 {
		s.violation("%d deliveries sent in several batches: %s", len(regrouped), strings.Join(regrouped[:min(5, len(regrouped))], "; "))
	}
	sort.Strings(twice)
	sort.Strings(late)
	if len(twice) > 0 {
		s.violation("%d rows delivered under several delivery ids: %s", len(twice), strings.Join(twice[:min(5, len(twice))], "; "))
	}
	if len(late) > 0 {
		s.violation("%d deliveries of erased rows after the erasure: %s", len(late), strings.Join(late[:min(5, len(late))], "; "))
	}
}

// finalDeliveries waits for the first target's handlers to catch up (no
// queued delivery open; the cursor handler's cursor past every archived
// order, no batch claimed) and checks, for each handler, that each done
// delivery was accepted by the webhook, each live archived order has one
// delivery, settled once, and, for the cursor handler, that every delivery
// the webhook accepted is recorded done (unless its row was erased since).
func (s *soak) finalDeliveries() {
	if !s.drainDeliveries() {
		return
	}
	s.settledDeliveries()
}

// drainDeliveries waits for the first target's handlers to catch up, and
// reports whether they did.
func (s *soak) drainDeliveries() bool {
	a := s.targets[0]
	// The storm is over: the webhook accepts every request from now on, so
	// each open delivery settles at its next attempt. A delivery that
	// failed a dozen times in a row waits minutes for that attempt (the
	// backoff doubles): past the first minutes the drain waits only while
	// every open delivery's next attempt (or claim expiry) is ahead or
	// just passed, never for one overdue.
	s.hook.calm.Store(true)
	const budget, limit, late = 4 * time.Minute, 12 * time.Minute, 30 * time.Second
	start := time.Now()
	var open, behind, overdue int64
	var err error
	for {
		if open, err = bench.Count(s.ctx, a.url, `SELECT (SELECT count(*) FROM epitaph.deliveries WHERE state IN ('pending', 'in_flight'))
			+ (SELECT count(*) FROM epitaph.handler_cursors WHERE claimed_to_lsn IS NOT NULL)`); err == nil {
			behind, err = bench.Count(s.ctx, a.url, `SELECT count(*) FROM archive.rows r, epitaph.handler_cursors c
			WHERE c.handler_id = $1 AND r.source = 'main' AND r.schema_name = 'public' AND r.table_name = 'orders'
			AND (r.commit_lsn, r.seq) > (c.commit_lsn, c.seq)`, soakCursorID)
		}
		if err == nil && open == 0 && behind == 0 {
			return true
		}
		if err == nil && time.Since(start) > budget {
			// Open work whose time has come more than late ago: a
			// delivery or a claimed batch due (its backoff over, its claim
			// expired), or a cursor behind the archive and free to claim.
			overdue, err = bench.Count(s.ctx, a.url, `SELECT (SELECT count(*) FROM epitaph.deliveries
				WHERE state IN ('pending', 'in_flight') AND greatest(next_attempt_at, claim_expires_at) < now() - $1::interval)
				+ (SELECT count(*) FROM epitaph.handler_cursors
				WHERE (claimed_to_lsn IS NOT NULL OR (handler_id = $3 AND $2::bigint > 0))
				AND greatest(next_attempt_at, claim_expires_at) < now() - $1::interval)`,
				late.String(), behind, soakCursorID)
		}
		switch {
		case err != nil && s.ctx.Err() != nil:
			s.violation("deliveries: %v", err)
			return false
		case err == nil && overdue > 0, time.Since(start) > limit:
			s.violation("deliveries still open after %s: %d open deliveries or claimed batches, %d orders after the cursor, %d overdue by %s (err %v): %s",
				time.Since(start).Round(time.Second), open, behind, overdue, late, err, openWork(s.ctx, a.url))
			return false
		}
		select {
		case <-s.ctx.Done():
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// openWork describes a target's open deliveries and cursors, for a
// violation.
func openWork(ctx context.Context, url string) string {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err.Error()
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var out string
	err = conn.QueryRow(ctx, `SELECT concat_ws('; ',
		(SELECT string_agg(format('delivery %s of %s: %s, attempt %s, next in %s, claim ends in %s, error %s', id, handler_id, state, attempt,
			next_attempt_at - now(), claim_expires_at - now(), left(last_error, 80)), '; ')
			FROM (SELECT * FROM epitaph.deliveries WHERE state IN ('pending', 'in_flight') ORDER BY next_attempt_at LIMIT 10) d),
		(SELECT string_agg(format('cursor %s at %s/%s, claimed to %s/%s, attempt %s, next in %s, claim ends in %s', handler_id,
			commit_lsn, seq, claimed_to_lsn, claimed_to_seq, attempt, next_attempt_at - now(), claim_expires_at - now()), '; ')
			FROM epitaph.handler_cursors))`).Scan(&out)
	if err != nil {
		return err.Error()
	}
	return out
}

// settledDeliveries checks, for each handler, that each done delivery was
// accepted by the webhook, each live archived order has one delivery,
// settled once, and, for the cursor handler, that every delivery the
// webhook accepted is recorded done (unless its row was erased since).
func (s *soak) settledDeliveries() {
	a := s.targets[0]
	conn, err := pgx.Connect(s.ctx, a.url)
	if err != nil {
		s.violation("connect: %v", err)
		return
	}
	defer conn.Close(context.WithoutCancel(s.ctx))
	s.mu.Lock()
	erasedIDs := map[string]bool{}
	for _, e := range s.erased {
		if e.table == "public.orders" {
			erasedIDs[handler.DeliveryID(soakCursorID, "main", e.commitLSN, e.seq, 0)] = true
		}
	}
	s.mu.Unlock()
	for _, h := range soakHandlers {
		s.checkHandlerDeliveries(conn, h, erasedIDs)
	}
}

// stoppedAsExpected reports whether a stopped delivery of handler h may
// be stopped: any of a queued handler's; of the cursor handler, the
// pending delivery of an erased row (stop_revoked, never sent) or of a
// restored one (stop_superseded, as a queued one).
func stoppedAsExpected(h, id, outcome string, erasedIDs map[string]bool) bool {
	return h != soakCursorID || (outcome == "stop_revoked" && erasedIDs[id]) || outcome == "stop_superseded"
}

// checkHandlerDeliveries checks one handler of the first target at the
// end: each done delivery accepted by the webhook, each live archived
// order with a delivery and none done twice, and, for the cursor handler,
// each delivery the webhook accepted recorded done (unless its row was
// erased: erasedIDs) and each stopped one stopped by an erasure of its
// row or a restore.
func (s *soak) checkHandlerDeliveries(conn *pgx.Conn, h string, erasedIDs map[string]bool) {
	rows, err := conn.Query(s.ctx, `SELECT id::text, state, coalesce(outcome, '') FROM epitaph.deliveries WHERE handler_id = $1`, h)
	if err != nil {
		s.violation("read deliveries: %v", err)
		return
	}
	type dl struct{ id, state, outcome string }
	var all []dl
	for rows.Next() {
		var d dl
		if err := rows.Scan(&d.id, &d.state, &d.outcome); err != nil {
			s.violation("read deliveries: %v", err)
			return
		}
		all = append(all, d)
	}
	rows.Close()
	var unseen, bad, unrecorded []string
	states := map[string]int{}
	done := map[string]bool{}
	s.hook.mu.Lock()
	for _, d := range all {
		states[d.state+"/"+d.outcome]++
		switch {
		case d.state == "done":
			done[d.id] = true
			if !s.hook.ids[d.id] {
				unseen = append(unseen, d.id)
			}
		case d.state == "stopped" && stoppedAsExpected(h, d.id, d.outcome, erasedIDs):
		default:
			bad = append(bad, d.id+" "+d.state+" "+d.outcome)
		}
	}
	accepted := len(s.hook.acceptedBy[h])
	if h == soakCursorID {
		for id := range s.hook.acceptedBy[h] {
			if !done[id] && !erasedIDs[id] {
				unrecorded = append(unrecorded, id)
			}
		}
	}
	s.hook.mu.Unlock()
	sort.Strings(unrecorded)
	s.t.Logf("handler %s: deliveries by state/outcome: %v; the webhook accepted %d of its delivery ids", h, states, accepted)
	if len(unseen) > 0 {
		s.violation("handler %s: %d deliveries done that the webhook never accepted: %s", h, len(unseen), strings.Join(unseen[:min(5, len(unseen))], "; "))
	}
	if len(bad) > 0 {
		s.violation("handler %s: %d deliveries not settled as expected: %s", h, len(bad), strings.Join(bad[:min(5, len(bad))], "; "))
	}
	if len(unrecorded) > 0 {
		s.violation("handler %s: %d deliveries accepted by the webhook but not recorded done: %s", h, len(unrecorded), strings.Join(unrecorded[:min(5, len(unrecorded))], "; "))
	}
	var without, twice []string
	rows, err = conn.Query(s.ctx, `SELECT r.table_name || ' ' || r.key::text || ' ' || r.commit_lsn || '/' || r.seq FROM archive.rows r
		WHERE r.table_name = 'orders' AND NOT EXISTS (SELECT 1 FROM epitaph.deliveries d
		WHERE d.handler_id = $1 AND d.source = r.source AND d.commit_lsn = r.commit_lsn AND d.seq = r.seq) LIMIT 5`, h)
	if err == nil {
		without, err = pgx.CollectRows(rows, pgx.RowTo[string])
	}
	if err == nil {
		// Several deliveries of a row are legitimate (revalidation
		// stops one as changed and starts the next generation), several
		// done ones are not.
		rows, err = conn.Query(s.ctx, `SELECT commit_lsn || '/' || seq || ' done x' || count(*) FROM epitaph.deliveries
			WHERE handler_id = $1 AND state = 'done' GROUP BY source, commit_lsn, seq HAVING count(*) > 1 LIMIT 5`, h)
	}
	if err == nil {
		twice, err = pgx.CollectRows(rows, pgx.RowTo[string])
	}
	if err != nil {
		s.violation("read deliveries: %v", err)
		return
	}
	if len(without) > 0 {
		s.violation("handler %s: archived orders without a delivery: %s", h, strings.Join(without, "; "))
	}
	if len(twice) > 0 {
		s.violation("handler %s: rows with several done deliveries: %s", h, strings.Join(twice, "; "))
	}
}
