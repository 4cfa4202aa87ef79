package main

import (
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// outageProxy forwards TCP connections to a Postgres server until cut:
// then it drops every open connection and resets new ones, which is what a
// database outage looks like to its clients.
type outageProxy struct {
	l        net.Listener
	upstream string
	mu       sync.Mutex
	down     bool
	conns    map[net.Conn]bool
}

func newOutageProxy(t *testing.T, upstream string) *outageProxy {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &outageProxy{l: l, upstream: upstream, conns: map[net.Conn]bool{}}
	t.Cleanup(func() { l.Close(); p.cut() })
	go p.serve()
	return p
}

func (p *outageProxy) serve() {
	for {
		c, err := p.l.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		down := p.down
		p.mu.Unlock()
		if down {
			c.Close()
			continue
		}
		u, err := net.Dial("tcp", p.upstream)
		if err != nil {
			c.Close()
			continue
		}
		p.mu.Lock()
		p.conns[c], p.conns[u] = true, true
		p.mu.Unlock()
		go func() { _, _ = io.Copy(u, c); u.Close() }()
		go func() { _, _ = io.Copy(c, u); c.Close() }()
	}
}

func (p *outageProxy) cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.down = true
	for c := range p.conns {
		c.Close()
	}
	p.conns = map[net.Conn]bool{}
}

func (p *outageProxy) restore() {
	p.mu.Lock()
	p.down = false
	p.mu.Unlock()
}

func probeStatus(addr, path string) int {
	c := http.Client{Timeout: 10 * time.Second}
	resp, err := c.Get("http://" + addr + path)
	if err != nil {
		return -1
	}
	resp.Body.Close()
	return resp.StatusCode
}

// A target outage makes the worker unready (/readyz 503) but keeps it live
// (/livez 200), so Kubernetes takes it out of service without killing it;
// /healthz keeps its old meaning (the readiness check). When the target
// is back, the worker is ready again without a restart.
func TestProbesDuringTargetOutage(t *testing.T) {
	t.Parallel()
	bin, dbURL, n, _ := startTarget(t, 2)
	u, err := url.Parse(dbURL)
	require.NoError(t, err)
	proxy := newOutageProxy(t, u.Host)
	u.Host = proxy.l.Addr().String()
	port, err := testenv.FreePort()
	require.NoError(t, err)
	addr := "127.0.0.1:" + strconv.Itoa(port)
	env := append(os.Environ(), "EPITAPH_TARGET_URL="+u.String(), "EPITAPH_NATS_URL="+n.URL, "EPITAPH_WORKER_ID=probe-1",
		"EPITAPH_LEASE_TTL=2s", "EPITAPH_METRICS_ADDR="+addr, "EPITAPH_LOG_FORMAT=json")
	out, err := runBin(bin, env, "migrate")
	require.NoError(t, err, out)

	cmd := exec.Command(bin, "run")
	cmd.Env = env
	logs := &lockedBuffer{}
	cmd.Stdout, cmd.Stderr = logs, logs
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })

	waitFor := func(what string, cond func() bool) {
		t.Helper()
		deadline := time.Now().Add(90 * time.Second)
		for !cond() {
			require.True(t, time.Now().Before(deadline), "%s; logs:\n%s", what, logs.String())
			time.Sleep(100 * time.Millisecond)
		}
	}
	waitFor("ready", func() bool { return probeStatus(addr, "/readyz") == 200 })
	require.Equal(t, 200, probeStatus(addr, "/livez"))
	require.Equal(t, 200, probeStatus(addr, "/healthz"))

	// The registry has the build, Go runtime and process collectors.
	resp, err := http.Get("http://" + addr + "/metrics")
	require.NoError(t, err)
	metrics, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.NoError(t, err)
	require.Regexp(t, `(?m)^epitaph_build_info\{commit="[^"]+",go_version="go1\.[^"]+",version="[^"]+"\} 1$`, string(metrics))
	require.Regexp(t, `(?m)^go_goroutines \d+`, string(metrics))
	require.Regexp(t, `(?m)^process_cpu_seconds_total `, string(metrics))

	// EPITAPH_LOG_FORMAT=json: every log line is one JSON object.
	lines := strings.Split(strings.TrimSpace(logs.String()), "\n")
	require.NotEmpty(t, lines)
	running := false
	for _, l := range lines {
		var rec map[string]any
		require.NoError(t, json.Unmarshal([]byte(l), &rec), "a log line that is not JSON: %s", l)
		require.Contains(t, rec, "level")
		running = running || rec["msg"] == "projector running"
	}
	require.True(t, running, logs.String())

	proxy.cut()
	waitFor("unready during the outage", func() bool { return probeStatus(addr, "/readyz") == 503 })
	require.Equal(t, 503, probeStatus(addr, "/healthz"), "/healthz is the readiness check, as before")
	// Live all through the outage: sample it for a while.
	for i := 0; i < 20; i++ {
		require.Equal(t, 200, probeStatus(addr, "/livez"), "sample %d; logs:\n%s", i, logs.String())
		require.Equal(t, 503, probeStatus(addr, "/readyz"), "sample %d", i)
		time.Sleep(100 * time.Millisecond)
	}
	require.Nil(t, cmd.ProcessState, "the worker keeps running through the outage")

	proxy.restore()
	waitFor("ready again", func() bool { return probeStatus(addr, "/readyz") == 200 })
	require.Equal(t, 200, probeStatus(addr, "/livez"))
}

type lockedBuffer struct {
	mu sync.Mutex
	b  []byte
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.b = append(l.b, p...)
	return len(p), nil
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return string(l.b)
}
