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
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/snapshot"
	"github.com/epitaph-dev/epitaph/projection/version"
	"github.com/epitaph-dev/epitaph/quarantine"
)

// Hold mode (EPITAPH_HOLD_ON_QUARANTINE, as for run) keeps the events of
// one source row in stream order. An event the projector could not decode
// (unknown_version) behind an open entry of the same row keeps its own
// category; after the upgrade, `quarantine replay --all --category
// unknown_version` (the guide's command) must not archive it ahead of the
// entry in front: it is held until that one is resolved, then replayed.
func TestQuarantineReplayInHoldModeKeepsRowOrderForEveryCategory(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testenv.NewDatabase(t)
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	defer pool.Close()
	require.NoError(t, migrations.Apply(ctx, pool))
	require.NoError(t, version.EnsureArchive(ctx, pool, 1, snapshot.DDL))

	body := func(lsn event.LSN, n int) []byte {
		b, err := event.Encode(&event.Event{Op: event.OpDelete, Source: "main", Schema: "public", Table: "orders",
			XID: int64(n), CommitLSN: lsn, CommitTime: time.Date(2026, 11, 30, 9, 0, n, 0, time.UTC), Identity: event.IdentityFull,
			Key: json.RawMessage(`{"id":9}`), Row: json.RawMessage(`{"id":9,"n":` + strconv.Itoa(n) + `}`)})
		require.NoError(t, err)
		return b
	}
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
	// Row 9's first delete was rejected; its second came in a wire version
	// the projector did not know then (this build decodes it).
	first := insert(5, quarantine.CategoryIncompatible, body(0x500, 1))
	second := insert(10, quarantine.CategoryUnknownVersion, body(0x900, 2))

	run := func(args ...string) (string, error) {
		var out, errOut bytes.Buffer
		env := &Env{Getenv: func(k string) string {
			return map[string]string{"EPITAPH_TARGET_URL": url, "EPITAPH_NATS_URL": "nats://127.0.0.1:1",
				"EPITAPH_HOLD_ON_QUARANTINE": "true"}[k]
		}, Stdout: &out, Stderr: &errOut, Logger: slog.New(slog.DiscardHandler)}
		err := dispatch(ctx, append([]string{"quarantine"}, args...), env)
		return out.String(), err
	}
	archived := func() []string {
		rows, err := pool.Query(ctx, `SELECT row->>'n' FROM archive_v1.rows ORDER BY archived_at, commit_lsn`)
		require.NoError(t, err)
		defer rows.Close()
		var out []string
		for rows.Next() {
			var n string
			require.NoError(t, rows.Scan(&n))
			out = append(out, n)
		}
		require.NoError(t, rows.Err())
		return out
	}

	out, err := run("replay", "--all", "--category", "unknown_version", "--json")
	require.Error(t, err, "an entry stays held: exit 1 (%s)", out)
	var res quarantine.ReplayResult
	require.NoError(t, json.Unmarshal([]byte(out), &res), out)
	require.Empty(t, archived(), "row 9's second delete is not archived ahead of its first (%s)", out)
	require.Equal(t, []int64{second}, res.Held, out)

	// The first is given up: the second is replayed now.
	_, err = run("discard", strconv.FormatInt(first, 10), "--reason", "rejected by design")
	require.NoError(t, err)
	out, err = run("replay", "--all", "--json")
	require.NoError(t, err, out)
	require.NoError(t, json.Unmarshal([]byte(out), &res), out)
	require.Equal(t, []int64{second}, res.Replayed, out)
	require.Equal(t, []string{"2"}, archived())
}
