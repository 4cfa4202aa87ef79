package main

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/snapshot"
	"github.com/epitaph-dev/epitaph/projection/version"
	"github.com/epitaph-dev/epitaph/quarantine"
)

// The quarantine subcommands against a real target: list filters, show
// hides the payload unless asked, discard needs a reason, replay applies
// with this build's decoder exactly once and reports what still fails.
func TestQuarantineCommands(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testenv.NewDatabase(t)
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	defer pool.Close()
	require.NoError(t, migrations.Apply(ctx, pool))
	require.NoError(t, version.EnsureArchive(ctx, pool, 1, snapshot.DDL))

	good, err := event.Encode(&event.Event{Op: event.OpDelete, Source: "main", Schema: "public", Table: "orders",
		XID: 9, CommitLSN: 0x900, CommitTime: time.Date(2026, 11, 30, 9, 0, 0, 0, time.UTC), Identity: event.IdentityFull,
		Key: json.RawMessage(`{"id":9}`), Row: json.RawMessage(`{"id":9,"secret":"s3cr3t"}`)})
	require.NoError(t, err)
	insert := func(seq uint64, cat quarantine.Category, data []byte) int64 {
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		require.NoError(t, quarantine.Insert(ctx, tx, quarantine.Entry{Projection: "archive", Version: 1, StreamSeq: seq,
			Subject: "epitaph.main.0.delete.public.orders", Data: data, Category: string(cat), Error: "test: " + string(cat)}))
		require.NoError(t, tx.Commit(ctx))
		var id int64
		require.NoError(t, pool.QueryRow(ctx, `SELECT id FROM epitaph.quarantine WHERE stream_seq = $1`, int64(seq)).Scan(&id))
		return id
	}
	// An event quarantined as incompatible that this build now applies.
	fixed := insert(5, quarantine.CategoryIncompatible, good)
	garbage := insert(6, quarantine.CategoryMalformed, []byte("garbage"))

	var lastStderr string
	run := func(args ...string) (string, error) {
		var out, errOut bytes.Buffer
		defer func() { lastStderr = errOut.String() }()
		env := &Env{Getenv: func(k string) string {
			return map[string]string{"EPITAPH_TARGET_URL": url, "EPITAPH_NATS_URL": "nats://127.0.0.1:1"}[k]
		}, Stdout: &out, Stderr: &errOut, Logger: slog.New(slog.DiscardHandler)}
		err := dispatch(ctx, append([]string{"quarantine"}, args...), env)
		return out.String(), err
	}
	id := func(n int64) string { return strconv.FormatInt(n, 10) }

	out, err := run("list")
	require.NoError(t, err)
	require.Contains(t, out, "incompatible")
	require.Contains(t, out, "malformed")
	out, err = run("list", "--category", "malformed", "--json")
	require.NoError(t, err)
	var recs []quarantine.Record
	require.NoError(t, json.Unmarshal([]byte(out), &recs))
	// One snake_case schema, as the other --json outputs.
	var raw []map[string]any
	require.NoError(t, json.Unmarshal([]byte(out), &raw))
	require.Len(t, raw, 1)
	require.EqualValues(t, 6, raw[0]["stream_seq"], out)
	require.Equal(t, "malformed", raw[0]["category"], out)
	require.NotContains(t, out, "StreamSeq")
	require.Len(t, recs, 1)
	require.Equal(t, garbage, recs[0].ID)
	_, err = run("list", "--category", "nope")
	require.Error(t, err)

	out, err = run("show", id(fixed))
	require.NoError(t, err)
	require.Contains(t, out, "public.orders {\"id\": 9}")
	require.NotContains(t, out, "s3cr3t", "payload only on request")
	out, err = run("show", id(fixed), "--payload")
	require.NoError(t, err)
	require.Contains(t, out, "s3cr3t")
	_, err = run("show", "999999")
	require.ErrorIs(t, err, quarantine.ErrNotFound)

	// Replay everything: the fixed event is archived, the garbage fails.
	out, err = run("replay", "--all")
	require.Error(t, err, "an entry still fails")
	require.Contains(t, out, "replayed 1, still failing 1")
	// Progress on stderr (lines, not a terminal), ending at the total.
	require.Regexp(t, `replaying \[[#-]*\]\s+[\d.]+%\s+2/2 entries`, lastStderr)
	var n int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM archive_v1.rows WHERE key = '{"id":9}'`).Scan(&n))
	require.Equal(t, 1, n)
	_, err = run("replay", id(fixed))
	require.ErrorIs(t, err, quarantine.ErrNotOpen, "replayed exactly once")
	out, err = run("replay", id(garbage), "--json")
	require.Error(t, err, "still failing")
	var res struct {
		Replayed []int64 `json:"replayed"`
		Failed   []int64 `json:"failed"`
		Held     []int64 `json:"held"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &res), out)
	require.Equal(t, []int64{garbage}, res.Failed)
	require.Empty(t, res.Replayed)
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM archive_v1.rows`).Scan(&n))
	require.Equal(t, 1, n)

	_, err = run("discard", id(garbage))
	require.Error(t, err, "a reason is required")
	out, err = run("discard", id(garbage), "--reason", "hand-published by mistake")
	require.NoError(t, err)
	require.Contains(t, out, "discarded")
	out, err = run("list")
	require.NoError(t, err)
	require.Contains(t, out, "(no entries)")
	out, err = run("list", "--status", "all")
	require.NoError(t, err)
	require.Equal(t, 2, strings.Count(out, "archive"))
	require.Contains(t, out, "discarded")
	require.Contains(t, out, "replayed")
}
