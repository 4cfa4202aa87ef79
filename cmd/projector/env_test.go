package main

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"testing"

	"github.com/stretchr/testify/require"
)

// A malformed setting is refused with a message naming it, never replaced
// by a default (which would hide the misconfiguration).
func TestBadEnvironmentIsRefused(t *testing.T) {
	t.Parallel()
	vars := map[string]string{
		"EPITAPH_TARGET_URL":    "postgres://nobody@127.0.0.1:1/none",
		"EPITAPH_LEASE_TTL":     "fifteen seconds",
		"EPITAPH_BATCH_SIZE":    "lots",
		"EPITAPH_REBUILD_SHARE": "half",

		"EPITAPH_HOLD_ON_QUARANTINE": "sometimes",
		"EPITAPH_MAX_ROW_BYTES":      "1GB",
	}
	var stderr bytes.Buffer
	env := &Env{Getenv: func(k string) string { return vars[k] }, Stdout: io.Discard, Stderr: &stderr,
		Logger: slog.New(slog.DiscardHandler)}
	err := dispatch(context.Background(), []string{"run"}, env)
	require.Error(t, err)
	require.Contains(t, err.Error(), `EPITAPH_LEASE_TTL="fifteen seconds" is not a duration`)
	require.Contains(t, err.Error(), `EPITAPH_BATCH_SIZE="lots" is not an integer`)
	require.Contains(t, err.Error(), `EPITAPH_REBUILD_SHARE="half" is not a number`)
	require.Contains(t, err.Error(), `EPITAPH_HOLD_ON_QUARANTINE="sometimes" is not a boolean (true or false)`)
	require.Contains(t, err.Error(), `EPITAPH_MAX_ROW_BYTES="1GB" is not an integer`)

	env = &Env{Getenv: func(k string) string {
		if k == "EPITAPH_SNAPSHOT_MAX_ATTEMPTS" {
			return "8x"
		}
		return vars[k]
	}, Stdout: io.Discard, Stderr: &stderr, Logger: slog.New(slog.DiscardHandler)}
	err = dispatch(context.Background(), []string{"snapshots", "batch"}, env)
	require.ErrorContains(t, err, `EPITAPH_SNAPSHOT_MAX_ATTEMPTS="8x" is not an integer`)
}

// Contradictory NATS credentials are refused before anything connects.
func TestNATSAuthFlagsAreChecked(t *testing.T) {
	t.Parallel()
	vars := map[string]string{"EPITAPH_TARGET_URL": "postgres://nobody@127.0.0.1:1/none", "EPITAPH_NATS_NKEY": "/x/seed"}
	env := &Env{Getenv: func(k string) string { return vars[k] }, Stdout: io.Discard, Stderr: io.Discard, Logger: slog.New(slog.DiscardHandler)}
	for _, cmd := range [][]string{{"run", "--nats-creds", "/x/c.creds"}, {"status", "--nats-creds", "/x/c.creds"}, {"quarantine", "list", "--nats-creds", "/x/c.creds"}} {
		err := dispatch(context.Background(), cmd, env)
		require.ErrorContains(t, err, "NATS credentials given twice (--nats-creds, --nats-nkey)", "%v", cmd)
	}
}
