package e2e_test

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	standardwebhooks "github.com/standard-webhooks/standard-webhooks/libraries/go"
	"github.com/stretchr/testify/require"

	capturepkg "github.com/epitaph-dev/epitaph/capture"
	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/internal/bench"
	"github.com/epitaph-dev/epitaph/internal/broker"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/internal/workload"
)

// hookServer is the webhook target of the row handlers test: it fails the
// first two attempts of some deliveries, hangs on the first attempt of
// others (until the projector gives up), always refuses a few (422: dead)
// and answers the rest at once. It verifies every request with the
// Standard Webhooks library and records what it saw per delivery id.
type hookServer struct {
	mu sync.Mutex
	wh *standardwebhooks.Webhook
	// unverified: requests the library refused (the first error kept).
	unverified int
	verifyErr  error
	// per delivery id: the distinct bodies (byte for byte), the attempts
	// seen, and when it first answered 2xx.
	bodies  map[string]map[string]bool
	seen    map[string]int
	okAt    map[string]time.Time
	firstAt map[string]time.Time
	key     map[string]string // delivery id -> handler + key
	stop    chan struct{}
}

type hookBehaviour int

const (
	hookOK hookBehaviour = iota
	hookFailTwice
	hookHang
	hookRefuse
)

// behaviour is decided by the delivery id (stable over attempts).
func behaviour(id, handlerID string, refused string) hookBehaviour {
	if handlerID == refused {
		return hookRefuse
	}
	h := sha256.Sum256([]byte(id))
	switch {
	case h[0] < 26: // ~10%
		return hookFailTwice
	case h[0] < 39: // ~5%
		return hookHang
	}
	return hookOK
}

func (s *hookServer) handle(refusedHandler string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		b, err := io.ReadAll(r.Body)
		if err != nil {
			w.WriteHeader(400)
			return
		}
		var body handler.Body
		if err := json.Unmarshal(b, &body); err != nil {
			w.WriteHeader(400)
			return
		}
		id := r.Header.Get(handler.HeaderDeliveryID)
		attempt, _ := strconv.Atoi(r.Header.Get(handler.HeaderAttempt))
		verr := s.wh.Verify(b, r.Header)
		s.mu.Lock()
		if verr != nil {
			s.unverified++
			if s.verifyErr == nil {
				s.verifyErr = verr
			}
			s.mu.Unlock()
			w.WriteHeader(http.StatusUnauthorized)
			return
		}
		if s.bodies[id] == nil {
			s.bodies[id] = map[string]bool{}
			s.firstAt[id] = time.Now()
		}
		s.bodies[id][string(b)] = true
		s.seen[id]++
		s.key[id] = body.HandlerID + " " + string(body.Key)
		s.mu.Unlock()
		b2 := behaviour(id, body.HandlerID, refusedHandler)
		switch {
		case b2 == hookRefuse && keyRefused(body.Key):
			w.WriteHeader(http.StatusUnprocessableEntity)
			return
		case b2 == hookFailTwice && attempt <= 2:
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		case b2 == hookHang && attempt == 1:
			select {
			case <-r.Context().Done():
			case <-s.stop:
			}
			return
		}
		s.mu.Lock()
		if _, ok := s.okAt[id]; !ok {
			s.okAt[id] = time.Now()
		}
		s.mu.Unlock()
		w.WriteHeader(http.StatusOK)
	}
}

// keyRefused: the refusing handler refuses one order in seven, for good.
func keyRefused(key json.RawMessage) bool {
	var k struct{ ID int64 }
	_ = json.Unmarshal(key, &k)
	return k.ID%7 == 0
}

// TestRowHandlersAtLeastOnceUnderKills runs row handlers through the real
// binaries: three webhook handlers (two on public.orders in priority order,
// one after-group on public.order_lines) against a local server that fails
// the first two attempts of some deliveries, hangs on others and always
// refuses some, while the cascading workload runs and the two projector
// workers are SIGKILLed at random. At the end every archived row of the
// handled tables has exactly one delivery per handler, done (or dead where
// the server always refused, with a sanitized error), the server saw every
// done delivery's id, never two different payloads for one id, a row's
// second handler never before its first one answered, and nothing is left
// in flight.
func TestRowHandlersAtLeastOnceUnderKills(t *testing.T) {
	t.Parallel()
	bins := binaries(t)
	seed := testSeed(t)
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 7))

	url := testenv.NewDatabase(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	require.NoError(t, workload.Setup(ctx, url))
	_, err := workload.Seed(ctx, url, workload.SeedConfig{Customers: 150, OrdersPerCustomer: 6})
	require.NoError(t, err)

	const first, second, lines = "11111111-1111-4111-8111-111111111111", "22222222-2222-4222-8222-222222222222", "33333333-3333-4333-8333-333333333333"
	// late is disabled while the workload runs and enabled once
	// the archive is complete: then every key deleted, re-inserted and
	// deleted again has its later deletion queued before any of its
	// deliveries is evaluated, so the older one must never be sent.
	const late = "44444444-4444-4444-8444-444444444444"
	secret := handler.NewSecret()
	secretFile := filepath.Join(t.TempDir(), "hook.secret")
	require.NoError(t, os.WriteFile(secretFile, []byte(secret+"\n"), 0o600))
	wh, err := standardwebhooks.NewWebhook(secret)
	require.NoError(t, err)
	srv := &hookServer{wh: wh, bodies: map[string]map[string]bool{}, seen: map[string]int{}, okAt: map[string]time.Time{},
		firstAt: map[string]time.Time{}, key: map[string]string{}, stop: make(chan struct{})}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	hs := &http.Server{Handler: srv.handle(second), ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = hs.Serve(ln) }()
	defer func() {
		close(srv.stop)
		_ = hs.Close()
	}()
	hook := "http://" + ln.Addr().String() + "/hook"

	listen, err := bench.LocalAddr()
	require.NoError(t, err)
	natsURL := "nats://" + listen
	metrics, err := bench.LocalAddr()
	require.NoError(t, err)
	dataDir := t.TempDir()
	cenv := bench.CaptureEnv(url, "", listen, dataDir, metrics, "main", "epitaph_e2e_handlers")
	capture := supervise(t, "capture", bins["capture"], joinEnv(cenv, "EPITAPH_HEARTBEAT_INTERVAL=1s"), seed)
	projectorCreds := broker.ProjectorCreds(capturepkg.EmbeddedCredsDir(dataDir))
	creds, err := bench.WaitCreds(ctx, projectorCreds, time.Minute)
	require.NoError(t, err)
	watch, err := bench.WatchStream(natsURL, "main", creds)
	require.NoError(t, err)
	defer watch.Close()
	require.NoError(t, bench.WaitCaptureReady(ctx, watch, url, "epitaph_e2e_handlers", captureReadyTimeout, nil))

	// The handlers, through the CLI, before any delete.
	cliEnv := joinEnv(bench.ProjectorEnv(url, natsURL, "", "main", "cli"), "EPITAPH_NATS_CREDS="+projectorCreds)
	projector := func(args ...string) string {
		t.Helper()
		cmd := exec.Command(bins["projector"], args...)
		cmd.Env = append(os.Environ(), cliEnv...)
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, string(out))
		return string(out)
	}
	common := []string{"--kind", "webhook", "--target", hook, "--backoff", "100ms", "--claim-timeout", "3s", "--max-attempts", "6",
		"--secret-file", secretFile}
	projector(append([]string{"handlers", "add", "--id", first, "--table", "public.orders", "--columns", "status", "--priority", "0"}, common...)...)
	projector(append([]string{"handlers", "add", "--id", second, "--table", "public.orders", "--priority", "1"}, common...)...)
	projector(append([]string{"handlers", "add", "--id", lines, "--table", "public.order_lines", "--phase", "after-group"}, common...)...)
	projector(append([]string{"handlers", "add", "--id", late, "--table", "public.orders", "--priority", "2"}, common...)...)
	projector("handlers", "disable", late)

	workers := superviseProjectors(t, bins["projector"], url, natsURL, 2, seed, "EPITAPH_NATS_CREDS="+projectorCreds)

	type outcome struct {
		res workload.Result
		err error
	}
	done := make(chan outcome, 1)
	go func() {
		res, err := workload.Run(ctx, url, workload.Plan{Seed: seed, Transactions: 250, MaxOrdersPerTx: 12, Reinserts: 3,
			Pause: 15 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))})
		done <- outcome{res, err}
	}()
	faults := chaos(ctx, rng, 500*time.Millisecond, 2500*time.Millisecond, map[string]func(){
		"kill-projector0-1": workers[0].Kill,
		"kill-projector0-2": workers[0].Kill,
		"kill-projector0-3": workers[0].Kill,
		"kill-projector1-1": workers[1].Kill,
		"kill-projector1-2": workers[1].Kill,
		"kill-projector1-3": workers[1].Kill,
	})
	out := <-done
	require.NoError(t, out.err)
	t.Logf("faults: %s; workload: %+v", summary(faults), out.res)
	for _, s := range append([]*supervised{capture}, workers...) {
		t.Logf("%s", s.Stats())
	}
	expected, err := workload.Expected(ctx, url)
	require.NoError(t, err)
	require.NoError(t, workload.WaitFor(ctx, 4*time.Minute, 250*time.Millisecond, func(ctx context.Context) (bool, error) {
		n, err := bench.Count(ctx, url, "SELECT count(*) FROM archive.rows WHERE source = 'main'")
		return n >= int64(len(expected)), err
	}), "archive complete\n%s", pipelineState(ctx, url, watch))
	projector("handlers", "enable", late)
	// Nothing open: every delivery settled (the after-group ones once their
	// commits were applied; the hung and reclaimed ones retried).
	var open int64
	err = workload.WaitFor(ctx, 4*time.Minute, 500*time.Millisecond, func(ctx context.Context) (bool, error) {
		n, err := bench.Count(ctx, url, "SELECT count(*) FROM archive.deliveries WHERE state IN ('pending', 'in_flight')")
		open = n
		return n == 0, err
	})
	require.NoError(t, err, "%d deliveries still open", open)

	conn, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer conn.Close(ctx)
	count := func(q string, args ...any) int64 {
		t.Helper()
		var n int64
		require.NoError(t, conn.QueryRow(ctx, q, args...).Scan(&n))
		return n
	}
	orders := count(`SELECT count(*) FROM archive.rows WHERE table_name = 'orders'`)
	orderLines := count(`SELECT count(*) FROM archive.rows WHERE table_name = 'order_lines'`)
	require.Positive(t, orders)
	require.Positive(t, orderLines)
	t.Logf("archived %d orders, %d order lines; %d deliveries", orders, orderLines, count(`SELECT count(*) FROM archive.deliveries`))
	// Exactly one delivery per (handler, archived row of its table).
	for _, c := range []struct {
		handler, table string
		rows           int64
	}{{first, "orders", orders}, {second, "orders", orders}, {lines, "order_lines", orderLines}, {late, "orders", orders}} {
		require.Equal(t, c.rows, count(`SELECT count(*) FROM archive.rows r JOIN epitaph.deliveries d
			ON d.source = r.source AND d.commit_lsn = r.commit_lsn AND d.seq = r.seq AND d.handler_id = $1
			WHERE r.table_name = $2`, c.handler, c.table), "one delivery per archived row for %s", c.handler)
		require.Equal(t, c.rows, count(`SELECT count(*) FROM epitaph.deliveries WHERE handler_id = $1`, c.handler))
	}
	require.Zero(t, count(`SELECT count(*) FROM (SELECT 1 FROM epitaph.deliveries GROUP BY handler_id, source, commit_lsn, seq HAVING count(*) > 1) x`))
	// done, or dead where the server always refused, with a sanitized error;
	// or stopped by revalidation because the deletion no longer stood (the
	// key deleted again later, or back in the source when evaluated).
	const superseded = `(state = 'stopped' AND outcome = 'stop_superseded')`
	require.Zero(t, count(`SELECT count(*) FROM archive.deliveries WHERE handler_id <> $1 AND state <> 'done' AND NOT `+superseded, second))
	require.Zero(t, count(`SELECT count(*) FROM archive.deliveries WHERE handler_id = $1 AND state <> 'done' AND NOT ((key->>'id')::bigint % 7 = 0) AND NOT `+superseded, second))
	require.Zero(t, count(`SELECT count(*) FROM archive.deliveries WHERE outcome = 'stop_changed'`), "no set changes after its commit here")
	// Revalidation: of a key deleted, re-inserted and deleted
	// again, only the latest deletion is sent to late; every older one
	// stopped superseded, and the server never saw it.
	rows, err := conn.Query(ctx, `SELECT d.id::text, d.state, COALESCE(d.outcome, ''),
		       NOT EXISTS (SELECT 1 FROM epitaph.deliveries l WHERE l.handler_id = d.handler_id AND l.key = d.key
		                   AND (l.commit_lsn, l.seq) > (d.commit_lsn, d.seq))
		FROM archive.deliveries d WHERE d.handler_id = $1
		  AND (SELECT count(*) FROM epitaph.deliveries l WHERE l.handler_id = d.handler_id AND l.key = d.key) > 1`, late)
	require.NoError(t, err)
	type redeleted struct {
		id, state, outcome string
		latest             bool
	}
	var again []redeleted
	for rows.Next() {
		var r redeleted
		require.NoError(t, rows.Scan(&r.id, &r.state, &r.outcome, &r.latest))
		again = append(again, r)
	}
	require.NoError(t, rows.Err())
	require.NotEmpty(t, again, "the workload deleted keys twice (%d reinserts)", out.res.Reinserted)
	srv.mu.Lock()
	for _, r := range again {
		if r.latest {
			require.Equal(t, "done", r.state, r.id)
			continue
		}
		require.Equal(t, "stopped", r.state, r.id)
		require.Equal(t, "stop_superseded", r.outcome, r.id)
		require.Zero(t, srv.seen[r.id], "the older deletion %s was sent", r.id)
	}
	require.Zero(t, srv.unverified, "every request verifies with the Standard Webhooks library: %v", srv.verifyErr)
	srv.mu.Unlock()
	dead := count(`SELECT count(*) FROM archive.deliveries WHERE handler_id = $1 AND state = 'dead'`, second)
	require.Positive(t, dead)
	require.Equal(t, dead, count(`SELECT count(*) FROM archive.deliveries WHERE state = 'dead' AND last_error ~ '^type=\S+ code=http_422 diag=[0-9a-f]{12} cause=webhook answered 422 Unprocessable Entity$' AND attempt >= 1`), "a 422 is permanent: dead at its attempt (a kill between a claim and its settle spends one more)")
	require.Zero(t, count(`SELECT count(*) FROM archive.deliveries WHERE payload IS NOT NULL`), "scrubbed once terminal")

	rows, err = conn.Query(ctx, `SELECT id::text, handler_id::text, state, commit_lsn::text || '/' || seq, attempt FROM archive.deliveries`)
	require.NoError(t, err)
	type dl struct {
		id, handler, state, row string
		attempt                 int
	}
	var all []dl
	for rows.Next() {
		var d dl
		require.NoError(t, rows.Scan(&d.id, &d.handler, &d.state, &d.row, &d.attempt))
		all = append(all, d)
	}
	require.NoError(t, rows.Err())
	srv.mu.Lock()
	defer srv.mu.Unlock()
	firstOK := map[string]time.Time{}
	var retried, hung int
	for _, d := range all {
		if d.state == "stopped" {
			continue // revalidated as superseded (checked above)
		}
		require.Positive(t, srv.seen[d.id], "the server never saw delivery %s (%s)", d.id, d.state)
		require.Len(t, srv.bodies[d.id], 1, "two different bodies for delivery %s", d.id)
		if d.state == "done" {
			require.Contains(t, srv.okAt, d.id)
		}
		switch behaviour(d.id, d.handler, second) {
		case hookFailTwice:
			if d.state == "done" {
				// Done on its third attempt or later (a kill may have
				// spent one the server never saw).
				require.GreaterOrEqual(t, d.attempt, 3, d.id)
				retried++
			}
		case hookHang:
			if d.state == "done" {
				require.GreaterOrEqual(t, d.attempt, 2, d.id)
				hung++
			}
		}
		if d.handler == first {
			firstOK[d.row] = srv.okAt[d.id]
		}
	}
	for _, d := range all {
		if d.handler == second && d.state != "stopped" {
			ok, has := firstOK[d.row]
			require.True(t, has, "row %s has a first handler's delivery", d.row)
			require.False(t, srv.firstAt[d.id].Before(ok), "the second handler of %s ran before the first one answered", d.row)
		}
	}
	t.Logf("deliveries: %d; retried after two failures: %d; hung once: %d; dead: %d; worker logs: %d reclaims",
		len(all), retried, hung, dead, workers[0].LogCount("reclaimed deliveries")+workers[1].LogCount("reclaimed deliveries"))
	require.Positive(t, retried)
	require.Positive(t, hung)
}
