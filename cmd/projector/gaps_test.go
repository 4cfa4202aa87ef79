package main

import (
	"bytes"
	"context"
	"log/slog"
	"strconv"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/cmd/internal/cli"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// A blank --reason (spaces only) is a usage error of `gaps ack`, exit 2,
// as `quarantine discard --reason " "` is: nothing is acknowledged, and a
// reason given afterwards acknowledges the gap.
func TestGapsAckBlankReasonIsAUsageError(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testenv.NewDatabase(t)
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	defer pool.Close()
	require.NoError(t, migrations.Apply(ctx, pool))
	require.NoError(t, version.EnsureArchive(ctx, pool, 1, nil))
	var id int64
	require.NoError(t, pool.QueryRow(ctx, `INSERT INTO archive_v1.gaps (kind, partition, from_lsn, to_lsn)
		VALUES ('lost_upstream', 0, '0/100', '0/200') RETURNING id`).Scan(&id))
	run := func(args ...string) (string, error) {
		var out, errOut bytes.Buffer
		env := &Env{Getenv: func(k string) string { return map[string]string{"EPITAPH_TARGET_URL": url}[k] },
			Stdout: &out, Stderr: &errOut, Logger: slog.New(slog.DiscardHandler)}
		err := dispatch(ctx, append([]string{"gaps"}, args...), env)
		return out.String(), err
	}
	_, err = run("ack", strconv.FormatInt(id, 10), "--reason", "   ")
	require.Error(t, err)
	require.Equal(t, cli.ExitUsage, cli.Code(err), "%v", err)
	var acked bool
	require.NoError(t, pool.QueryRow(ctx, `SELECT acknowledged_at IS NOT NULL FROM archive_v1.gaps WHERE id = $1`, id).Scan(&acked))
	require.False(t, acked)
	out, err := run("ack", strconv.FormatInt(id, 10), "--reason", "slot recreated; accepted")
	require.NoError(t, err)
	require.Contains(t, out, "slot recreated; accepted")
}
