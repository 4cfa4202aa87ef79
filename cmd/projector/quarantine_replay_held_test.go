package main

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/cmd/internal/cli"
	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/snapshot"
	"github.com/epitaph-dev/epitaph/projection/version"
	"github.com/epitaph-dev/epitaph/quarantine"
)

// `quarantine replay --all` that leaves entries held (behind an earlier
// open entry of their row, outside the filter or in hold mode) replayed
// nothing of them: like `replay <id>` of a held entry, it must exit 1 and
// say how many stay held, not exit 0 as if the filter's entries were done.
func TestQuarantineReplayAllExitsOneWhenEntriesStayHeld(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testenv.NewDatabase(t)
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	defer pool.Close()
	require.NoError(t, migrations.Apply(ctx, pool))
	require.NoError(t, version.EnsureArchive(ctx, pool, 1, snapshot.DDL))

	body := func(id string, lsn event.LSN) []byte {
		b, err := event.Encode(&event.Event{Op: event.OpDelete, Source: "main", Schema: "public", Table: "orders",
			XID: 9, CommitLSN: lsn, CommitTime: time.Date(2026, 11, 30, 9, 0, 0, 0, time.UTC), Identity: event.IdentityFull,
			Key: json.RawMessage(`{"id":` + id + `}`), Row: json.RawMessage(`{"id":` + id + `}`)})
		require.NoError(t, err)
		return b
	}
	insert := func(seq uint64, cat quarantine.Category, data []byte) {
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		require.NoError(t, quarantine.Insert(ctx, tx, quarantine.Entry{Projection: "archive", Version: 1, StreamSeq: seq,
			Subject: "epitaph.main.0.delete.public.orders", Data: data, Category: string(cat), Error: "test: " + string(cat)}))
		require.NoError(t, tx.Commit(ctx))
	}
	// Row 9: the first entry cannot be read; the second waits behind it.
	insert(5, quarantine.CategoryMalformed, []byte(`{"schema":"public","table":"orders","key":{"id":9},"v":"garbage"}`))
	insert(6, quarantine.CategoryHeld, body("9", 0x900))
	// Row 10: rejected first; the second in a wire version unknown then.
	insert(7, quarantine.CategoryIncompatible, body("10", 0xa00))
	insert(8, quarantine.CategoryUnknownVersion, body("10", 0xb00))

	for _, tc := range []struct {
		name string
		hold string
		args []string
	}{
		{"held entry behind one outside the filter", "false", []string{"--category", "held"}},
		{"hold mode", "true", []string{"--category", "unknown_version", "--json"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var out, errOut bytes.Buffer
			env := &Env{Getenv: func(k string) string {
				return map[string]string{"EPITAPH_TARGET_URL": url, "EPITAPH_NATS_URL": "nats://127.0.0.1:1",
					"EPITAPH_HOLD_ON_QUARANTINE": tc.hold}[k]
			}, Stdout: &out, Stderr: &errOut, Logger: slog.New(slog.DiscardHandler)}
			err := dispatch(ctx, append([]string{"quarantine", "replay", "--all"}, tc.args...), env)
			t.Logf("stdout: %s", out.String())
			require.Error(t, err, "an entry stays held, yet replay --all exits 0")
			require.Equal(t, cli.ExitError, cli.Code(err))
			require.Contains(t, err.Error(), "1 ")
			require.Contains(t, err.Error(), "held")
		})
	}
}
