package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/internal/bench"
)

// The limit the machine allows the handlers round, measured in the same
// run (docs/benchmarks.md "The limit beside the figure"). With the CPUs
// the bottleneck, every archived row costs a (the plain apply's CPU per
// row: Postgres, projector process and the JetStream server it reads from,
// which runs in this process), q more when its delivery is queued in the
// apply's transaction, and d to deliver (the drain's CPU per delivery:
// Postgres, projector process and the local webhook server, also in this
// process).
// Deliveries counted from the projector's start then reach at most
//
//	a / (a + q + d)                of the plain apply rate, when the plain
//	                               apply keeps the CPUs busy, and in general
//	C / (R_plain * (a + q + d))    (C CPUs, R_plain the plain apply rate),
//
// and d is at least the floor of one webhook call: a bare loop of POSTs
// of the same size, headers and signature through the same transport to
// the same kind of server (client and server CPU per call).

// benchSecret signs the round's webhooks (a throwaway value).
const benchSecret = "bench-handlers-secret"

// floorEnv, set in the environment, makes this binary the floor's client:
// "URL CALLS PARALLELISM BODY_BYTES SECRET_FILE".
const floorEnv = "EPITAPH_BENCH_WEBHOOK_FLOOR"

// floorCalls is how many POSTs the floor's loop sends.
const floorCalls = 20_000

// webhookServer is the round's local webhook server: it reads the body
// and answers 200 at once, counting calls and body bytes.
// receivedDeliveries counts the deliveries the round's webhook server got
// (a batch counts its size).
var receivedDeliveries atomic.Int64

func webhookServer(hits, bodyBytes *atomic.Int64) (net.Listener, *http.Server, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, nil, fmt.Errorf("listen for the webhook server: %w", err)
	}
	srv := &http.Server{ReadHeaderTimeout: 5 * time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		k, _ := io.Copy(io.Discard, r.Body)
		n := int64(1)
		if b, err := strconv.ParseInt(r.Header.Get(handler.HeaderBatchSize), 10, 64); err == nil {
			n = b
		}
		receivedDeliveries.Add(n)
		hits.Add(1)
		bodyBytes.Add(k)
		w.WriteHeader(http.StatusOK)
	})}
	go func() { _ = srv.Serve(ln) }()
	return ln, srv, nil
}

// floorFigures: the CPU of one bare webhook call, client and server.
type floorFigures struct {
	calls          int
	client, server float64 // CPU seconds of the whole loop
}

func (f floorFigures) perCall() float64 {
	if f.calls == 0 {
		return 0
	}
	return (f.client + f.server) / float64(f.calls)
}

// webhookFloor runs the floor's loop: a child process (this binary, see
// floorClient) POSTs floorCalls bodies of bodySize bytes, parallelism at
// once, to a server like the round's in this process. The client's CPU is
// the child's (its rusage), the server's this process's over the loop
// (with the idle JetStream server it also runs).
func (e *env) webhookFloor(ctx context.Context, parallelism, bodySize int, secretFile string) (floorFigures, error) {
	var hits, bodyBytes atomic.Int64
	ln, srv, err := webhookServer(&hits, &bodyBytes)
	if err != nil {
		return floorFigures{}, err
	}
	defer srv.Close()
	self, err := os.Executable()
	if err != nil {
		return floorFigures{}, fmt.Errorf("webhook floor: %w", err)
	}
	cmd := exec.CommandContext(ctx, self)
	cmd.Env = append(os.Environ(), fmt.Sprintf("%s=http://%s/hook %d %d %d %s", floorEnv, ln.Addr(), floorCalls, parallelism, bodySize, secretFile))
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	s0, _ := procCPU(os.Getpid())
	if err := cmd.Run(); err != nil {
		return floorFigures{}, fmt.Errorf("webhook floor: client: %w", err)
	}
	s1, _ := procCPU(os.Getpid())
	if got := hits.Load(); got != floorCalls {
		return floorFigures{}, fmt.Errorf("webhook floor: the server saw %d of %d calls", got, floorCalls)
	}
	st := cmd.ProcessState
	return floorFigures{calls: floorCalls, client: (st.UserTime() + st.SystemTime()).Seconds(), server: s1 - s0}, nil
}

// floorClient is the floor's client (a child process): what a webhook
// attempt sends, without the claim, the settle or the JSON encoding: the
// same transport (handler.NewHTTPClient), headers and per-call signature
// (handler.Sign) as the dispatcher's webhook kind, over a prebuilt body.
func floorClient() int {
	f := strings.Fields(os.Getenv(floorEnv))
	if len(f) != 5 {
		fmt.Fprintf(os.Stderr, "%s: want URL CALLS PARALLELISM BODY_BYTES SECRET_FILE\n", floorEnv)
		return 2
	}
	calls, err1 := strconv.Atoi(f[1])
	par, err2 := strconv.Atoi(f[2])
	size, err3 := strconv.Atoi(f[3])
	secret, err4 := os.ReadFile(f[4])
	if err := firstErr(err1, err2, err3, err4); err != nil || calls < 1 || par < 1 {
		fmt.Fprintf(os.Stderr, "%s %q: %v\n", floorEnv, os.Getenv(floorEnv), err)
		return 2
	}
	secret = bytes.TrimRight(secret, "\r\n")
	body := floorBody(size)
	client := handler.NewHTTPClient(par)
	var next atomic.Int64
	var failed atomic.Value
	var wg sync.WaitGroup
	for range par {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := next.Add(1); i <= int64(calls); i = next.Add(1) {
				if err := floorCall(client, f[0], i, body, secret); err != nil {
					failed.Store(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	if err, ok := failed.Load().(error); ok {
		fmt.Fprintf(os.Stderr, "webhook floor: %v\n", err)
		return 1
	}
	return 0
}

func firstErr(errs ...error) error {
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// floorBody is a JSON object of size bytes (at least its fixed part).
func floorBody(size int) []byte {
	const head, tail = `{"handler_id":"00000000-0000-4000-8000-000000000001","table":"public.orders","key":{"id":1},"pad":"`, `"}`
	return []byte(head + strings.Repeat("x", max(0, size-len(head)-len(tail))) + tail)
}

func floorCall(client *http.Client, url string, i int64, body, secret []byte) error {
	req, err := http.NewRequest(http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return fmt.Errorf("build request: %w", err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("User-Agent", "epitaph-projector")
	req.Header.Set(handler.HeaderDeliveryID, fmt.Sprintf("00000000-0000-4000-8000-%012d", i))
	req.Header.Set(handler.HeaderAttempt, "1")
	// Signed as the dispatcher signs: Standard Webhooks and the deprecated
	// Epitaph-Signature.
	id, now := req.Header.Get(handler.HeaderDeliveryID), time.Now()
	secrets, err := handler.ParseSecrets(secret)
	if err != nil {
		return fmt.Errorf("secret: %w", err)
	}
	sig, err := secrets.SignatureHeader(id, now, body)
	if err != nil {
		return fmt.Errorf("sign: %w", err)
	}
	req.Header.Set(handler.HeaderWebhookID, id)
	req.Header.Set(handler.HeaderWebhookTimestamp, strconv.FormatInt(now.Unix(), 10))
	req.Header.Set(handler.HeaderWebhookSignature, sig)
	req.Header.Set(handler.HeaderSignature, handler.Sign(secret, body))
	resp, err := client.Do(req)
	if err != nil {
		return fmt.Errorf("post: %w", err)
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("post: %s", resp.Status)
	}
	return nil
}

// busySince is how many of the machine's CPUs were busy (every process)
// since cpuBusy returned busy0, total0.
func busySince(busy0, total0 float64) (float64, error) {
	busy1, total1, err := cpuBusy()
	if err != nil {
		return 0, err
	}
	return float64(runtime.NumCPU()) * (busy1 - busy0) / max(total1-total0, 1), nil
}

// plainApply is the round's apply without handlers: the denominator of
// the ratios and the a of the limit.
type plainApply struct {
	rate float64
	cpu  cpuTimes // projector process and Postgres, from its start to archive count = N
	secs float64  // from the projector's start to archive count = N
	busy float64  // CPUs of the machine busy meanwhile (every process)
}

// limitInputs are the handlers round's measurements for the limit.
type limitInputs struct {
	n          int64
	plain      plainApply
	withCPU    cpuTimes // the apply with handlers (from its start to archive count = N)
	drainCPU   cpuTimes // from the last archived row to the last delivery done
	done0      int64    // deliveries received when the last row was archived
	bodySize   int
	floor      floorFigures
	deliveries float64 // deliveries/s from the projector's start
	wall       float64 // s from the projector's start to the last delivery done
	busy       float64 // CPUs of the machine busy meanwhile (every process)
}

// limit is what limitInputs allow, in µs of CPU per row or delivery.
type limit struct {
	a, q, d, dPG, dProc, dSrv, floor float64
	// ownBusy: the fraction of the CPUs the plain apply kept busy with
	// its own processes (u).
	ownBusy float64
	// ceilFloor a/(a+q+d_floor), ceilD a/(a+q+d), ceilIdle
	// C/(R_plain(a+q+d_floor)) = ceilFloor/u; a negative q counts as 0.
	ceilFloor, ceilD, ceilIdle float64
	verdict                    string
}

// bothTargets is deliveries / plain apply that the two targets need
// together: deliveries / apply >= 0.80 and apply with / without >= 0.85.
const bothTargets = 0.80 * 0.85

// derive computes the limit on cpus CPUs; false when no delivery was
// left for the drain (d not measured).
func (l limitInputs) derive(cpus float64) (limit, bool) {
	drained := l.n - l.done0
	if l.n == 0 || drained <= 0 || l.plain.rate == 0 || l.plain.secs == 0 {
		return limit{}, false
	}
	us := func(s float64, per int64) float64 { return s * 1e6 / float64(per) }
	all := func(c cpuTimes) float64 { return c.postgres + c.proc + c.bench }
	var m limit
	m.a = us(all(l.plain.cpu), l.n)
	m.dPG, m.dProc, m.dSrv = us(l.drainCPU.postgres, drained), us(l.drainCPU.proc, drained), us(l.drainCPU.bench, drained)
	m.d = m.dPG + m.dProc + m.dSrv
	// The apply with handlers' CPU also holds the deliveries done during
	// it (each at the drain's cost), taken out here.
	m.q = us(all(l.withCPU), l.n) - float64(l.done0)*m.d/float64(l.n) - m.a
	m.floor = l.floor.perCall() * 1e6
	q := max(m.q, 0)
	m.ownBusy = all(l.plain.cpu) / (cpus * l.plain.secs)
	m.ceilFloor, m.ceilD = m.a/(m.a+q+m.floor), m.a/(m.a+q+m.d)
	m.ceilIdle = m.ceilFloor / m.ownBusy
	switch {
	case m.ceilIdle < bothTargets:
		m.verdict = "NOT reachable by CPU on these cores even with idle CPU used"
	case m.ceilFloor < bothTargets:
		m.verdict = "reachable only with the CPU the plain apply leaves idle"
	default:
		m.verdict = "reachable by CPU"
	}
	return m, true
}

// record prints the limit's figures (µs of CPU per row or delivery).
func (l limitInputs) record(record func(string, float64, string)) {
	cpus := float64(runtime.NumCPU())
	m, ok := l.derive(cpus)
	if !ok {
		bench.Note("handlers: no delivery left after the last archived row: the drain's CPU per delivery, hence the limit, is not measured")
		return
	}
	us := func(s float64, per int64) float64 { return s * 1e6 / float64(per) }
	all := func(c cpuTimes) float64 { return c.postgres + c.proc + c.bench }
	qq := max(m.q, 0)
	record("limit.a_plain_apply_cpu_us_per_row", m.a, fmt.Sprintf("µs of CPU per archived row, plain apply (Postgres %.1f + projector %.1f + JetStream server %.1f)",
		us(l.plain.cpu.postgres, l.n), us(l.plain.cpu.proc, l.n), us(l.plain.cpu.bench, l.n)))
	record("limit.q_queueing_cpu_us_per_row", m.q, fmt.Sprintf("µs of CPU per row the handlers add to the apply (its CPU %.1f µs/row, less the %d deliveries done during it at d, less a)",
		us(all(l.withCPU), l.n), l.done0))
	record("limit.d_delivery_cpu_us_per_delivery", m.d, fmt.Sprintf("µs of CPU per delivery of the drain (Postgres %.1f + projector %.1f + webhook server %.1f; %d deliveries)", m.dPG, m.dProc, m.dSrv, l.n-l.done0))
	record("limit.floor_webhook_call_cpu_us", m.floor, fmt.Sprintf("µs of CPU per bare webhook POST (client %.1f + server %.1f; %d calls of %d bytes, signed, same transport, same parallelism)",
		l.floor.client*1e6/float64(max(l.floor.calls, 1)), l.floor.server*1e6/float64(max(l.floor.calls, 1)), l.floor.calls, l.bodySize))
	record("limit.ratio_ceiling_on_these_cores", m.ceilFloor, fmt.Sprintf("x of the plain apply rate: a/(a+q+d_floor) = %.1f/(%.1f+%.1f+%.1f), the apply CPU-bound; targets together need 0.80*0.85 = 0.68", m.a, m.a, qq, m.floor))
	record("limit.ratio_ceiling_measured_d", m.ceilD, fmt.Sprintf("x of the plain apply rate: a/(a+q+d) = %.1f/(%.1f+%.1f+%.1f), with this run's delivery CPU", m.a, m.a, qq, m.d))
	record("limit.ratio_ceiling_with_idle_cpu", m.ceilIdle, fmt.Sprintf("x of the plain apply rate: C/(R_plain*(a+q+d_floor)), the CPUs the plain apply left idle counted too (%d CPUs)", runtime.NumCPU()))
	record("limit.deliveries_to_plain_apply", l.deliveries/l.plain.rate, "x: deliveries/s of this round / the plain apply rate (what the ceilings bound; both targets need >= 0.68)")
	record("limit.plain_apply_own_cpus_busy", m.ownBusy*cpus, fmt.Sprintf("of %d CPUs: Postgres + projector + JetStream during the plain apply (a * rows / seconds)", runtime.NumCPU()))
	record("limit.plain_apply_machine_cpus_busy", l.plain.busy, fmt.Sprintf("of %d CPUs busy during the plain apply (the whole machine, other work included)", runtime.NumCPU()))
	record("limit.round_own_cpus_busy", (all(l.withCPU)+all(l.drainCPU))/l.wall, fmt.Sprintf("of %d CPUs: Postgres + projector + this process (JetStream, webhook server) from the projector's start to the last delivery", runtime.NumCPU()))
	record("limit.round_machine_cpus_busy", l.busy, fmt.Sprintf("of %d CPUs busy from the projector's start to the last delivery (the whole machine)", runtime.NumCPU()))
	bench.Note("handlers limit: deliveries reach at most %.2f (apply CPU-bound) or %.2f (idle CPU used) of the plain apply rate with d at its floor, %.2f with this run's d; both targets need 0.68: %s",
		m.ceilFloor, m.ceilIdle, m.ceilD, m.verdict)
	bench.Note("handlers limit: the plain apply kept %.2f of %d CPUs busy with its own processes (it leaves %.2f idle; the whole machine was %.2f busy meanwhile)",
		m.ownBusy*cpus, runtime.NumCPU(), cpus*(1-m.ownBusy), l.plain.busy)
}
