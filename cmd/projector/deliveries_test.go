package main

import (
	"encoding/json"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// TestFailedDeliveriesSayWhy runs the real projector with two webhooks on
// the archived table: one whose receiver is down (nothing listens on its
// port; its URL carries a token) and one that revalidates while the
// projector has no EPITAPH_SOURCE_URL. The first is dead with a readable
// cause in last_error, the projector's log line with its diagnostic id
// has the whole error (the token redacted) and `deliveries show` says
// where to look; the second fails each attempt naming EPITAPH_SOURCE_URL
// (it is never sent) instead of waiting for ever with no error.
func TestFailedDeliveriesSayWhy(t *testing.T) {
	t.Parallel()
	bin, url, n, js := startTarget(t, 1)
	port, err := testenv.FreePort()
	require.NoError(t, err)
	env := append(os.Environ(), "EPITAPH_TARGET_URL="+url, "EPITAPH_SOURCE_URL=", "EPITAPH_NATS_URL="+n.URL,
		"EPITAPH_WORKER_ID=hooks-1", "EPITAPH_METRICS_ADDR=127.0.0.1:"+strconv.Itoa(port), "EPITAPH_LOG_FORMAT=text")
	out, err := runBin(bin, env, "migrate")
	require.NoError(t, err, out)

	// A port nothing listens on: the attempt fails in the transport.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	dead := l.Addr().String()
	require.NoError(t, l.Close())
	var hits atomic.Int32
	live := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { hits.Add(1) }))
	defer live.Close()

	add := func(args ...string) string {
		t.Helper()
		out, err := runBin(bin, env, append([]string{"handlers", "add", "--table", "public.orders", "--kind", "webhook", "--json"}, args...)...)
		require.NoError(t, err, out)
		var h struct{ ID string }
		require.NoError(t, json.Unmarshal([]byte(out), &h), out)
		return h.ID
	}
	deadHook := add("--target", "http://"+dead+"/purge?token=SEKRIT", "--max-attempts", "1", "--no-revalidate")
	unsourced := add("--target", live.URL+"/purge", "--max-attempts", "2", "--backoff", "100ms")

	run := exec.Command(bin, "run")
	run.Env = env
	var logs syncBuffer
	run.Stdout, run.Stderr = &logs, &logs
	require.NoError(t, run.Start())
	t.Cleanup(func() { _ = run.Process.Kill(); _ = run.Wait() })
	publishTx(t, js, 0, event.LSN(0x5000100), 7)

	type delivery struct {
		ID        string  `json:"id"`
		HandlerID string  `json:"handler_id"`
		State     string  `json:"state"`
		Attempt   int     `json:"attempt"`
		LastError *string `json:"last_error"`
	}
	list := func(handlerID string) []delivery {
		t.Helper()
		out, err := runBin(bin, env, "deliveries", "list", "--handler", handlerID, "--json")
		require.NoError(t, err, out)
		var ds []delivery
		require.NoError(t, json.Unmarshal([]byte(out), &ds), out)
		return ds
	}
	waitDead := func(handlerID string) delivery {
		t.Helper()
		deadline := time.Now().Add(time.Minute)
		for {
			if ds := list(handlerID); len(ds) == 1 && ds[0].State == "dead" {
				return ds[0]
			}
			require.True(t, time.Now().Before(deadline), "handler %s has no dead delivery: %v\nprojector:\n%s", handlerID, list(handlerID), logs.String())
			time.Sleep(200 * time.Millisecond)
		}
	}

	d := waitDead(deadHook)
	require.NotNil(t, d.LastError)
	cause := "cause=dial tcp " + dead + ": connect: connection refused"
	require.Regexp(t, `^type=\*url\.Error code=http_transport diag=[0-9a-f]{12} `, *d.LastError)
	require.True(t, strings.HasSuffix(*d.LastError, cause), "a readable cause in last_error: %s", *d.LastError)
	diag := regexp.MustCompile(`diag=([0-9a-f]{12})`).FindStringSubmatch(*d.LastError)[1]
	var line string
	for _, l := range strings.Split(logs.String(), "\n") {
		if strings.Contains(l, "diag="+diag) {
			line = l
		}
	}
	require.NotEmpty(t, line, "no log line with diag=%s:\n%s", diag, logs.String())
	require.Contains(t, line, "delivery attempt failed")
	require.Contains(t, line, `Post \"http://`+dead+`/purge?token=xxxxx\": dial tcp `+dead+`: connect: connection refused`, line)
	require.NotContains(t, logs.String(), "SEKRIT")
	require.NotContains(t, logs.String(), `"id":7`, "no payload in the log")
	out, err = runBin(bin, env, "deliveries", "show", d.ID)
	require.NoError(t, err, out)
	require.Contains(t, out, cause)
	require.Contains(t, out, "full error:")
	require.Contains(t, out, "search the projector's log for diag="+diag)
	require.NotContains(t, out, "SEKRIT")

	u := waitDead(unsourced)
	require.Equal(t, 2, u.Attempt, "each attempt fails, then it is dead")
	require.NotNil(t, u.LastError)
	require.Contains(t, *u.LastError, "code=no_source_url")
	require.Contains(t, *u.LastError, "set EPITAPH_SOURCE_URL (--source-url) on the projector")
	require.Zero(t, hits.Load(), "nothing is sent unrevalidated")
	require.Contains(t, logs.String(), "no EPITAPH_SOURCE_URL (--source-url)", "the projector says so at start")
	out, err = runBin(bin, env, "deliveries", "show", u.ID)
	require.NoError(t, err, out)
	require.Contains(t, out, "EPITAPH_SOURCE_URL")
}
