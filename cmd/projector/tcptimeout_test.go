package main

import (
	"bytes"
	"context"
	"log/slog"
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
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

	err = deadPathFailsTheCommand(t, url, `%UPDATE epitaph.quarantine%`, proxy, lock, func() error {
		var out, errOut bytes.Buffer
		env := &Env{Getenv: func(k string) string {
			return map[string]string{"EPITAPH_TARGET_URL": testenv.NoSearchPath(viaProxy), "EPITAPH_TARGET_TCP_TIMEOUT": "2s",
				"EPITAPH_NATS_URL": "nats://127.0.0.1:1"}[k]
		}, Stdout: &out, Stderr: &errOut, Logger: slog.New(slog.DiscardHandler)}
		return dispatch(ctx, []string{"quarantine", "discard", strconv.FormatInt(id, 10), "--reason", "test"}, env)
	})
	require.Contains(t, err.Error(), "discard quarantine entry")
}

// deadPathFailsTheCommand runs command, whose statement matching query
// (ILIKE, in pg_stat_activity of the database at url) waits behind lock,
// then kills every path through proxy and releases lock, so the
// statement completes and its answer never arrives. The command must fail
// within 20 s; its error is returned.
func deadPathFailsTheCommand(t *testing.T, url, query string, proxy *testenv.FlowProxy, lock pgx.Tx, command func() error) error {
	t.Helper()
	ctx := context.Background()
	done := make(chan error, 1)
	go func() { done <- command() }()
	require.Eventually(t, func() bool {
		c, err := pgx.Connect(ctx, url)
		if err != nil {
			return false
		}
		defer c.Close(ctx)
		var n int
		return c.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query ILIKE $1`, query).Scan(&n) == nil && n == 1
	}, 20*time.Second, 20*time.Millisecond, "the command's statement waits behind the lock")
	require.Positive(t, proxy.BlackholeAllBut(t, 0), "the command's connection goes through the proxy")
	start := time.Now()
	require.NoError(t, lock.Rollback(ctx)) // the statement completes; its answer never arrives
	select {
	case err := <-done:
		require.Error(t, err, "the answer was lost with the path")
		t.Logf("the command failed %s after the path died: %v", time.Since(start).Round(time.Millisecond), err)
		return err
	case <-time.After(20 * time.Second):
		t.Fatal("the command still waits 20 s after its path died")
		return nil
	}
}
