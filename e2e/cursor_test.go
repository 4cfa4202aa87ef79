package e2e_test

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
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

// batchHook is the receiver of the cursor handler test: it verifies every
// request with the Standard Webhooks library and records, per webhook-id
// (a batch's id) and per delivery id, what it received and answered. By
// the batch's id (stable over resends) it refuses the first request of
// some batches with a 503, hangs on the first request of others until the
// sender gives up, and answers the rest after a short while (so a worker
// killed at a random moment is often in the middle of a POST).
type batchHook struct {
	mu sync.Mutex
	wh *standardwebhooks.Webhook
	// cursorID is the batching handler; every other request is a single
	// delivery of the queued handler.
	cursorID   string
	unverified int
	verifyErr  error
	arrivals   int // requests carrying deliveries, in order of arrival
	// per webhook-id: its distinct bodies (byte for byte), requests and 2xx
	// answers, and whether its first request was refused.
	batches map[string]*hookBatch
	// per delivery id of the cursor handler: the webhook-ids that carried
	// it, the body element, the arrival of the first request with it, and
	// how many 2xx answers carried it.
	batchOf  map[string]map[string]bool
	element  map[string]handler.Body
	firstArr map[string]int
	accepted map[string]int
	// per delivery id of the queued handler: distinct bodies and 2xx answers.
	single     map[string]map[string]bool
	singleOK   map[string]int
	slowOpen   int // cursor requests answering slowly right now
	cutShort   int // slow cursor requests whose sender went away (killed) mid-POST
	misfits    []string
	stop       chan struct{}
	cursorPOST int
	// afterOK, when set, runs right after a 2xx to the first accepted
	// request of some batches (at most killsAfterOK times): it kills the
	// workers before the sender can record the batch done.
	afterOK      func()
	killsAfterOK int
}

type hookBatch struct {
	bodies   map[string]bool
	requests int
	ok       int
	refused  bool
	hung     bool
}

func newBatchHook(wh *standardwebhooks.Webhook, cursorID string) *batchHook {
	return &batchHook{wh: wh, cursorID: cursorID, batches: map[string]*hookBatch{}, batchOf: map[string]map[string]bool{},
		element: map[string]handler.Body{}, firstArr: map[string]int{}, accepted: map[string]int{},
		single: map[string]map[string]bool{}, singleOK: map[string]int{}, stop: make(chan struct{})}
}

func (s *batchHook) handle(w http.ResponseWriter, r *http.Request) {
	b, err := io.ReadAll(r.Body)
	if err != nil {
		w.WriteHeader(400)
		return
	}
	verr := s.wh.Verify(b, r.Header)
	s.mu.Lock()
	defer s.mu.Unlock()
	if verr != nil {
		s.unverified++
		if s.verifyErr == nil {
			s.verifyErr = verr
		}
		w.WriteHeader(http.StatusUnauthorized)
		return
	}
	id := r.Header.Get(handler.HeaderWebhookID)
	if r.Header.Get(handler.HeaderBatchSize) == "" {
		// The queued handler: one delivery a request.
		if s.single[id] == nil {
			s.single[id] = map[string]bool{}
		}
		s.single[id][string(b)] = true
		s.singleOK[id]++
		w.WriteHeader(http.StatusOK)
		return
	}
	var body handler.BatchBody
	if err := json.Unmarshal(b, &body); err != nil || len(body.Deliveries) == 0 {
		s.misfits = append(s.misfits, fmt.Sprintf("batch %s: undecodable body %q", id, b))
		w.WriteHeader(400)
		return
	}
	if n, _ := strconv.Atoi(r.Header.Get(handler.HeaderBatchSize)); n != len(body.Deliveries) {
		s.misfits = append(s.misfits, fmt.Sprintf("batch %s: %s %s for %d deliveries", id, handler.HeaderBatchSize, r.Header.Get(handler.HeaderBatchSize), len(body.Deliveries)))
	}
	hb := s.record(id, b, body)
	h := sha256.Sum256([]byte(id))
	first := hb.requests == 1
	switch {
	case first && h[0] < 38: // ~15%: refused, retried as a whole
		hb.refused = true
		w.WriteHeader(http.StatusServiceUnavailable)
		return
	case first && h[0] < 64: // ~10%: hangs until the sender gives up
		hb.hung = true
		s.mu.Unlock()
		select {
		case <-r.Context().Done():
		case <-s.stop:
		}
		s.mu.Lock()
		return
	}
	// Slow: a worker killed now is killed in the middle of the POST.
	slow := time.Duration(150+int(h[1])*2) * time.Millisecond
	s.slowOpen++
	s.mu.Unlock()
	var gone bool
	select {
	case <-r.Context().Done():
		gone = true
	case <-s.stop:
		gone = true
	case <-time.After(slow):
	}
	s.mu.Lock()
	s.slowOpen--
	if gone {
		s.cutShort++
		return
	}
	hb.ok++
	for _, d := range body.Deliveries {
		s.accepted[d.DeliveryID]++
	}
	w.WriteHeader(http.StatusOK)
	if s.afterOK != nil && hb.ok == 1 && h[2] < 32 && s.killsAfterOK > 0 {
		s.killsAfterOK--
		if f, ok := w.(http.Flusher); ok {
			f.Flush()
		}
		s.afterOK()
	}
}

// resentElsewhere says how many deliveries came under more than one
// webhook-id (a receiver deduplicating by webhook-id processes them twice).
func (s *batchHook) resentElsewhere() (int, string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var ids []string
	for id, batches := range s.batchOf {
		if len(batches) > 1 {
			ids = append(ids, id)
		}
	}
	sort.Strings(ids)
	return len(ids), fmt.Sprintf("%d deliveries sent under several webhook-ids %v", len(ids), ids[:min(3, len(ids))])
}

// record notes a batch's request (s.mu held) and returns its batch.
func (s *batchHook) record(id string, b []byte, body handler.BatchBody) *hookBatch {
	s.cursorPOST++
	s.arrivals++
	hb := s.batches[id]
	if hb == nil {
		hb = &hookBatch{bodies: map[string]bool{}}
		s.batches[id] = hb
	}
	hb.bodies[string(b)] = true
	hb.requests++
	for _, d := range body.Deliveries {
		if d.HandlerID != s.cursorID {
			s.misfits = append(s.misfits, fmt.Sprintf("batch %s carries a delivery of handler %s", id, d.HandlerID))
		}
		if s.batchOf[d.DeliveryID] == nil {
			s.batchOf[d.DeliveryID] = map[string]bool{}
			s.firstArr[d.DeliveryID] = s.arrivals
			s.element[d.DeliveryID] = d
		}
		s.batchOf[d.DeliveryID][id] = true
	}
	return hb
}

// busy reports whether a cursor batch is being answered slowly right now.
func (s *batchHook) busy() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.slowOpen > 0
}

// TestCursorHandlerExactlyOnceUnderKills runs a cursor handler (a webhook
// batching 8 deliveries, revalidation off) beside a queued revalidating
// one, both on public.orders, through the real binaries while the
// cascading workload deletes and the two projector workers are SIGKILLed
// over and over, most kills landing while the receiver is in the middle
// of answering a batch or right after its 2xx. The receiver refuses some
// batches once (503), hangs on others and answers the rest slowly. At the end, row by row:
// every archived order's delivery reached the receiver and was answered
// 2xx, under one webhook-id whose every resend had the same body byte for
// byte; each batch in commit order and each key's deliveries in commit
// order; every refused or cut-short batch sent again as a whole; nothing
// of another table or of another handler in a batch; and
// epitaph.deliveries holds exactly one `done` row per archived order with
// the id the receiver saw. The queued handler's deliveries are all
// settled once beside it.
func TestCursorHandlerExactlyOnceUnderKills(t *testing.T) {
	t.Parallel()
	bins := binaries(t)
	seed := testSeed(t)
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 11))

	url := testenv.NewDatabase(t)
	ctx, cancel := context.WithTimeout(context.Background(), 12*time.Minute)
	defer cancel()
	waitCtx, cancelWait := context.WithCancel(ctx)
	defer cancelWait()
	require.NoError(t, workload.Setup(ctx, url))
	_, err := workload.Seed(ctx, url, workload.SeedConfig{Customers: 150, OrdersPerCustomer: 6})
	require.NoError(t, err)

	const cursorID, queuedID = "c0c0c0c0-c0c0-4c0c-8c0c-c0c0c0c0c0c0", "d1d1d1d1-d1d1-4d1d-8d1d-d1d1d1d1d1d1"
	secret := handler.NewSecret()
	secretFile := filepath.Join(t.TempDir(), "hook.secret")
	require.NoError(t, os.WriteFile(secretFile, []byte(secret+"\n"), 0o600))
	wh, err := standardwebhooks.NewWebhook(secret)
	require.NoError(t, err)
	srv := newBatchHook(wh, cursorID)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	hs := &http.Server{Handler: http.HandlerFunc(srv.handle), ReadHeaderTimeout: 5 * time.Second}
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
	cenv := bench.CaptureEnv(url, "", listen, dataDir, metrics, "main", "epitaph_e2e_cursor")
	capture := supervise(t, "capture", bins["capture"], joinEnv(cenv, "EPITAPH_HEARTBEAT_INTERVAL=1s"), seed)
	projectorCreds := broker.ProjectorCreds(capturepkg.EmbeddedCredsDir(dataDir))
	creds, err := bench.WaitCreds(ctx, projectorCreds, time.Minute)
	require.NoError(t, err)
	watch, err := bench.WatchStream(natsURL, "main", creds)
	require.NoError(t, err)
	defer watch.Close()
	require.NoError(t, bench.WaitCaptureReady(ctx, watch, url, "epitaph_e2e_cursor", captureReadyTimeout, nil))

	cliEnv := joinEnv(bench.ProjectorEnv(url, natsURL, "", "main", "cli"), "EPITAPH_NATS_CREDS="+projectorCreds)
	projector := func(args ...string) string {
		t.Helper()
		cmd := exec.Command(bins["projector"], args...)
		cmd.Env = append(os.Environ(), cliEnv...)
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, string(out))
		return string(out)
	}
	common := []string{"--table", "public.orders", "--kind", "webhook", "--target", hook, "--backoff", "100ms",
		"--claim-timeout", "3s", "--max-attempts", "1000", "--secret-file", secretFile}
	projector(append([]string{"handlers", "add", "--id", cursorID, "--batch-size", "8", "--batch-wait", "100ms", "--no-revalidate"}, common...)...)
	projector(append([]string{"handlers", "add", "--id", queuedID, "--priority", "1"}, common...)...)
	var cursorRows int64
	conn, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer conn.Close(context.WithoutCancel(ctx))
	require.NoError(t, conn.QueryRow(ctx, `SELECT count(*) FROM epitaph.handler_cursors WHERE handler_id = $1`, cursorID).Scan(&cursorRows))
	require.Equal(t, int64(1), cursorRows, "the batching handler without revalidation has a cursor")

	workers := superviseProjectors(t, bins["projector"], url, natsURL, 2, seed, "EPITAPH_NATS_CREDS="+projectorCreds)

	type outcome struct {
		res workload.Result
		err error
	}
	done := make(chan outcome, 1)
	go func() {
		res, err := workload.Run(ctx, url, workload.Plan{Seed: seed, Transactions: 250, MaxOrdersPerTx: 12, Reinserts: 6,
			Pause: 15 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))})
		done <- outcome{res, err}
	}()
	// Kills at random moments, most of them once the receiver is in the
	// middle of answering a batch (at most 3 s of waiting for one).
	var midMu sync.Mutex
	midKills := 0
	whenBusy := func(kill func()) func() {
		return func() {
			deadline := time.Now().Add(3 * time.Second)
			for !srv.busy() && time.Now().Before(deadline) {
				time.Sleep(10 * time.Millisecond)
			}
			if srv.busy() {
				midMu.Lock()
				midKills++
				midMu.Unlock()
			}
			kill()
		}
	}
	both := func() { workers[0].Kill(); workers[1].Kill() }
	// Some kills right after a batch's 2xx, before it is recorded done:
	// the batch goes out again, under the same webhook-id.
	srv.mu.Lock()
	srv.afterOK, srv.killsAfterOK = both, 4
	srv.mu.Unlock()
	actions := map[string]func(){
		"kill-projector0":       workers[0].Kill,
		"kill-projector1":       workers[1].Kill,
		"kill-projector0-busy1": whenBusy(workers[0].Kill),
		"kill-projector1-busy1": whenBusy(workers[1].Kill),
		"kill-projector0-busy2": whenBusy(workers[0].Kill),
		"kill-projector1-busy2": whenBusy(workers[1].Kill),
	}
	for i := range 6 {
		actions[fmt.Sprintf("kill-both-busy%d", i)] = whenBusy(both)
	}
	faults := chaos(ctx, rng, 1500*time.Millisecond, 4*time.Second, actions)
	out := <-done
	require.NoError(t, out.err)
	t.Logf("faults: %s; workload: %+v", summary(faults), out.res)
	expected, err := workload.Expected(ctx, url)
	require.NoError(t, err)
	require.NoError(t, workload.WaitFor(ctx, 4*time.Minute, 250*time.Millisecond, func(ctx context.Context) (bool, error) {
		n, err := bench.Count(ctx, url, "SELECT count(*) FROM archive.rows WHERE source = 'main'")
		return n >= int64(len(expected)), err
	}), "archive complete\n%s", pipelineState(ctx, url, watch))
	// Both handlers caught up: the cursor past every archived order with
	// no batch claimed, no queued delivery open.
	// A delivery sent in a second batch ends the wait at once (its settle
	// would collide with the first one's row and retry for ever).
	var behind, open int64
	err = workload.WaitFor(waitCtx, 5*time.Minute, 500*time.Millisecond, func(ctx context.Context) (bool, error) {
		if n, dup := srv.resentElsewhere(); n > 0 {
			cancelWait()
			return false, fmt.Errorf("sent twice: %s", dup)
		}
		var err error
		if behind, err = bench.Count(ctx, url, `SELECT count(*) FROM archive.rows r, epitaph.handler_cursors c
			WHERE c.handler_id = $1 AND r.source = 'main' AND r.table_name = 'orders' AND (r.commit_lsn, r.seq) > (c.commit_lsn, c.seq)`, cursorID); err != nil {
			return false, err
		}
		if open, err = bench.Count(ctx, url, `SELECT (SELECT count(*) FROM epitaph.deliveries WHERE state IN ('pending', 'in_flight'))
			+ (SELECT count(*) FROM epitaph.handler_cursors WHERE claimed_to_lsn IS NOT NULL)`); err != nil {
			return false, err
		}
		return behind == 0 && open == 0, nil
	})
	_, dup := srv.resentElsewhere()
	require.NoError(t, err, "%d orders after the cursor, %d deliveries or batches open; %s\n%s", behind, open, dup, cursorState(ctx, conn, cursorID))
	for _, w := range append([]*supervised{capture}, workers...) {
		t.Logf("%s", w.Stats())
	}

	// The archived orders, in commit order, with the delivery id each must
	// have had on either path.
	rows, err := conn.Query(ctx, `SELECT commit_lsn::text, seq, key::text, correlation_id FROM archive.rows
		WHERE source = 'main' AND schema_name = 'public' AND table_name = 'orders' ORDER BY commit_lsn, seq`)
	require.NoError(t, err)
	var orders []archOrder
	byID := map[string]*archOrder{}
	for rows.Next() {
		var a archOrder
		require.NoError(t, rows.Scan(&a.lsn, &a.seq, &a.key, &a.corr))
		a.id, a.pos, a.key = handler.DeliveryID(cursorID, "main", a.lsn, a.seq, 0), len(orders), compactJSON(json.RawMessage(a.key))
		orders = append(orders, a)
	}
	require.NoError(t, rows.Err())
	for i := range orders {
		byID[orders[i].id] = &orders[i]
	}
	require.NotEmpty(t, orders)
	otherRows, err := bench.Count(ctx, url, `SELECT count(*) FROM archive.rows WHERE source = 'main' AND table_name <> 'orders'`)
	require.NoError(t, err)
	require.Positive(t, otherRows, "the workload deleted rows of other tables too")

	// epitaph.deliveries: one done row per archived order for the cursor
	// handler, with its id; nothing else.
	dbRows, err := conn.Query(ctx, `SELECT id::text, state, COALESCE(outcome, ''), table_name, attempt FROM epitaph.deliveries WHERE handler_id = $1`, cursorID)
	require.NoError(t, err)
	dbIDs := map[string]int{}
	for dbRows.Next() {
		var id, state, outc, table string
		var attempt int
		require.NoError(t, dbRows.Scan(&id, &state, &outc, &table, &attempt))
		dbIDs[id]++
		require.Equal(t, "done", state, "delivery %s: %s/%s", id, state, outc)
		require.Equal(t, "orders", table, "delivery %s of another table", id)
		require.Contains(t, byID, id, "delivery %s of no archived order", id)
		require.GreaterOrEqual(t, attempt, 1, id)
	}
	require.NoError(t, dbRows.Err())
	var missing []string
	for _, a := range orders {
		if dbIDs[a.id] == 0 {
			missing = append(missing, fmt.Sprintf("%s/%d %s", a.lsn, a.seq, a.key))
		}
	}
	require.Zero(t, len(missing), "%d of %d archived orders without a delivery row, first %v", len(missing), len(orders), missing[:min(5, len(missing))])
	require.Len(t, dbIDs, len(orders), "one delivery row per archived order")
	for id, n := range dbIDs {
		require.Equal(t, 1, n, "delivery %s settled %d times", id, n)
	}

	stats := srv.checkCursor(t, orders, byID)
	midMu.Lock()
	mid := midKills
	midMu.Unlock()
	t.Logf("orders archived %d (+%d other rows); %s; kills while a batch was answered %d", len(orders), otherRows, stats, mid)

	// The queued revalidating handler beside it: one delivery per archived
	// order, settled (done, or stopped as superseded by a later deletion
	// of its key), each done one received under its id with one body.
	checkQueuedBeside(ctx, t, conn, srv, queuedID, len(orders))
}

// archOrder is an archived order with the delivery id it must have had.
type archOrder struct {
	id, key, corr string
	lsn           string
	seq           int
	pos           int // index in commit order
}

// checkCursor checks, row by row, what the receiver got from the cursor
// handler against the archived orders (in commit order), and returns a
// summary of what it saw.
func (s *batchHook) checkCursor(t *testing.T, orders []archOrder, byID map[string]*archOrder) string {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	require.Zero(t, s.unverified, "every request verifies with the Standard Webhooks library: %v", s.verifyErr)
	require.Empty(t, s.misfits)
	// The receiver: every archived order's delivery answered 2xx, under
	// exactly one webhook-id, with the archived row's key and correlation.
	for _, a := range orders {
		require.Positive(t, s.accepted[a.id], "the receiver never accepted the delivery of order row %s/%d %s", a.lsn, a.seq, a.key)
		require.Len(t, s.batchOf[a.id], 1, "delivery %s (%s/%d) sent under several webhook-ids", a.id, a.lsn, a.seq)
		el := s.element[a.id]
		require.Equal(t, "public.orders", el.Table, a.id)
		require.Equal(t, a.key, compactJSON(el.Key), a.id)
		require.Equal(t, a.corr, el.CorrelationID, a.id)
	}
	for id := range s.batchOf {
		require.Contains(t, byID, id, "the receiver got a delivery %s of no archived order (another table, or forged)", id)
	}
	// Every batch: one body byte for byte over its resends, accepted in the
	// end (a refused, hung or cut-short batch sent again whole), its
	// deliveries in commit order.
	var refused, hung, resent, acceptedTwice int
	for id, hb := range s.batches {
		require.Len(t, hb.bodies, 1, "batch %s resent with another body", id)
		require.Positive(t, hb.ok, "batch %s (%d requests) never accepted: not retried as a whole", id, hb.requests)
		if hb.refused {
			refused++
		}
		if hb.hung {
			hung++
		}
		if hb.requests > 1 {
			resent++
		}
		if hb.ok > 1 {
			acceptedTwice++
		}
		var body handler.BatchBody
		for b := range hb.bodies {
			require.NoError(t, json.Unmarshal([]byte(b), &body))
		}
		for i := 1; i < len(body.Deliveries); i++ {
			require.Less(t, byID[body.Deliveries[i-1].DeliveryID].pos, byID[body.Deliveries[i].DeliveryID].pos, "batch %s out of commit order", id)
		}
	}
	// Each key's deliveries reached the receiver in commit order (two of
	// them in one batch come in one request, in commit order as checked
	// above).
	lastOfKey := map[string]*archOrder{}
	reKeyed := 0
	for i := range orders {
		a := &orders[i]
		if prev := lastOfKey[a.key]; prev != nil {
			reKeyed++
			require.LessOrEqual(t, s.firstArr[prev.id], s.firstArr[a.id], "key %s: %s/%d reached the receiver before %s/%d", a.key, a.lsn, a.seq, prev.lsn, prev.seq)
		}
		lastOfKey[a.key] = a
	}
	summary := fmt.Sprintf("batches %d, POSTs %d: refused once %d, hung once %d, sent again %d, accepted twice %d; "+
		"keys delivered again after a re-insert %d; POSTs cut short by a kill %d",
		len(s.batches), s.cursorPOST, refused, hung, resent, acceptedTwice, reKeyed, s.cutShort)
	require.Positive(t, refused, "some batch refused with a 503: %s", summary)
	require.Positive(t, hung, "some batch hung: %s", summary)
	require.Positive(t, reKeyed, "some key deleted twice: %s", summary)
	require.Positive(t, s.cutShort, "some POST in progress when its worker was killed: %s", summary)
	require.Positive(t, acceptedTwice, "some batch sent again after a kill between its 2xx and its settle: %s", summary)
	return summary
}

// checkQueuedBeside checks the queued handler's deliveries: one per
// archived order, done (received under its id with one body) or stopped
// as superseded.
func checkQueuedBeside(ctx context.Context, t *testing.T, conn *pgx.Conn, srv *batchHook, queuedID string, orders int) {
	t.Helper()
	srv.mu.Lock()
	defer srv.mu.Unlock()
	qRows, err := conn.Query(ctx, `SELECT d.id::text, d.state, COALESCE(d.outcome, '') FROM archive.rows r
		LEFT JOIN epitaph.deliveries d ON d.handler_id = $1 AND d.source = r.source AND d.commit_lsn = r.commit_lsn AND d.seq = r.seq
		WHERE r.source = 'main' AND r.table_name = 'orders'`, queuedID)
	require.NoError(t, err)
	states := map[string]int{}
	for qRows.Next() {
		var id, state, outc *string
		require.NoError(t, qRows.Scan(&id, &state, &outc))
		require.NotNil(t, id, "an archived order without a queued delivery")
		states[*state+"/"+*outc]++
		switch *state {
		case "done":
			require.Positive(t, srv.singleOK[*id], "queued delivery %s done, never received", *id)
			require.Len(t, srv.single[*id], 1, "queued delivery %s sent with two bodies", *id)
		case "stopped":
			require.Equal(t, "stop_superseded", *outc, *id)
		default:
			t.Fatalf("queued delivery %s %s/%s", *id, *state, *outc)
		}
	}
	require.NoError(t, qRows.Err())
	var n int64
	require.NoError(t, conn.QueryRow(ctx, `SELECT count(*) FROM epitaph.deliveries WHERE handler_id = $1`, queuedID).Scan(&n))
	require.Equal(t, int64(orders), n, "one queued delivery per archived order")
	t.Logf("queued handler: %v", states)
}

// cursorState describes a cursor handler's cursor and the archive's
// watermarks, when it falls behind.
func cursorState(ctx context.Context, conn *pgx.Conn, handlerID string) string {
	var b strings.Builder
	for _, q := range []string{
		`SELECT format('cursor %s/%s claimed_to=%s/%s token=%s expires=%s attempt=%s next=%s', commit_lsn, seq, claimed_to_lsn, claimed_to_seq,
			claim_token, claim_expires_at, attempt, next_attempt_at) FROM epitaph.handler_cursors WHERE handler_id = '` + handlerID + `'`,
		`SELECT format('watermark v%s p%s %s', version, partition, source_lsn) FROM epitaph.progress WHERE projection = 'archive' ORDER BY version, partition`,
		`SELECT format('order after the cursor %s/%s', r.commit_lsn, r.seq) FROM archive.rows r, epitaph.handler_cursors c
			WHERE c.handler_id = '` + handlerID + `' AND r.table_name = 'orders' AND (r.commit_lsn, r.seq) > (c.commit_lsn, c.seq)
			ORDER BY r.commit_lsn, r.seq LIMIT 3`,
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
		sort.Strings(lines)
		for _, l := range lines {
			b.WriteString(l + "\n")
		}
	}
	return b.String()
}

// TestCursorBatchInFlightOverAnErasure erases an order while a cursor
// handler's batch carrying it is being answered (the receiver holds the
// POST), then lets the batch succeed: the batch's delivery rows, written
// when it settles, must not bring the erased row's key back into
// epitaph.deliveries (an erasure clears the key of every delivery of its
// rows), and the other orders of the batch are delivered once.
func TestCursorBatchInFlightOverAnErasure(t *testing.T) {
	t.Parallel()
	runCursorErasure(t, false)
}

// TestCursorBatchErasedWholeBeforeItsRetry erases every order of a cursor
// handler's batch while its POST is held, then refuses it (503): the retry
// finds none of its rows, and the orders deleted after it must still be
// delivered (the cursor must not stay behind the emptied batch).
func TestCursorBatchErasedWholeBeforeItsRetry(t *testing.T) {
	t.Parallel()
	runCursorErasure(t, true)
}

// runCursorErasure deletes orders in one transaction, holds the cursor
// handler's batch of them at the receiver, erases one of them (whole: all
// of them, and the held POST is then refused) and checks what follows.
func runCursorErasure(t *testing.T, whole bool) {
	bins := binaries(t)
	url := testenv.NewDatabase(t)
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	require.NoError(t, workload.Setup(ctx, url))
	_, err := workload.Seed(ctx, url, workload.SeedConfig{Customers: 3, OrdersPerCustomer: 3})
	require.NoError(t, err)

	const cursorID = "e1e1e1e1-e1e1-4e1e-8e1e-e1e1e1e1e1e1"
	var (
		mu       sync.Mutex
		requests []handler.BatchBody
	)
	held, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	hs := &http.Server{ReadHeaderTimeout: 5 * time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var body handler.BatchBody
		if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
			w.WriteHeader(400)
			return
		}
		mu.Lock()
		requests = append(requests, body)
		first := len(requests) == 1
		mu.Unlock()
		if first {
			once.Do(func() { close(held) })
			select {
			case <-release:
			case <-r.Context().Done():
				return
			}
			if whole {
				w.WriteHeader(http.StatusServiceUnavailable)
				return
			}
		}
		w.WriteHeader(http.StatusOK)
	})}
	go func() { _ = hs.Serve(ln) }()
	defer hs.Close()

	listen, err := bench.LocalAddr()
	require.NoError(t, err)
	natsURL := "nats://" + listen
	metrics, err := bench.LocalAddr()
	require.NoError(t, err)
	dataDir := t.TempDir()
	cenv := bench.CaptureEnv(url, "", listen, dataDir, metrics, "main", "epitaph_e2e_cursor_erase")
	supervise(t, "capture", bins["capture"], joinEnv(cenv, "EPITAPH_HEARTBEAT_INTERVAL=1s"), 1)
	projectorCreds := broker.ProjectorCreds(capturepkg.EmbeddedCredsDir(dataDir))
	creds, err := bench.WaitCreds(ctx, projectorCreds, time.Minute)
	require.NoError(t, err)
	watch, err := bench.WatchStream(natsURL, "main", creds)
	require.NoError(t, err)
	defer watch.Close()
	require.NoError(t, bench.WaitCaptureReady(ctx, watch, url, "epitaph_e2e_cursor_erase", captureReadyTimeout, nil))
	cliEnv := joinEnv(bench.ProjectorEnv(url, natsURL, "", "main", "cli"), "EPITAPH_NATS_CREDS="+projectorCreds)
	projector := func(args ...string) string {
		t.Helper()
		cmd := exec.Command(bins["projector"], args...)
		cmd.Env = append(os.Environ(), cliEnv...)
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, string(out))
		return string(out)
	}
	projector("handlers", "add", "--id", cursorID, "--table", "public.orders", "--kind", "webhook", "--target", "http://"+ln.Addr().String()+"/hook",
		"--batch-size", "5", "--batch-wait", "100ms", "--no-revalidate", "--claim-timeout", "60s", "--backoff", "100ms", "--max-attempts", "5")
	superviseProjectors(t, bins["projector"], url, natsURL, 1, 1, "EPITAPH_NATS_CREDS="+projectorCreds)

	conn, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer conn.Close(context.WithoutCancel(ctx))
	rows, err := conn.Query(ctx, `SELECT id FROM public.orders ORDER BY id LIMIT 4`)
	require.NoError(t, err)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	require.NoError(t, err)
	require.Len(t, ids, 4)
	_, err = conn.Exec(ctx, `DELETE FROM public.orders WHERE id = ANY($1)`, ids[:3])
	require.NoError(t, err)

	select {
	case <-held:
	case <-time.After(3 * time.Minute):
		t.Fatal("no batch reached the receiver")
	}
	mu.Lock()
	first := requests[0]
	mu.Unlock()
	require.Len(t, first.Deliveries, 3, "the three orders in one batch")
	erased := first.Deliveries[1:2]
	if whole {
		erased = first.Deliveries
	}
	type pos struct {
		lsn string
		seq int
	}
	var at []pos
	for _, e := range erased {
		var p pos
		require.NoError(t, conn.QueryRow(ctx, `SELECT commit_lsn::text, seq FROM archive.rows WHERE table_name = 'orders' AND key = $1::jsonb`,
			string(e.Key)).Scan(&p.lsn, &p.seq))
		at = append(at, p)
		projector("erase", "--table", "public.orders", "--key", string(e.Key), "--with-children", "--reason", "test", "--yes")
	}
	close(release)
	if whole {
		// An order deleted after the emptied batch.
		_, err = conn.Exec(ctx, `DELETE FROM public.orders WHERE id = $1`, ids[3])
		require.NoError(t, err)
		require.NoError(t, workload.WaitFor(ctx, time.Minute, 100*time.Millisecond, func(ctx context.Context) (bool, error) {
			n, err := bench.Count(ctx, url, `SELECT count(*) FROM archive.rows WHERE table_name = 'orders' AND key = jsonb_build_object('id', $1::bigint)`, ids[3])
			return n == 1, err
		}), "the order deleted after the batch archived")
	}

	// Every order after the cursor delivered, nothing claimed.
	var state string
	err = workload.WaitFor(ctx, time.Minute, 250*time.Millisecond, func(ctx context.Context) (bool, error) {
		n, err := bench.Count(ctx, url, `SELECT (SELECT count(*) FROM archive.rows r, epitaph.handler_cursors c WHERE c.handler_id = $1
			AND r.table_name = 'orders' AND (r.commit_lsn, r.seq) > (c.commit_lsn, c.seq))
			+ (SELECT count(*) FROM epitaph.handler_cursors WHERE handler_id = $1 AND claimed_to_lsn IS NOT NULL)`, cursorID)
		return n == 0, err
	})
	if err != nil {
		state = cursorState(ctx, conn, cursorID)
	}
	mu.Lock()
	t.Logf("%d requests; erased %d orders", len(requests), len(erased))
	mu.Unlock()
	require.NoError(t, err, "the cursor did not catch up\n%s", state)
	for _, p := range at {
		var keyed int64
		require.NoError(t, conn.QueryRow(ctx, `SELECT count(*) FROM epitaph.deliveries
			WHERE handler_id = $1 AND commit_lsn = $2::pg_lsn AND seq = $3 AND key IS NOT NULL`, cursorID, p.lsn, p.seq).Scan(&keyed))
		require.Zero(t, keyed, "the key of the erased order at %s/%d is back in epitaph.deliveries after its batch settled", p.lsn, p.seq)
	}
	var done int64
	require.NoError(t, conn.QueryRow(ctx, `SELECT count(*) FROM epitaph.deliveries d JOIN archive.rows r
		ON r.source = d.source AND r.commit_lsn = d.commit_lsn AND r.seq = d.seq WHERE d.handler_id = $1 AND d.state = 'done'`, cursorID).Scan(&done))
	var live int64
	require.NoError(t, conn.QueryRow(ctx, `SELECT count(*) FROM archive.rows WHERE table_name = 'orders'`).Scan(&live))
	require.Equal(t, live, done, "every order still archived delivered once")
	require.Positive(t, live)
}
