package statuspage_test

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/capture"
	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/bench"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// The projector binary serves the page at / next to /status, with the
// capture's slot lag from EPITAPH_CAPTURE_STATUS_URL, and the quarantine
// actions behind the token of EPITAPH_HTTP_TOKEN_FILE.
func TestProjectorBinaryServesPage(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	bins, err := bench.Build(ctx, t.TempDir(), "projector")
	require.NoError(t, err)
	url := testenv.NewDatabase(t)
	n := testenv.NewNATS(t)
	_, js := n.Connect(t)
	_, err = js.CreateStream(ctx, jetstream.StreamConfig{Name: event.StreamName(source),
		Subjects: []string{event.StreamSubjects(source)}, Storage: jetstream.FileStorage,
		Metadata: map[string]string{event.MetaPartitions: "2", event.MetaSource: source, event.MetaWireVersion: "1"}})
	require.NoError(t, err)

	// The capture's /status document, as the capture serves it.
	cs := capture.Status{Source: source, Slot: "epitaph", Active: true, LagBytes: 2048}
	capSrv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(cs)
	}))
	t.Cleanup(capSrv.Close)

	port, err := testenv.FreePort()
	require.NoError(t, err)
	tokFile := filepath.Join(t.TempDir(), "token")
	require.NoError(t, os.WriteFile(tokFile, []byte(pageToken), 0o600))
	p, err := bench.StartProc("projector", bins["projector"], []string{"EPITAPH_TARGET_URL=" + url, "EPITAPH_NATS_URL=" + n.URL,
		"EPITAPH_WORKER_ID=bin-page", "EPITAPH_LEASE_TTL=2s", fmt.Sprintf("EPITAPH_METRICS_ADDR=127.0.0.1:%d", port),
		"EPITAPH_CAPTURE_STATUS_URL=" + capSrv.URL + "/status", "EPITAPH_HTTP_TOKEN_FILE=" + tokFile}, t.TempDir(), "run")
	require.NoError(t, err)
	t.Cleanup(func() {
		_ = p.Stop(10 * time.Second)
		if t.Failed() {
			t.Logf("projector log:\n%s", p.LogTail(4000))
		}
	})

	var body string
	deadline := time.Now().Add(60 * time.Second)
	for {
		body = ""
		if resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/", port)); err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK && resp.Header.Get("Content-Type") == "text/html; charset=utf-8" {
				body = string(b)
			}
		}
		if strings.Count(body, `data-testid="owner">bin-page<`) == 2 && strings.Contains(body, `data-testid="snapshot-row"`) {
			break
		}
		require.True(t, time.Now().Before(deadline), "page never showed both partitions owned:\n%s", body)
		time.Sleep(200 * time.Millisecond)
	}
	require.Contains(t, body, `data-testid="version-state">live<`)
	require.Contains(t, body, `data-testid="capture-lag">2.0 KiB<`)
	require.Contains(t, body, `data-testid="snapshot-row" data-schema="archive_v1"`)
	require.Contains(t, body, `<b>bin-page</b>`)

	// /status still serves the JSON document.
	resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/status", port))
	require.NoError(t, err)
	defer resp.Body.Close()
	var st struct {
		Worker string `json:"worker"`
	}
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&st))
	require.Equal(t, "bin-page", st.Worker)

	// The actions: 401 without the token; with it they reach the
	// quarantine (no entry 424242 here).
	action := fmt.Sprintf("http://127.0.0.1:%d/quarantine/424242/discard", port)
	code, _ := post(t, action, "", `{"reason":"r"}`)
	require.Equal(t, http.StatusUnauthorized, code)
	code, out := post(t, action, "Bearer "+pageToken, `{"reason":"r"}`)
	require.Equal(t, http.StatusNotFound, code, "%v", out)
	require.Equal(t, "quarantine entry 424242 not found", out["error"])
	require.NotContains(t, p.LogTail(100000), pageToken, "the token is in the log")
}
