package main

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/snapshot"
	"github.com/epitaph-dev/epitaph/projection/version"
	"github.com/epitaph-dev/epitaph/quarantine"
)

// `quarantine replay <id>` of a held entry (it waits behind an earlier open
// entry of the same row) replays nothing: it must not exit 0, as if the
// entry had been replayed (the status page answers 409 for the same case).
func TestQuarantineReplayOfAHeldEntryFails(t *testing.T) {
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
		Key: json.RawMessage(`{"id":9}`), Row: json.RawMessage(`{"id":9}`)})
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
	// The same row: the first entry cannot be read, the second waits behind it.
	insert(5, quarantine.CategoryMalformed, []byte(`{"schema":"public","table":"orders","key":{"id":9},"v":"garbage"}`))
	held := insert(6, quarantine.CategoryHeld, good)

	var out, errOut bytes.Buffer
	env := &Env{Getenv: func(k string) string {
		return map[string]string{"EPITAPH_TARGET_URL": url, "EPITAPH_NATS_URL": "nats://127.0.0.1:1"}[k]
	}, Stdout: &out, Stderr: &errOut, Logger: slog.New(slog.DiscardHandler)}
	err = dispatch(ctx, []string{"quarantine", "replay", strconv.FormatInt(held, 10)}, env)
	t.Logf("stdout: %s", out.String())

	r, serr := quarantine.Show(ctx, pool, held, false)
	require.NoError(t, serr)
	require.Equal(t, quarantine.StatusOpen, r.Status, "held: nothing was replayed")
	require.Error(t, err, "replay of a held entry replayed nothing, yet exits 0")
	require.Contains(t, err.Error(), "held")
}

// `quarantine list` shows at most --limit entries (1,000 by default): when
// more match, it must say so, not print the first 1,000 as if they were all.
func TestQuarantineListSaysWhenMoreEntriesMatchThanItShows(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testenv.NewDatabase(t)
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	defer pool.Close()
	require.NoError(t, migrations.Apply(ctx, pool))
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	for seq := uint64(1); seq <= 1001; seq++ {
		require.NoError(t, quarantine.Insert(ctx, tx, quarantine.Entry{Projection: "archive", Version: 1, StreamSeq: seq,
			Subject: "epitaph.main.0.delete.public.orders", Data: []byte("garbage"), Category: string(quarantine.CategoryMalformed),
			Error: "test"}))
	}
	require.NoError(t, tx.Commit(ctx))

	run := func(args ...string) (string, string) {
		var out, errOut bytes.Buffer
		env := &Env{Getenv: func(k string) string {
			return map[string]string{"EPITAPH_TARGET_URL": url}[k]
		}, Stdout: &out, Stderr: &errOut, Logger: slog.New(slog.DiscardHandler)}
		require.NoError(t, dispatch(ctx, append([]string{"quarantine", "list"}, args...), env))
		return out.String(), errOut.String()
	}
	out, errOut := run()
	require.Equal(t, 1001, bytes.Count([]byte(out), []byte("\n")), "a header and 1,000 entries")
	require.Contains(t, errOut, "more", "1,001 entries match, 1,000 are shown: say so")
	out, errOut = run("--json")
	var recs []quarantine.Record
	require.NoError(t, json.Unmarshal([]byte(out), &recs))
	require.Len(t, recs, 1000)
	require.Contains(t, errOut, "more")
	out, errOut = run("--limit", "0")
	require.Equal(t, 1002, bytes.Count([]byte(out), []byte("\n")), "all of them")
	require.Empty(t, errOut)
}

// deliveries list stops at --limit (1,000 by default) as quarantine list
// does, and says so when more match.
func TestDeliveriesListSaysWhenMoreMatchThanItShows(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testenv.NewDatabase(t)
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	defer pool.Close()
	require.NoError(t, migrations.Apply(ctx, pool))
	const id = "5b6f5e43-3d0e-4c2b-9a51-6f7f2a8c1e90"
	require.NoError(t, handler.Add(ctx, pool, handler.Def{ID: id, Schema: "public", Table: "orders", Kind: handler.KindNATS,
		Target: "orders.deleted", MaxAttempts: 3, Backoff: time.Second, ClaimTimeout: time.Minute}))
	_, err = pool.Exec(ctx, `INSERT INTO epitaph.deliveries (id, handler_id, source, commit_lsn, seq, schema_name, table_name, key,
			correlation_id, version, state, outcome, settled_at)
		SELECT gen_random_uuid(), $1, 'main', '0/1000', g, 'public', 'orders', jsonb_build_object('id', g), 'main:1:0/1000', 1,
		       'dead', 'test', now()
		FROM generate_series(1, 3) g`, id)
	require.NoError(t, err)

	run := func(args ...string) (string, string) {
		var out, errOut bytes.Buffer
		env := &Env{Getenv: func(k string) string {
			return map[string]string{"EPITAPH_TARGET_URL": url}[k]
		}, Stdout: &out, Stderr: &errOut, Logger: slog.New(slog.DiscardHandler)}
		require.NoError(t, dispatch(ctx, append([]string{"deliveries", "list"}, args...), env))
		return out.String(), errOut.String()
	}
	out, errOut := run("--limit", "2")
	require.Equal(t, 3, bytes.Count([]byte(out), []byte("\n")), "a header and 2 deliveries:\n%s", out)
	require.Contains(t, errOut, "more", "3 deliveries match, 2 are shown: say so")
	out, errOut = run("--limit", "2", "--json")
	var ds []handler.Info
	require.NoError(t, json.Unmarshal([]byte(out), &ds))
	require.Len(t, ds, 2)
	require.Contains(t, errOut, "more")
	out, errOut = run("--limit", "3")
	require.Equal(t, 4, bytes.Count([]byte(out), []byte("\n")), "all of them:\n%s", out)
	require.Empty(t, errOut)
}
