package handler

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// A command handler (often a third-party script) gets the projector's
// environment without the projector's own settings and secrets: no
// EPITAPH_* variable (the source, target and NATS URLs carry passwords)
// and no libpq/pgx PG* variable (PGPASSWORD), while PATH, HOME, the locale
// and the variables the command needs of its own pass, with the delivery's
// id and attempt.
func TestExecEnvironmentHoldsNoProjectorSecret(t *testing.T) {
	e := newTenv(t)
	t.Setenv("EPITAPH_TARGET_URL", "postgres://epitaph:target-pw-5521@db/epitaph")
	t.Setenv("EPITAPH_SOURCE_URL", "postgres://shop:source-pw-5521@db/shop")
	t.Setenv("EPITAPH_NATS_URL", "nats://u:nats-pw-5521@nats:4222")
	t.Setenv("EPITAPH_DELIVERY_ID", "stale-delivery-id")
	t.Setenv("PGPASSWORD", "pg-pw-5521")
	t.Setenv("PGHOST", "db.internal")
	t.Setenv("BLOBSTORE_KEY", "the-command-s-own")
	t.Setenv("LC_ALL", "C.UTF-8")
	dir := t.TempDir()
	out := filepath.Join(dir, "env")
	script := filepath.Join(dir, "h.sh")
	require.NoError(t, os.WriteFile(script, []byte("#!/bin/sh\ncat >/dev/null\nenv > \"$1\"\n"), 0o755))
	target, _ := json.Marshal([]string{script, out})
	e.addHandler(KindExec, string(target))
	e.enqueue(1, e.row(1))
	e.flush(e.dispatcher(Config{}))
	ds := e.deliveries()
	require.Equal(t, StateDone, ds[0].State)
	var id string
	require.NoError(t, e.pool.QueryRow(context.Background(), `SELECT id::text FROM epitaph.deliveries`).Scan(&id))
	b, err := os.ReadFile(out)
	require.NoError(t, err)
	env := string(b)
	for _, secret := range []string{"target-pw-5521", "source-pw-5521", "nats-pw-5521", "pg-pw-5521", "PGHOST=", "stale-delivery-id"} {
		require.NotContains(t, env, secret, "the command's environment:\n%s", env)
	}
	for _, kept := range []string{"PATH=" + os.Getenv("PATH"), "BLOBSTORE_KEY=the-command-s-own", "LC_ALL=C.UTF-8",
		"EPITAPH_DELIVERY_ID=" + id, "EPITAPH_ATTEMPT=1"} {
		require.Contains(t, env, kept+"\n", "the command's environment:\n%s", env)
	}
}
