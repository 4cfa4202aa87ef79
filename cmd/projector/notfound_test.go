package main

import (
	"bytes"
	"context"
	"log/slog"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/cmd/internal/cli"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// An id that names nothing is one answer for every command that takes
// one: exit 3 ("the command worked and the answer is no", docs/cli), as
// `hold remove 99` and a missing handler or delivery already give, not 1
// (an error: the target unreachable, a failed operation).
func TestUnknownIDExitsThreeForEveryCommand(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testenv.NewDatabase(t)
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	defer pool.Close()
	require.NoError(t, migrations.Apply(ctx, pool))
	require.NoError(t, version.EnsureArchive(ctx, pool, 1, nil))
	for _, args := range [][]string{
		{"hold", "remove", "99"},
		{"gaps", "ack", "99", "--reason", "accepted"},
		{"quarantine", "show", "99"},
		{"quarantine", "discard", "99", "--reason", "given up"},
		{"quarantine", "replay", "99"},
	} {
		var out, errOut bytes.Buffer
		env := &Env{Getenv: func(k string) string {
			return map[string]string{"EPITAPH_TARGET_URL": url, "EPITAPH_NATS_URL": "nats://127.0.0.1:1"}[k]
		}, Stdout: &out, Stderr: &errOut, Logger: slog.New(slog.DiscardHandler)}
		err := dispatch(ctx, args, env)
		require.Error(t, err, "%v", args)
		require.Equal(t, cli.ExitNotEqual, cli.Code(err), "%v: %v", args, err)
	}
}
