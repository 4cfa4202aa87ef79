package handler

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"runtime/pprof"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestProfileDrain (EPITAPH_PROFILE_DRAIN=file) drains 20,000 signed
// webhook deliveries through a started dispatcher and writes a CPU profile
// of the drain (diagnostics, not a check).
func TestProfileDrain(t *testing.T) {
	out := os.Getenv("EPITAPH_PROFILE_DRAIN")
	if out == "" {
		t.Skip("EPITAPH_PROFILE_DRAIN not set")
	}
	e := newTenv(t)
	var hits atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		hits.Add(1)
		w.WriteHeader(http.StatusOK)
	}))
	defer srv.Close()
	secret := filepath.Join(t.TempDir(), "secret")
	require.NoError(t, os.WriteFile(secret, []byte("s\n"), 0o600))
	e.addHandler(KindWebhook, srv.URL+"/hook", func(d *Def) { d.Revalidate = false; d.SecretFile = secret })
	const n = 20000
	for i := 0; i < n; i += 1000 {
		rows := make([]Row, 1000)
		for j := range rows {
			rows[j] = e.row(i + j + 1)
		}
		e.enqueue(1, rows...)
	}
	_, err := e.pool.Exec(context.Background(), `ANALYZE epitaph.deliveries`)
	require.NoError(t, err)
	f, err := os.Create(out)
	require.NoError(t, err)
	defer f.Close()
	require.NoError(t, pprof.StartCPUProfile(f))
	start := time.Now()
	d := e.dispatcher(Config{Parallelism: 4})
	require.NoError(t, d.Start(context.Background()))
	eventually(t, func() bool { return hits.Load() >= n }, fmt.Sprintf("%d calls", n))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, d.Stop(ctx))
	require.NoError(t, d.Wait())
	pprof.StopCPUProfile()
	t.Logf("%d deliveries in %s", n, time.Since(start))
}
