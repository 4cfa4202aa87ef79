package main

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/snapshot"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// `projector erasures` promises "when, who, why, what was removed where":
// its text listing says when each erasure was recorded, as --json does.
func TestErasuresListingSaysWhen(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testenv.NewDatabase(t)
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	defer pool.Close()
	require.NoError(t, migrations.Apply(ctx, pool))
	require.NoError(t, version.EnsureArchive(ctx, pool, 1, snapshot.DDL))
	_, err = pool.Exec(ctx, `INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row, correlation_id, commit_lsn, seq)
		VALUES ('main', 'public', 'customers', '{"id":42}', '{"id":42,"email":"ann@example.com"}', 'main:2:0/20', '0/20'::pg_lsn, 0)`)
	require.NoError(t, err)

	run := func(args ...string) string {
		t.Helper()
		var out, errOut bytes.Buffer
		env := &Env{Getenv: func(k string) string {
			return map[string]string{"EPITAPH_TARGET_URL": url, "EPITAPH_NATS_URL": "nats://127.0.0.1:1"}[k]
		}, Stdin: strings.NewReader(""), Stdout: &out, Stderr: &errOut, Logger: slog.New(slog.DiscardHandler)}
		require.NoError(t, dispatch(ctx, args, env), errOut.String())
		return out.String()
	}
	run("erase", "--table", "public.customers", "--key", `{"id":42}`, "--yes", "--actor", "dpo", "--reason", "request 12")
	var at time.Time
	require.NoError(t, pool.QueryRow(ctx, `SELECT created_at FROM epitaph.erasures WHERE id = 1`).Scan(&at))

	out := run("erasures")
	require.Contains(t, out, "erasure 1 of public.customers by key [id] by dpo at "+at.UTC().Format(time.RFC3339)+" (request 12), 1 run(s)",
		"the listing says when the erasure was recorded")
}
