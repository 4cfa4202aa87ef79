package console_test

import (
	"context"
	"encoding/base64"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/console"
	"github.com/epitaph-dev/epitaph/internal/httptoken"
	"github.com/epitaph-dev/epitaph/internal/statuspage"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
)

// TestConsoleWritesNeedToken: every write is 401 without the Bearer token
// (none, another, the token as Basic credentials or a cookie or in the
// URL), 403 when another site starts it, and changes nothing; reads need
// the token too (Bearer or Basic); without a token configured the writes
// are off.
func TestConsoleWritesNeedToken(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, testenv.NewDatabase(t))
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	require.NoError(t, migrations.Apply(ctx, pool))
	_, err = pool.Exec(ctx, `INSERT INTO epitaph.quarantine (projection, version, partition, stream_seq, subject, data, category, error,
		source_schema, source_table, source_key) VALUES ('archive', 1, 0, 7, 'epitaph.main.delete.0', 'x', 'decode',
		'cannot decode <b>bold</b>', 'public', '<script>q=1</script>', '{"id": 1}');
		INSERT INTO epitaph.workers (worker_id, heartbeat_at, lease_ttl) VALUES
		  ('gone', now() - interval '10 minutes', interval '3 seconds'), ('alive', now(), interval '1 hour')`)
	require.NoError(t, err)
	file := filepath.Join(t.TempDir(), "token")
	require.NoError(t, os.WriteFile(file, []byte(token), 0o600))
	tok, err := httptoken.Load(file)
	require.NoError(t, err)
	mux := http.NewServeMux()
	console.Register(mux, console.Config{DB: pool, Token: tok, Source: "main", SourceURL: "postgres://127.0.0.1:1/none",
		Quarantine: statuspage.QuarantineActions(pool, nil), Logger: testLogger()})
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	open := http.NewServeMux()
	console.Register(open, console.Config{DB: pool, Source: "main", Logger: testLogger()})
	openSrv := httptest.NewServer(open)
	t.Cleanup(openSrv.Close)

	do := func(base, method, path, body string, header ...string) (int, http.Header, string) {
		t.Helper()
		req, err := http.NewRequest(method, base+path, strings.NewReader(body))
		require.NoError(t, err)
		if body != "" {
			req.Header.Set("Content-Type", "application/json")
		}
		for i := 0; i+1 < len(header); i += 2 {
			req.Header.Set(header[i], header[i+1])
		}
		res, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		defer res.Body.Close()
		b, err := io.ReadAll(res.Body)
		require.NoError(t, err)
		return res.StatusCode, res.Header, string(b)
	}
	writes := map[string]string{
		"/console/api/restore":       `{"correlation_id": "main:1:0/1", "dry_run": false}`,
		"/console/api/erase":         `{"table": "public.customers", "key": {"id": 1}, "reason": "r"}`,
		"/console/api/deliveries":    `{"action": "retry", "all": true, "filter": {"state": "dead"}}`,
		"/console/api/holds":         `{"table": "public.customers", "key": {"id": 1}, "reason": "r"}`,
		"/console/api/holds/remove":  `{"id": 1, "reason": "r"}`,
		"/console/api/quarantine":    `{"action": "discard", "ids": [1], "reason": "r"}`,
		"/console/api/workers/prune": `{"older_than": "1m"}`,
	}
	bearer := "Bearer " + token
	for path, body := range writes {
		for name, header := range map[string][]string{
			"no token":      nil,
			"another token": {"Authorization", "Bearer not-the-token-at-all-xx"},
			"basic":         {"Authorization", "Basic " + basic(token)},
			"cookie":        {"Cookie", "token=" + token},
			"no scheme":     {"Authorization", token},
		} {
			code, h, text := do(srv.URL, http.MethodPost, path, body, header...)
			require.Equal(t, http.StatusUnauthorized, code, "%s %s: %s", path, name, text)
			require.Contains(t, h.Get("WWW-Authenticate"), "Bearer")
			require.NotContains(t, text, token)
		}
		code, _, _ := do(srv.URL+"", http.MethodPost, path+"?token="+token, body)
		require.Equal(t, http.StatusUnauthorized, code, "%s: the token in the URL", path)
		code, _, _ = do(srv.URL, http.MethodPost, path, body, "Authorization", bearer, "Sec-Fetch-Site", "cross-site")
		require.Equal(t, http.StatusForbidden, code, "%s: another site", path)
		code, _, _ = do(srv.URL, http.MethodPost, path, body, "Authorization", bearer, "Origin", "https://evil.example")
		require.Equal(t, http.StatusForbidden, code, "%s: another origin", path)
		code, _, _ = do(srv.URL, http.MethodPost, path, "", "Authorization", bearer)
		require.Equal(t, http.StatusUnsupportedMediaType, code, "%s: not JSON (a plain form)", path)
		code, _, text := do(openSrv.URL, http.MethodPost, path, body, "Authorization", bearer)
		require.Equal(t, http.StatusUnauthorized, code, "%s without a configured token", path)
		require.Contains(t, text, "writes are off")
	}
	var restores, erasures, holds int
	require.NoError(t, pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM epitaph.restores), (SELECT count(*) FROM epitaph.erasures),
		(SELECT count(*) FROM epitaph.legal_holds)`).Scan(&restores, &erasures, &holds))
	require.Zero(t, holds, "no hold was added")
	var stillOpen int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM epitaph.quarantine WHERE status = 'open'`).Scan(&stillOpen))
	require.Equal(t, 1, stillOpen, "the quarantine entry is still open")
	require.Zero(t, restores, "nothing was restored")
	require.Zero(t, erasures, "nothing was erased")

	// With the token and a same-origin browser request, the write runs:
	// an erasure without a reason is refused as such.
	code, _, text := do(srv.URL, http.MethodPost, "/console/api/erase", `{"table": "public.customers", "key": {"id": 1}}`,
		"Authorization", bearer, "Sec-Fetch-Site", "same-origin", "Origin", srv.URL)
	require.Equal(t, http.StatusBadRequest, code, text)
	require.Contains(t, text, "needs a reason")

	// Reads: the token as Bearer or as the Basic password.
	code, h, _ := do(srv.URL, http.MethodGet, "/console/", "")
	require.Equal(t, http.StatusUnauthorized, code)
	require.Contains(t, h.Get("WWW-Authenticate"), "Basic")
	code, _, _ = do(srv.URL, http.MethodGet, "/console/", "", "Authorization", "Basic "+basic("wrong-token-wrong-token"))
	require.Equal(t, http.StatusUnauthorized, code)
	code, _, text = do(srv.URL, http.MethodGet, "/console/", "", "Authorization", "Basic "+basic(token))
	require.Equal(t, http.StatusOK, code, text)
	require.Contains(t, text, "Search the live archive")
	code, _, text = do(srv.URL, http.MethodGet, "/console/failed", "", "Authorization", bearer)
	require.Equal(t, http.StatusOK, code, text)
	require.Contains(t, text, `public.&lt;script&gt;q=1&lt;/script&gt;`, "the entry's table, escaped")
	require.Contains(t, text, `cannot decode &lt;b&gt;bold&lt;/b&gt;`)
	require.NotContains(t, text, "<script>q=1")

	// With the token: a discard needs a reason, then resolves the entry.
	code, _, text = do(srv.URL, http.MethodPost, "/console/api/quarantine", `{"action": "discard", "ids": [1]}`, "Authorization", bearer)
	require.Equal(t, http.StatusBadRequest, code, text)
	code, _, text = do(srv.URL, http.MethodPost, "/console/api/quarantine", `{"action": "discard", "ids": [1], "reason": "bad bytes"}`, "Authorization", bearer)
	require.Equal(t, http.StatusOK, code, text)
	require.Contains(t, text, `"done":1`)
	var status, reason string
	require.NoError(t, pool.QueryRow(ctx, `SELECT status, resolution_reason FROM epitaph.quarantine WHERE id = 1`).Scan(&status, &reason))
	require.Equal(t, "discarded", status)
	require.Equal(t, "bad bytes (by console)", reason)

	// Dead workers: listed as such, then removed; the live one stays.
	code, _, text = do(srv.URL, http.MethodGet, "/console/failed", "", "Authorization", bearer)
	require.Equal(t, http.StatusOK, code)
	require.Regexp(t, `gone</td>.*dead`, text)
	code, _, text = do(srv.URL, http.MethodPost, "/console/api/workers/prune", `{"older_than": "5s"}`, "Authorization", bearer)
	require.Equal(t, http.StatusBadRequest, code, text)
	code, _, text = do(srv.URL, http.MethodPost, "/console/api/workers/prune", `{"older_than": "1m"}`, "Authorization", bearer)
	require.Equal(t, http.StatusOK, code, text)
	require.Contains(t, text, `"removed":1`)
	var workers []string
	rows, err := pool.Query(ctx, `SELECT worker_id FROM epitaph.workers ORDER BY worker_id`)
	require.NoError(t, err)
	workers, err = pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{"alive"}, workers)
}

func basic(password string) string {
	return base64.StdEncoding.EncodeToString([]byte("support:" + password))
}
