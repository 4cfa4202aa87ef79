package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// The capture command, run as an operator runs it (embedded broker): its
// registry has the build info and the Go and process collectors, /livez
// and /readyz answer, and --log-format json logs one object per line.
func TestCaptureCommandServesProbesAndBuildInfo(t *testing.T) {
	url := testenv.NewDatabase(t)
	testenv.Exec(t, url, `CREATE TABLE public.orders (id int PRIMARY KEY, total numeric); ALTER TABLE public.orders REPLICA IDENTITY FULL`)
	port, err := testenv.FreePort()
	require.NoError(t, err)
	addr := "127.0.0.1:" + strconv.Itoa(port)
	slot := "cli_" + strconv.FormatInt(time.Now().UnixNano()%1e9, 10)
	vars := map[string]string{"EPITAPH_SOURCE_URL": url, "EPITAPH_NATS_URL": "", "EPITAPH_DATA_DIR": t.TempDir(),
		"EPITAPH_NATS_LISTEN": "127.0.0.1:0", "EPITAPH_METRICS_ADDR": addr, "EPITAPH_SLOT": slot, "EPITAPH_PUBLICATION": slot,
		"EPITAPH_LOG_FORMAT": "json", "GOGC": "100"}
	lookup := func(k string) (string, bool) { v, ok := vars[k]; return v, ok }
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	logs := &syncBuffer{}
	done := make(chan error, 1)
	finished := make(chan struct{})
	go func() { done <- execute(ctx, nil, lookup, io.Discard, logs); close(finished) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-finished:
		case <-time.After(60 * time.Second):
			t.Error("capture did not stop")
		}
		// The slot goes with the database (testenv ends its walsender
		// first): dropped here, it could still be active for a moment
		// after the capture stopped, and the drop failed the test.
	})

	get := func(path string) (int, string) {
		resp, err := http.Get("http://" + addr + path)
		if err != nil {
			return -1, err.Error()
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	deadline := time.Now().Add(90 * time.Second)
	for {
		if code, _ := get("/readyz"); code == 200 {
			break
		}
		select {
		case err := <-done:
			t.Fatalf("capture ended: %v\n%s", err, logs.String())
		default:
		}
		require.True(t, time.Now().Before(deadline), "capture not ready; logs:\n%s", logs.String())
		time.Sleep(100 * time.Millisecond)
	}
	code, _ := get("/livez")
	require.Equal(t, 200, code)
	code, _ = get("/healthz")
	require.Equal(t, 200, code)
	code, metrics := get("/metrics")
	require.Equal(t, 200, code)
	require.Regexp(t, `(?m)^epitaph_build_info\{commit="[^"]+",go_version="go1\.[^"]+",version="[^"]+"\} 1$`, metrics)
	require.Regexp(t, `(?m)^go_goroutines \d+`, metrics)
	require.Regexp(t, `(?m)^process_cpu_seconds_total `, metrics)
	require.Regexp(t, `(?m)^epitaph_capture_`, metrics)

	lines := strings.Split(strings.TrimSpace(logs.String()), "\n")
	require.NotEmpty(t, lines)
	for _, l := range lines {
		var rec map[string]any
		require.NoError(t, json.Unmarshal([]byte(l), &rec), "a log line that is not JSON: %s", l)
		require.Contains(t, rec, "msg")
	}
	cancel()
	select {
	case err := <-done:
		require.NoError(t, err, "a soft stop")
	case <-time.After(60 * time.Second):
		t.Fatal("capture did not stop")
	}
}
