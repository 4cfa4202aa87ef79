package main

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/cmd/internal/cli"
	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// The handlers and deliveries commands against a real target: add
// validates (exit 2) and stores, list/show print snake_case JSON, flush
// runs a webhook to completion, a refused one is dead with a sanitized
// error, retry runs it again, discard gives one up, an unknown id exits 3.
func TestHandlersAndDeliveriesCommands(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testenv.NewDatabase(t)
	var refuse atomic.Bool
	refuse.Store(true)
	var calls atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		var b handler.Body
		_ = json.NewDecoder(r.Body).Decode(&b)
		if refuse.Load() && string(b.Key) == `{"id":2}` {
			w.WriteHeader(http.StatusUnprocessableEntity)
			return
		}
		w.WriteHeader(http.StatusOK)
	}))
	defer srv.Close()
	secret := filepath.Join(t.TempDir(), "secret")
	require.NoError(t, os.WriteFile(secret, []byte("k"), 0o600))
	run := func(args ...string) (string, error) {
		var out, errOut bytes.Buffer
		env := &Env{Getenv: func(k string) string {
			return map[string]string{"EPITAPH_TARGET_URL": url, "EPITAPH_NATS_URL": "nats://127.0.0.1:1"}[k]
		}, Stdout: &out, Stderr: &errOut, Logger: slog.New(slog.DiscardHandler)}
		err := dispatch(ctx, args, env)
		return out.String(), err
	}
	const id = "0b6f5e43-3d0e-4c2b-9a51-6f7f2a8c1e90"
	for _, bad := range [][]string{
		{"handlers", "add", "--id", "nope", "--table", "public.orders", "--kind", "webhook", "--target", srv.URL},
		{"handlers", "add", "--id", id, "--table", "orders", "--kind", "webhook", "--target", srv.URL},
		{"handlers", "add", "--id", id, "--table", "public.orders", "--kind", "ftp", "--target", srv.URL},
		{"handlers", "add", "--id", id, "--table", "public.orders", "--kind", "exec", "--target", "rm -rf /"},
		{"handlers", "add", "--id", id, "--table", "public.orders", "--kind", "webhook", "--target", srv.URL, "--phase", "later"},
		{"handlers", "add", "--id", id, "--table", "public.orders", "--kind", "webhook", "--target", srv.URL, "--secret-file", "/nonexistent"},
	} {
		_, err := run(bad...)
		require.Error(t, err, bad)
		require.Equal(t, cli.ExitUsage, cli.Code(err), "%v: %v", bad, err)
	}
	out, err := run("handlers", "add", "--id", id, "--table", "public.orders", "--kind", "webhook", "--target", srv.URL,
		"--columns", "blob", "--max-attempts", "2", "--backoff", "10ms", "--secret-file", secret, "--json",
		"--no-revalidate") // no source or archive rows here: revalidation would defer them (handler/revalidate tests it)
	require.NoError(t, err, out)
	var h map[string]any
	require.NoError(t, json.Unmarshal([]byte(out), &h))
	require.Equal(t, id, h["id"])
	require.Equal(t, "public", h["schema_name"])
	require.Equal(t, []any{"blob"}, h["columns"])
	require.Equal(t, "10ms", h["backoff"])
	_, err = run("handlers", "add", "--id", id, "--table", "public.orders", "--kind", "webhook", "--target", srv.URL)
	require.ErrorContains(t, err, "exists already")

	out, err = run("handlers", "list", "--json")
	require.NoError(t, err)
	var hs []map[string]any
	require.NoError(t, json.Unmarshal([]byte(out), &hs))
	require.Len(t, hs, 1)

	// Two archived rows' deliveries, as the live version's apply queues them.
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	defer pool.Close()
	_, err = pool.Exec(ctx, `INSERT INTO epitaph.projection_versions (projection, version, state, schema_name, partitions)
		VALUES ('archive', 1, 'live', 'archive_v1', 1)`)
	require.NoError(t, err)
	cache := handler.NewCache(pool, time.Millisecond)
	require.NoError(t, cache.Refresh(ctx))
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	var rows []handler.Row
	for i, k := range []string{`{"id":1}`, `{"id":2}`} {
		rows = append(rows, handler.Row{Source: "main", Schema: "public", Table: "orders", Key: json.RawMessage(k),
			Image: json.RawMessage(`{"blob":"x"}`), CorrelationID: "main:1:0/100", CommitLSN: "0/100", Seq: i, Verified: true, Committed: true})
	}
	_, err = handler.Enqueue(ctx, tx, cache, "archive", 1, rows)
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))

	out, err = run("deliveries", "flush", "--timeout", "1m", "--json")
	require.NoError(t, err, out)
	require.JSONEq(t, `{"remaining":0}`, out)
	out, err = run("deliveries", "list", "--state", "dead", "--json")
	require.NoError(t, err)
	var ds []map[string]any
	require.NoError(t, json.Unmarshal([]byte(out), &ds))
	require.Len(t, ds, 1)
	require.Regexp(t, `^type=\S+ code=http_422 diag=[0-9a-f]{12} cause=webhook answered 422 Unprocessable Entity$`, ds[0]["last_error"])
	deadID := ds[0]["id"].(string)
	require.NotContains(t, out, `"payload":`)
	out, err = run("deliveries", "list", "--state", "done", "--handler", id, "--table", "public.orders", "--json")
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal([]byte(out), &ds))
	require.Len(t, ds, 1)

	out, err = run("handlers", "show", id, "--json")
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal([]byte(out), &h))
	require.Equal(t, map[string]any{"pending": 0.0, "in_flight": 0.0, "done": 1.0, "stopped": 0.0, "dead": 1.0}, h["deliveries"])

	// retry: the scrubbed payload cannot be rebuilt without a live archive.
	_, err = run("deliveries", "retry", deadID)
	require.Error(t, err)
	require.Equal(t, cli.ExitNotEqual, cli.Code(err))
	_, err = pool.Exec(ctx, `CREATE SCHEMA archive_v1; CREATE TABLE archive_v1.rows (source text, commit_lsn pg_lsn, seq int, key jsonb, row jsonb);
		INSERT INTO archive_v1.rows VALUES ('main', '0/100', 1, '{"id":2}', '{"blob":"x","other":1}');
		CREATE OR REPLACE VIEW archive.rows AS SELECT * FROM archive_v1.rows`)
	require.NoError(t, err)
	refuse.Store(false)
	out, err = run("deliveries", "retry", deadID, "--json")
	require.NoError(t, err, out)
	out, err = run("deliveries", "show", deadID, "--payload", "--json")
	require.NoError(t, err)
	var d map[string]any
	require.NoError(t, json.Unmarshal([]byte(out), &d))
	require.Equal(t, "pending", d["state"])
	require.Equal(t, map[string]any{"key": map[string]any{"id": 2.0}, "columns": map[string]any{"blob": "x"}}, d["payload"])
	_, err = run("deliveries", "flush")
	require.NoError(t, err)
	out, err = run("deliveries", "show", deadID, "--json")
	require.NoError(t, err)
	d = nil
	require.NoError(t, json.Unmarshal([]byte(out), &d))
	require.Equal(t, "done", d["state"])
	require.True(t, d["payload_scrubbed"].(bool), "scrubbed once done")
	require.NotContains(t, d, "payload")
	require.EqualValues(t, 3, calls.Load(), "422 is permanent: one attempt, then the retry")

	_, err = run("deliveries", "discard", deadID)
	require.ErrorContains(t, err, "done or stopped already")
	_, err = run("deliveries", "show", "3f0c2b1e-9d7a-4c1b-a2e4-5f6a7b8c9d0e")
	require.Equal(t, cli.ExitNotEqual, cli.Code(err))
	_, err = run("deliveries", "show", "x")
	require.Equal(t, cli.ExitUsage, cli.Code(err))

	_, err = run("handlers", "disable", id)
	require.NoError(t, err)
	out, err = run("handlers", "list")
	require.NoError(t, err)
	require.Contains(t, out, "disabled")
	out, err = run("handlers", "revoke", id, "--json")
	require.NoError(t, err)
	require.JSONEq(t, `{"id":"`+id+`","stopped":0,"outcome":"stop_revoked"}`, out)
	_, err = run("handlers", "remove", id)
	require.NoError(t, err)
	_, err = run("handlers", "show", id)
	require.Equal(t, cli.ExitNotEqual, cli.Code(err))
}

// A webhook's secret file is checked when it is added (whsec_ or the old
// raw form), rotate-secret writes a new one that signs beside the old,
// and the URL's query and userinfo never reach output: list, show, their
// JSON, the dispatcher's log lines and the deliveries' last_error.
func TestHandlersSecretsAndRedaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testenv.NewDatabase(t)
	var logs bytes.Buffer
	run := func(args ...string) (string, string, error) {
		var out, errOut bytes.Buffer
		env := &Env{Getenv: func(k string) string {
			return map[string]string{"EPITAPH_TARGET_URL": url, "EPITAPH_NATS_URL": "nats://127.0.0.1:1"}[k]
		}, Stdout: &out, Stderr: &errOut, Logger: slog.New(slog.NewTextHandler(&logs, nil))}
		err := dispatch(ctx, args, env)
		return out.String(), errOut.String(), err
	}
	dir := t.TempDir()
	secret := handler.NewSecret()
	file := filepath.Join(dir, "hook.secret")
	require.NoError(t, os.WriteFile(file, []byte(secret+"\n"), 0o600))
	bad := filepath.Join(dir, "bad.secret")
	require.NoError(t, os.WriteFile(bad, []byte("whsec_!!SEKRIT!!\n"), 0o600))
	raw := filepath.Join(dir, "raw.secret")
	require.NoError(t, os.WriteFile(raw, []byte("old-raw-key\n"), 0o600))
	// Nothing listens here: every attempt fails in the transport, whose
	// error names the URL.
	srv := httptest.NewServer(http.NotFoundHandler())
	target := srv.URL + "/purge?api_key=SEKRIT&v=2"
	srv.Close()
	const id, rawID, plainID = "0b6f5e43-3d0e-4c2b-9a51-6f7f2a8c1e90", "1b6f5e43-3d0e-4c2b-9a51-6f7f2a8c1e90", "2b6f5e43-3d0e-4c2b-9a51-6f7f2a8c1e90"
	add := func(id, secretFile string) (string, string, error) {
		return run("handlers", "add", "--id", id, "--table", "public.orders", "--kind", "webhook", "--target", target,
			"--secret-file", secretFile, "--max-attempts", "1", "--no-revalidate")
	}
	_, _, err := add(id, bad)
	require.Equal(t, cli.ExitUsage, cli.Code(err), "%v", err)
	require.NotContains(t, err.Error(), "SEKRIT")
	_, stderr, err := add(id, file)
	require.NoError(t, err)
	require.Contains(t, stderr, "hidden in every output")
	require.NotContains(t, stderr, "SEKRIT")
	_, stderr, err = add(rawID, raw)
	require.NoError(t, err)
	require.Contains(t, stderr, "raw secret (deprecated)")
	require.NotContains(t, stderr, "old-raw-key")
	_, _, err = run("handlers", "add", "--id", plainID, "--table", "public.orders", "--kind", "webhook", "--target", "https://hooks.example/p")
	require.NoError(t, err)

	var outs []string
	for _, args := range [][]string{{"handlers", "list"}, {"handlers", "list", "--json"}, {"handlers", "show", id}, {"handlers", "show", id, "--json"}} {
		out, _, err := run(args...)
		require.NoError(t, err, args)
		require.Contains(t, out, "/purge?api_key=xxxxx", args) // & is \u0026 in JSON
		outs = append(outs, out)
	}
	out, _, err := run("handlers", "show", id)
	require.NoError(t, err)
	require.Contains(t, out, "one whsec_ secret")
	out, _, err = run("handlers", "show", rawID)
	require.NoError(t, err)
	require.Contains(t, out, "one raw secret (deprecated form")

	// rotate-secret: the new secret first, the old one until the window's end.
	_, _, err = run("handlers", "rotate-secret", plainID)
	require.Equal(t, cli.ExitUsage, cli.Code(err), "no secret file to rotate")
	out, _, err = run("handlers", "rotate-secret", id, "--window", "2h", "--json")
	require.NoError(t, err, out)
	var rot map[string]any
	require.NoError(t, json.Unmarshal([]byte(out), &rot))
	require.Equal(t, file, rot["secret_file"])
	until, err := time.Parse(time.RFC3339, rot["previous_signs_until"].(string))
	require.NoError(t, err)
	require.WithinDuration(t, time.Now().Add(2*time.Hour), until, 5*time.Second)
	s, err := handler.ReadSecrets(file)
	require.NoError(t, err)
	require.Len(t, s, 2)
	require.NotEqual(t, secret, handler.FormatSecret(s[0].Key))
	require.Equal(t, secret, handler.FormatSecret(s[1].Key))
	require.NotContains(t, out, handler.FormatSecret(s[0].Key), "no secret printed")
	out, _, err = run("handlers", "show", id)
	require.NoError(t, err)
	require.Contains(t, out, "2 whsec_ secrets: the previous one(s) also sign until "+until.UTC().Format(time.RFC3339))
	outs = append(outs, out)

	// A delivery whose attempt fails in the transport (its error quotes
	// the URL): neither the log nor last_error holds the query.
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	defer pool.Close()
	_, err = pool.Exec(ctx, `INSERT INTO epitaph.projection_versions (projection, version, state, schema_name, partitions)
		VALUES ('archive', 1, 'live', 'archive_v1', 1)`)
	require.NoError(t, err)
	cache := handler.NewCache(pool, time.Millisecond)
	require.NoError(t, cache.Refresh(ctx))
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	_, err = handler.Enqueue(ctx, tx, cache, "archive", 1, []handler.Row{{Source: "main", Schema: "public", Table: "orders",
		Key: json.RawMessage(`{"id":1}`), Image: json.RawMessage(`{"id":1}`), CorrelationID: "main:1:0/100", CommitLSN: "0/100",
		Verified: true, Committed: true}})
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	_, err = pool.Exec(ctx, `UPDATE epitaph.handlers SET enabled = (id = $1)`, id)
	require.NoError(t, err)
	_, _, err = run("deliveries", "flush", "--timeout", "1m")
	require.NoError(t, err)
	out, _, err = run("deliveries", "list", "--handler", id, "--json")
	require.NoError(t, err)
	var ds []map[string]any
	require.NoError(t, json.Unmarshal([]byte(out), &ds))
	require.Len(t, ds, 1)
	require.Equal(t, "dead", ds[0]["state"])
	require.Contains(t, ds[0]["last_error"], "code=http_transport")
	outs = append(outs, out, logs.String())
	require.Contains(t, logs.String(), "delivery attempt failed")

	// Batches: set, shown, and bounded.
	const batchID = "3b6f5e43-3d0e-4c2b-9a51-6f7f2a8c1e90"
	_, _, err = run("handlers", "add", "--id", batchID, "--table", "public.orders", "--kind", "webhook", "--target", "https://hooks.example/b",
		"--batch-size", "2000")
	require.Equal(t, cli.ExitUsage, cli.Code(err), "%v", err)
	_, _, err = run("handlers", "add", "--id", batchID, "--table", "public.orders", "--kind", "exec", "--target", `["/bin/true"]`,
		"--batch-size", "10")
	require.Equal(t, cli.ExitUsage, cli.Code(err), "%v", err)
	out, _, err = run("handlers", "add", "--id", batchID, "--table", "public.orders", "--kind", "webhook", "--target", "https://hooks.example/b",
		"--batch-size", "50", "--batch-wait", "250ms", "--json")
	require.NoError(t, err)
	var bh map[string]any
	require.NoError(t, json.Unmarshal([]byte(out), &bh))
	require.Equal(t, 50.0, bh["batch_size"])
	require.Equal(t, "250ms", bh["batch_wait"])
	out, _, err = run("handlers", "show", batchID)
	require.NoError(t, err)
	require.Contains(t, out, "up to 50 deliveries, a partial one after 250ms")
	for _, o := range outs {
		require.NotContains(t, o, "SEKRIT")
	}
}

// TestHandlersAddGeneratesID: handlers add without --id stores the handler
// under a random (version 4) UUID it prints; two such adds get two ids;
// revoke and remove say "revoked" and "removed".
func TestHandlersAddGeneratesID(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testenv.NewDatabase(t)
	run := func(args ...string) (string, error) {
		var out, errOut bytes.Buffer
		env := &Env{Getenv: func(k string) string {
			return map[string]string{"EPITAPH_TARGET_URL": url, "EPITAPH_NATS_URL": "nats://127.0.0.1:1"}[k]
		}, Stdout: &out, Stderr: &errOut, Logger: slog.New(slog.DiscardHandler)}
		err := dispatch(ctx, args, env)
		return out.String(), err
	}
	_, err := run("handlers", "add", "--table", "public.orders", "--kind", "webhook")
	require.Equal(t, cli.ExitUsage, cli.Code(err))
	require.ErrorContains(t, err, "handlers add needs --table, --kind and --target")

	added := regexp.MustCompile(`^added handler ([0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}) \(nats immediate\) for public\.orders\n` +
		`its id was generated: keep it for handlers show, disable, revoke and remove`)
	var ids []string
	for range 2 {
		out, err := run("handlers", "add", "--table", "public.orders", "--kind", "nats", "--target", "orders.deleted")
		require.NoError(t, err, out)
		m := added.FindStringSubmatch(out)
		require.NotNil(t, m, out)
		ids = append(ids, m[1])
	}
	require.NotEqual(t, ids[0], ids[1])
	out, err := run("handlers", "list", "--json")
	require.NoError(t, err)
	var hs []map[string]any
	require.NoError(t, json.Unmarshal([]byte(out), &hs))
	require.Len(t, hs, 2)
	require.ElementsMatch(t, ids, []string{hs[0]["id"].(string), hs[1]["id"].(string)}, "stored under the printed ids")

	out, err = run("handlers", "revoke", ids[0])
	require.NoError(t, err)
	require.Equal(t, "handler "+ids[0]+" revoked; 0 open deliveries stopped as stop_revoked\n", out)
	out, err = run("handlers", "remove", ids[0])
	require.NoError(t, err)
	require.Equal(t, "handler "+ids[0]+" removed; 0 open deliveries stopped as stop_completed\n", out)
	_, err = run("handlers", "show", ids[0])
	require.Equal(t, cli.ExitNotEqual, cli.Code(err), "removed")
}
