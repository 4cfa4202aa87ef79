package main

import (
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

func TestMain(m *testing.M) { testenv.MainNoLeaks(m) }

// The limit's arithmetic: a, q (the deliveries done during the apply taken
// out at d), d, the floor, and the three ceilings with their verdict.
func TestLimitFormula(t *testing.T) {
	// 1,000 rows: the plain apply 60 µs a row in 0.06 s on 2 CPUs (half
	// of them busy); with handlers 90 µs a row plus 200 deliveries done
	// during it at 100 µs; 800 drained at 100 µs (40 + 30 + 30); the
	// floor 50 µs a call.
	l := limitInputs{n: 1000, done0: 200,
		plain:    plainApply{rate: 1000 / 0.06, secs: 0.06, cpu: cpuTimes{postgres: 0.03, proc: 0.02, bench: 0.01}},
		withCPU:  cpuTimes{postgres: 0.06, proc: 0.04, bench: 0.01},
		drainCPU: cpuTimes{postgres: 0.032, proc: 0.024, bench: 0.024},
		floor:    floorFigures{calls: 1000, client: 0.02, server: 0.03}}
	m, ok := l.derive(2)
	require.True(t, ok)
	require.InDelta(t, 60, m.a, 1e-6)
	require.InDelta(t, 100, m.d, 1e-6)
	require.InDelta(t, 40, m.dPG, 1e-6)
	require.InDelta(t, 30, m.dSrv, 1e-6)
	require.InDelta(t, 30, m.q, 1e-6, "110 µs a row, less 200 × 100 µs over 1,000 rows, less a")
	require.InDelta(t, 50, m.floor, 1e-6)
	require.InDelta(t, 0.5, m.ownBusy, 1e-9)
	require.InDelta(t, 60.0/140, m.ceilFloor, 1e-9)
	require.InDelta(t, 60.0/190, m.ceilD, 1e-9)
	require.InDelta(t, 60.0/140/0.5, m.ceilIdle, 1e-9, "C / (R_plain (a+q+d_floor))")
	require.InDelta(t, 2/((1000/0.06)*140e-6), m.ceilIdle, 1e-9)
	require.Equal(t, "reachable only with the CPU the plain apply leaves idle", m.verdict)

	// A q measured below 0 (noise) counts as 0 in the ceilings.
	l.withCPU = cpuTimes{postgres: 0.05}
	m, ok = l.derive(2)
	require.True(t, ok)
	require.Negative(t, m.q)
	require.InDelta(t, 60.0/110, m.ceilFloor, 1e-9)

	// The apply CPU-bound (on one CPU, its 0.06 s of CPU in 0.06 s): the
	// idle ceiling is the CPU-bound one, under 0.68.
	m, _ = l.derive(1)
	require.InDelta(t, 1, m.ownBusy, 1e-9)
	require.InDelta(t, m.ceilFloor, m.ceilIdle, 1e-9)
	require.Equal(t, "NOT reachable by CPU on these cores even with idle CPU used", m.verdict)

	// Nothing left for the drain: d is not measured, no limit.
	l.done0 = l.n
	_, ok = l.derive(2)
	require.False(t, ok)
}

// The floor's call carries what a webhook attempt carries: the body of the
// size asked for, the same headers and a signature of the body.
func TestFloorCallSendsTheWebhookHeaders(t *testing.T) {
	var mu sync.Mutex
	var got http.Header
	var body []byte
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		got, body = r.Header.Clone(), b
		mu.Unlock()
		w.WriteHeader(http.StatusOK)
	}))
	defer srv.Close()
	client := handler.NewHTTPClient(4)
	defer client.CloseIdleConnections()
	secret := []byte(benchSecret)
	require.NoError(t, floorCall(client, srv.URL+"/hook", 7, floorBody(300), secret))
	mu.Lock()
	defer mu.Unlock()
	require.Len(t, body, 300)
	require.Equal(t, "application/json", got.Get("Content-Type"))
	require.Equal(t, "epitaph-projector", got.Get("User-Agent"))
	require.Equal(t, "00000000-0000-4000-8000-000000000007", got.Get(handler.HeaderDeliveryID))
	require.Equal(t, "1", got.Get(handler.HeaderAttempt))
	require.Equal(t, handler.Sign(secret, body), got.Get(handler.HeaderSignature))
	require.Len(t, floorBody(10), len(floorBody(0)), "never shorter than its fixed part")
}
