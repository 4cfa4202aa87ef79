package main

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/cmd/internal/cli"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/erasure"
	"github.com/epitaph-dev/epitaph/projection/snapshot"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// hold, cleanup, erase and erasures against a real target: usage errors
// exit 2, a missing hold 3; the receipt never shows the erased value.
func TestForgetCommands(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testenv.NewDatabase(t)
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	defer pool.Close()
	require.NoError(t, migrations.Apply(ctx, pool))
	require.NoError(t, version.EnsureArchive(ctx, pool, 1, snapshot.DDL))
	_, err = pool.Exec(ctx, `INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row, correlation_id, commit_lsn, seq, expires_at)
		SELECT 'main', 'public', 'sessions', jsonb_build_object('id', i), jsonb_build_object('id', i), 'main:1:0/10', '0/10'::pg_lsn, i,
		       now() - interval '1 hour' FROM generate_series(1, 5) i
		UNION ALL
		SELECT 'main', 'public', 'customers', '{"id":42}', '{"id":42,"email":"ann@example.com"}', 'main:2:0/20', '0/20'::pg_lsn, 0, NULL`)
	require.NoError(t, err)

	run := func(args ...string) (string, error) {
		var out, errOut bytes.Buffer
		env := &Env{Getenv: func(k string) string {
			return map[string]string{"EPITAPH_TARGET_URL": url, "EPITAPH_NATS_URL": "nats://127.0.0.1:1"}[k]
		}, Stdin: strings.NewReader(""), Stdout: &out, Stderr: &errOut, Logger: slog.New(slog.DiscardHandler)}
		err := dispatch(ctx, args, env)
		return out.String() + errOut.String(), err
	}

	_, err = run("hold", "add", "--table", "public.sessions", "--key", `{"id":1}`)
	require.Equal(t, 2, cli.Code(err), "no reason")
	_, err = run("hold", "add", "--table", "public.sessions", "--key", `{"id":1}`, "--match", `{"id":1}`, "--reason", "r")
	require.Equal(t, 2, cli.Code(err), "key and match")
	_, err = run("hold", "add", "--table", "sessions", "--key", `{"id":1}`, "--reason", "r")
	require.Equal(t, 2, cli.Code(err), "no schema")
	out, err := run("hold", "add", "--table", "public.sessions", "--key", `{"id":1}`, "--reason", "case 7", "--actor", "legal")
	require.NoError(t, err, out)
	require.Contains(t, out, "legal hold 1 on public.sessions added")
	out, err = run("hold", "list", "--json")
	require.NoError(t, err)
	var hs []map[string]any
	require.NoError(t, json.Unmarshal([]byte(out), &hs))
	require.Len(t, hs, 1)
	require.Equal(t, "legal", hs[0]["created_by"])

	out, err = run("cleanup", "--batch", "3", "--json")
	require.NoError(t, err, out)
	var res map[string]any
	require.NoError(t, json.Unmarshal([]byte(out), &res))
	require.EqualValues(t, 3, res["deleted"])
	require.Equal(t, true, res["full"])
	out, err = run("cleanup")
	require.NoError(t, err, out)
	require.Contains(t, out, "deleted 1 expired rows")
	var left int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM archive_v1.rows WHERE table_name = 'sessions'`).Scan(&left))
	require.Equal(t, 1, left, "the held one")

	_, err = run("erase", "--table", "public.customers", "--match", `{"email":"ann@example.com"}`)
	require.Equal(t, 2, cli.Code(err), "no --yes off a terminal")
	_, err = run("erase", "--table", "public.customers", "--match", `{"email":`, "--yes")
	require.Equal(t, 2, cli.Code(err), "bad JSON")
	// A legal hold on Ann: the erase is refused and changes nothing.
	out, err = run("hold", "add", "--table", "public.customers", "--match", `{"email":"ann@example.com"}`, "--reason", "case 9")
	require.NoError(t, err, out)
	out, err = run("erase", "--table", "public.customers", "--match", `{"email":"ann@example.com"}`, "--yes")
	require.Equal(t, 3, cli.Code(err), out)
	require.Contains(t, err.Error(), "hold 2")
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM epitaph.erasures`).Scan(&left))
	require.Equal(t, 0, left)
	out, err = run("hold", "remove", "2")
	require.NoError(t, err, out)
	// A quarantine entry that cannot be decoded and matches nothing that
	// can be read of it: the receipt says it could not be checked.
	_, err = pool.Exec(ctx, `INSERT INTO epitaph.quarantine (projection, version, partition, stream_seq, subject, data, category, error)
		VALUES ('archive', 1, 0, 1, 'x', '\x00ff'::bytea, 'malformed', 'x')`)
	require.NoError(t, err)
	out, err = run("erase", "--table", "public.customers", "--match", `{"email":"ann@example.com"}`, "--yes", "--actor", "dpo", "--reason", "request 12")
	require.NoError(t, err, out)
	require.Contains(t, out, "erasure 1 of public.customers by match [email] by dpo (request 12), 1 run(s): removed")
	require.Contains(t, out, "archive_v1.rows 1")
	require.Contains(t, out, "could not check epitaph.quarantine 1 (undecodable")
	require.NotContains(t, out, "ann@example.com")
	out, err = run("erasures", "--json")
	require.NoError(t, err)
	require.NotContains(t, out, "ann@example.com")
	var rs []erasure.Receipt
	require.NoError(t, json.Unmarshal([]byte(out), &rs))
	require.Len(t, rs, 1)
	require.Equal(t, 1, rs[0].Removed["archive_v1.rows"])
	require.Equal(t, map[string]int{"epitaph.quarantine": 1}, rs[0].Unchecked)
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM archive_v1.rows WHERE table_name = 'customers'`).Scan(&left))
	require.Equal(t, 0, left)

	_, err = run("hold", "remove", "99")
	require.Equal(t, 3, cli.Code(err))
	out, err = run("hold", "remove", "1")
	require.NoError(t, err, out)
	out, err = run("cleanup", "--json")
	require.NoError(t, err, out)
	require.NoError(t, json.Unmarshal([]byte(out), &res))
	require.EqualValues(t, 1, res["deleted"])
}
