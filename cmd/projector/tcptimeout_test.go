package main

import (
	"bytes"
	"context"
	"log/slog"
	"runtime"
	"strconv"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/quarantine"
)

// TestOneShotCommandGivesUpASilentlyDeadTarget: `quarantine discard`
// reaches the target through a proxy with --target-tcp-timeout 2s; its
// UPDATE waits behind a row lock the test holds, every path through the
// proxy dies silently (no FIN, no RST), and the lock is released, so the
// answer never arrives. The command fails within seconds with an error,
// instead of waiting for TCP keepalive to give up (about two and a half
// minutes with Go's probes; this test fails on its 20 s bound).
func TestOneShotCommandGivesUpASilentlyDeadTarget(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("TCP_USER_TIMEOUT and the proxy's socket filters are Linux's")
	}
	t.Parallel()
	ctx := context.Background()
	url := testenv.NewDatabase(t)
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	defer pool.Close()
	require.NoError(t, migrations.Apply(ctx, pool))
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, quarantine.Insert(ctx, tx, quarantine.Entry{Projection: "archive", Version: 1, StreamSeq: 7,
		Subject: "epitaph.main.0.delete.public.orders", Data: []byte("garbage"), Category: string(quarantine.CategoryMalformed), Error: "test"}))
	require.NoError(t, tx.Commit(ctx))
	var id int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT id FROM epitaph.quarantine`).Scan(&id))

	proxy, viaProxy := testenv.ProxiedURL(t, url)
	lock, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer lock.Rollback(ctx) //nolint:errcheck // released below; a no-op then
	_, err = lock.Exec(ctx, `SELECT 1 FROM epitaph.quarantine WHERE id = $1 FOR UPDATE`, id)
	require.NoError(t, err)

	err = testenv.AnswerLostOnADeadPath(t, url, `%UPDATE epitaph.quarantine%`, proxy, lock, func() error {
		var out, errOut bytes.Buffer
		env := &Env{Getenv: func(k string) string {
			return map[string]string{"EPITAPH_TARGET_URL": testenv.NoSearchPath(viaProxy), "EPITAPH_TARGET_TCP_TIMEOUT": "2s",
				"EPITAPH_NATS_URL": "nats://127.0.0.1:1"}[k]
		}, Stdout: &out, Stderr: &errOut, Logger: slog.New(slog.DiscardHandler)}
		return dispatch(ctx, []string{"quarantine", "discard", strconv.FormatInt(id, 10), "--reason", "test"}, env)
	})
	require.Error(t, err, "the answer was lost with the path")
	require.Contains(t, err.Error(), "discard quarantine entry")
}
