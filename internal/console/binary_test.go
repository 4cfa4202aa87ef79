package console_test

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/bench"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// The projector binary serves the console next to the status page, behind
// the token of EPITAPH_HTTP_TOKEN_FILE: reads with it as the Basic
// password, writes only with it as a Bearer token.
func TestProjectorBinaryServesConsole(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	bins, err := bench.Build(ctx, t.TempDir(), "projector")
	require.NoError(t, err)
	url := testenv.NewDatabase(t)
	n := testenv.NewNATS(t)
	_, js := n.Connect(t)
	_, err = js.CreateStream(ctx, jetstream.StreamConfig{Name: event.StreamName("main"),
		Subjects: []string{event.StreamSubjects("main")}, Storage: jetstream.FileStorage,
		Metadata: map[string]string{event.MetaPartitions: "1", event.MetaSource: "main", event.MetaWireVersion: "1"}})
	require.NoError(t, err)
	port, err := testenv.FreePort()
	require.NoError(t, err)
	tokFile := filepath.Join(t.TempDir(), "token")
	require.NoError(t, os.WriteFile(tokFile, []byte(token), 0o600))
	p, err := bench.StartProc("projector", bins["projector"], []string{"EPITAPH_TARGET_URL=" + url, "EPITAPH_NATS_URL=" + n.URL,
		"EPITAPH_WORKER_ID=bin-console", "EPITAPH_LEASE_TTL=2s", fmt.Sprintf("EPITAPH_METRICS_ADDR=127.0.0.1:%d", port),
		"EPITAPH_HTTP_TOKEN_FILE=" + tokFile}, t.TempDir(), "run")
	require.NoError(t, err)
	t.Cleanup(func() {
		_ = p.Stop(10 * time.Second)
		if t.Failed() {
			t.Logf("projector log:\n%s", p.LogTail(4000))
		}
	})
	base := fmt.Sprintf("http://127.0.0.1:%d", port)
	get := func(auth string) (int, string) {
		req, err := http.NewRequest(http.MethodGet, base+"/console/?table=public.customers", nil)
		require.NoError(t, err)
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			return 0, err.Error()
		}
		defer res.Body.Close()
		b, _ := io.ReadAll(res.Body)
		return res.StatusCode, string(b)
	}
	var code int
	var body string
	require.Eventually(t, func() bool {
		code, body = get("Basic " + basic(token))
		return code == http.StatusNotFound // the archive is ready and has no such table
	}, 60*time.Second, 200*time.Millisecond, "the console answers: %d %s", code, body)
	require.Contains(t, body, "public.customers: the archive holds no row of it")
	code, _ = get("")
	require.Equal(t, http.StatusUnauthorized, code)

	req, err := http.NewRequest(http.MethodPost, base+"/console/api/erase", strings.NewReader(`{"table":"public.customers","key":{"id":1},"reason":"r"}`))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Basic "+basic(token))
	res, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	res.Body.Close()
	require.Equal(t, http.StatusUnauthorized, res.StatusCode, "a write never takes Basic credentials")
	require.NotContains(t, p.LogTail(100000), token)
}
