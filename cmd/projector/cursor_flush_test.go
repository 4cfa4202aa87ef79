package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// deliveries flush delivers a cursor handler's rows of the source named by
// --source-name (a cursor handler's pending rows are the archived rows of
// its source), and counts what remains of them; handlers remove stops its
// pending rows, deletes its cursor and says so.
func TestCursorHandlerFlushAndRemoveCommands(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testenv.NewDatabase(t)
	var got atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var b handler.BatchBody
		_ = json.NewDecoder(r.Body).Decode(&b)
		got.Add(int32(len(b.Deliveries)))
		w.WriteHeader(http.StatusOK)
	}))
	defer srv.Close()
	secret := filepath.Join(t.TempDir(), "secret")
	require.NoError(t, os.WriteFile(secret, []byte(handler.NewSecret()), 0o600))
	run := func(args ...string) (string, error) {
		var out, errOut bytes.Buffer
		env := &Env{Getenv: func(k string) string {
			return map[string]string{"EPITAPH_TARGET_URL": url, "EPITAPH_NATS_URL": "nats://127.0.0.1:1"}[k]
		}, Stdout: &out, Stderr: &errOut, Logger: slog.New(slog.DiscardHandler)}
		err := dispatch(ctx, args, env)
		return out.String(), err
	}
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	defer pool.Close()
	require.NoError(t, migrations.Apply(ctx, pool))
	require.NoError(t, version.EnsureArchive(ctx, pool, 1, nil))
	out, err := run("handlers", "add", "--id", "0b6f5e43-3d0e-4c2b-9a51-6f7f2a8c1e91", "--table", "public.orders",
		"--kind", "webhook", "--target", srv.URL, "--batch-size", "10", "--no-revalidate", "--secret-file", secret)
	require.NoError(t, err, out)
	for i, lsn := range []string{"0/100", "0/200"} {
		_, err = pool.Exec(ctx, `INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row, correlation_id,
			commit_lsn, commit_time, seq, verified) VALUES ('other', 'public', 'orders', $1::jsonb, '{}', 'c', $2::pg_lsn, now(), 0, true)`,
			fmt.Sprintf(`{"id":%d}`, i+1), lsn)
		require.NoError(t, err)
	}
	_, err = pool.Exec(ctx, `UPDATE epitaph.progress SET source_lsn = '0/200' WHERE projection = 'archive'`)
	require.NoError(t, err)

	out, err = run("deliveries", "flush", "--timeout", "1m", "--json", "--source-name", "other")
	require.NoError(t, err, out)
	require.JSONEq(t, `{"remaining":0}`, out)
	require.EqualValues(t, 2, got.Load(), "the rows of source other")

	// remove says what it did with the cursor and its pending row.
	_, err = pool.Exec(ctx, `INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row, correlation_id,
		commit_lsn, commit_time, seq, verified) VALUES ('other', 'public', 'orders', '{"id":3}', '{}', 'c', '0/300', now(), 0, true)`)
	require.NoError(t, err)
	out, err = run("handlers", "remove", "0b6f5e43-3d0e-4c2b-9a51-6f7f2a8c1e91")
	require.NoError(t, err, out)
	require.Equal(t, "handler 0b6f5e43-3d0e-4c2b-9a51-6f7f2a8c1e91 removed; 1 open deliveries stopped as stop_completed"+
		" (the rows after its cursor among them; its cursor is deleted)\n", out)
	var cursors int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM epitaph.handler_cursors`).Scan(&cursors))
	require.Zero(t, cursors)
}
