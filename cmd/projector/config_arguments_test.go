package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// TestConfigRunSettingDoesNotChangeHandlersAdd: the projector's --config
// file is read by every command, keys the flags' names. batch-size is a
// setting of run (EPITAPH_BATCH_SIZE, events per applied page); the
// same-named argument of handlers add (a webhook's POST batching, which
// changes the body the receiver gets) has no variable and is no setting.
// A file that tunes the worker must not turn every webhook added with it
// into a batching one, which EPITAPH_BATCH_SIZE does not either.
func TestConfigRunSettingDoesNotChangeHandlersAdd(t *testing.T) {
	t.Parallel()
	url := testenv.NewDatabase(t)
	cfg := filepath.Join(t.TempDir(), "projector.yaml")
	require.NoError(t, os.WriteFile(cfg, []byte("target-url: "+url+"\nbatch-size: 500\n"), 0o600))
	vars := map[string]string{"EPITAPH_CONFIG": cfg}
	code, _, stderr := projector(t, vars, "migrate")
	require.Equal(t, 0, code, stderr)
	const id = "0b7d3c2e-5a41-4c8e-9e0f-2d6a1b3c4d5e"
	code, _, stderr = projector(t, vars, "handlers", "add", "--id", id, "--table", "public.orders",
		"--kind", "webhook", "--target", "https://hooks.example/order-deleted")
	require.Equal(t, 0, code, stderr)
	code, out, stderr := projector(t, vars, "handlers", "show", id, "--json")
	require.Equal(t, 0, code, stderr)
	var h struct {
		Handler struct {
			BatchSize int `json:"batch_size"`
		} `json:"handler"`
		BatchSize *int `json:"batch_size"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &h), out)
	got := h.Handler.BatchSize
	if h.BatchSize != nil {
		got = *h.BatchSize
	}
	require.Equal(t, 1, got, "the run setting batch-size made the webhook a batching one:\n%s", out)
}
