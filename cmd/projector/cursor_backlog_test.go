package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// A cursor handler (a webhook batching without revalidation) has no
// delivery rows before its batches settle: `handlers show` counts its
// archived rows after its cursor as pending, with the oldest one's age
// and its cursor, and `deliveries list` lists them beside the queued
// ones, with the ids their deliveries carry, marked as from the archive.
func TestCursorHandlerBacklogInTheCommands(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testenv.NewDatabase(t)
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	require.NoError(t, migrations.Apply(ctx, pool))
	require.NoError(t, version.EnsureArchive(ctx, pool, 1, nil))
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := archive.EnsurePartitions(ctx, tx, archive.Schema(1), archive.DefaultPeriod, time.Now())
		return err
	}))
	run := func(args ...string) (string, error) {
		var out, errOut bytes.Buffer
		env := &Env{Getenv: func(k string) string {
			return map[string]string{"EPITAPH_TARGET_URL": url, "EPITAPH_NATS_URL": "nats://127.0.0.1:1"}[k]
		}, Stdout: &out, Stderr: &errOut, Logger: slog.New(slog.DiscardHandler)}
		err := dispatch(ctx, args, env)
		return out.String(), err
	}
	const id = "5d2f1c3a-7e4b-4a6c-9d8e-0f1a2b3c4d5e"
	out, err := run("handlers", "add", "--id", id, "--table", "public.orders", "--kind", "webhook",
		"--target", "https://example.invalid/hook", "--batch-size", "50", "--no-revalidate", "--json")
	require.NoError(t, err, out)

	var lsns []string
	for k := 1; k <= 3; k++ {
		lsn := fmt.Sprintf("0/%X", 0x1000+k*0x100)
		_, err := pool.Exec(ctx, `INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row, correlation_id,
			commit_lsn, commit_time, seq, archived_at)
			VALUES ('main', 'public', 'orders', $1::jsonb, $1::jsonb, 'main:' || $2, $2::pg_lsn, now(), 0, now() - interval '2 hours')`,
			fmt.Sprintf(`{"id": %d}`, k), lsn)
		require.NoError(t, err)
		lsns = append(lsns, lsn)
	}

	out, err = run("handlers", "show", id, "--json")
	require.NoError(t, err, out)
	var h struct {
		Deliveries map[string]float64     `json:"deliveries"`
		Oldest     float64                `json:"oldest_pending_age_seconds"`
		Cursor     *handler.CursorBacklog `json:"cursor"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &h), out)
	require.Equal(t, 3.0, h.Deliveries["pending"], out)
	require.Greater(t, h.Oldest, 7000.0, out)
	require.NotNil(t, h.Cursor, out)
	require.Equal(t, "0/0", h.Cursor.CommitLSN)
	require.Equal(t, int64(3), h.Cursor.Pending)

	out, err = run("handlers", "show", id)
	require.NoError(t, err, out)
	require.Regexp(t, `(?m)^deliveries pending:\s+3$`, out)
	require.Regexp(t, `(?m)^oldest pending:\s+2h0m`, out)
	require.Regexp(t, `(?m)^cursor:\s+0/0 seq`, out)
	require.Regexp(t, `(?m)^batch:\s+none claimed$`, out)

	out, err = run("deliveries", "list", "--handler", id, "--state", "pending", "--json")
	require.NoError(t, err, out)
	var ds []struct {
		ID          string          `json:"id"`
		State       string          `json:"state"`
		Key         json.RawMessage `json:"key"`
		FromArchive bool            `json:"from_archive"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &ds), out)
	require.Len(t, ds, 3, out)
	for i, d := range ds {
		require.Equal(t, handler.DeliveryID(id, "main", lsns[2-i], 0, 0), d.ID)
		require.Equal(t, "pending", d.State)
		require.True(t, d.FromArchive)
	}
	out, err = run("deliveries", "list")
	require.NoError(t, err, out)
	require.Contains(t, out, handler.DeliveryID(id, "main", lsns[0], 0, 0))
	require.Contains(t, out, "pending (archive)")
	out, err = run("deliveries", "list", "--state", "dead", "--json")
	require.NoError(t, err, out)
	require.JSONEq(t, `[]`, out)

	// Nothing is behind the archive's horizon (no partition has a
	// watermark): flush sends nothing, and says what it left.
	out, err = run("deliveries", "flush", "--timeout", "20s", "--json")
	require.NoError(t, err, out)
	require.JSONEq(t, `{"remaining": 0, "cursor_pending": 3, "cursor_pending_at_least": false}`, out)
	out, err = run("deliveries", "flush", "--timeout", "20s")
	require.NoError(t, err, out)
	require.Contains(t, out, "no queued deliveries left; 3 pending after cursor handlers' cursors")

	// Revoked: its rows after the cursor are stopped, and said so.
	out, err = run("handlers", "revoke", id)
	require.NoError(t, err, out)
	require.Contains(t, out, "3 open deliveries stopped as stop_revoked (the rows after its cursor among them; its cursor is deleted)")
	out, err = run("handlers", "show", id)
	require.NoError(t, err, out)
	require.Regexp(t, `(?m)^deliveries pending:\s+0$`, out)
	require.Regexp(t, `(?m)^cursor:\s+revoked`, out)
}
