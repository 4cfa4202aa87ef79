package observe

import (
	"context"
	"errors"
	"io"
	"net/http"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
)

// /livez and /readyz answer their own checks; /healthz keeps answering
// Healthy; /readyz falls back to Healthy when Ready is not given.
func TestProbes(t *testing.T) {
	t.Parallel()
	down := errors.New("target: connection refused")
	get := func(addr, path string) (int, string) {
		resp, err := http.Get("http://" + addr + path)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	start := func(cfg Config) string {
		cfg.Addr, cfg.Registry = "127.0.0.1:0", prometheus.NewRegistry()
		s := New(cfg)
		require.NoError(t, s.Start(context.Background()))
		t.Cleanup(func() { _ = s.Stop(context.Background()) })
		return s.Addr()
	}

	addr := start(Config{Healthy: func(context.Context) error { return down },
		Live: func(context.Context) error { return nil }})
	code, _ := get(addr, "/livez")
	require.Equal(t, 200, code)
	code, body := get(addr, "/readyz")
	require.Equal(t, 503, code)
	require.Contains(t, body, "connection refused")
	code, _ = get(addr, "/healthz")
	require.Equal(t, 503, code)

	addr = start(Config{Healthy: func(context.Context) error { return nil },
		Ready: func(context.Context) error { return down },
		Live:  func(context.Context) error { return errors.New("loop ended") }})
	code, body = get(addr, "/livez")
	require.Equal(t, 503, code)
	require.Contains(t, body, "loop ended")
	code, _ = get(addr, "/readyz")
	require.Equal(t, 503, code)
	code, _ = get(addr, "/healthz")
	require.Equal(t, 200, code)

	addr = start(Config{})
	for _, p := range []string{"/livez", "/readyz", "/healthz"} {
		code, _ = get(addr, p)
		require.Equal(t, 200, code, p)
	}
}
