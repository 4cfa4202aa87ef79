package console_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/console"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// Without a token the console (on loopback) shows deleted rows only to
// requests addressed to a loopback host: a web page whose name an attacker
// rebinds to 127.0.0.1 (DNS rebinding) cannot read them through the
// operator's browser.
func TestConsoleWithoutTokenRefusesAnotherHost(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, testenv.NewDatabase(t))
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	require.NoError(t, migrations.Apply(ctx, pool))
	require.NoError(t, version.EnsureArchive(ctx, pool, 1, nil))
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := archive.EnsurePartitions(ctx, tx, archive.Schema(1), archive.DefaultPeriod, time.Now())
		return err
	}))
	const value = "deleted-value-4412@example.com"
	_, err = pool.Exec(ctx, `INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row, correlation_id,
		commit_lsn, commit_time, seq, archived_at)
		VALUES ('main', 'public', 'notes', '{"id": 1}', '{"id": 1, "body": "`+value+`"}', 'main:1:0/1100', '0/1100', now(), 0, now())`)
	require.NoError(t, err)
	mux := http.NewServeMux()
	console.Register(mux, console.Config{DB: pool, Source: "main", Logger: testLogger()})
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	u, err := url.Parse(srv.URL)
	require.NoError(t, err)
	port := u.Port()
	get := func(host string) (int, string) {
		t.Helper()
		req, err := http.NewRequest(http.MethodGet, srv.URL+"/console/tx?"+url.Values{"correlation_id": {"main:1:0/1100"}}.Encode(), nil)
		require.NoError(t, err)
		req.Host = host
		res, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		defer res.Body.Close()
		b, err := io.ReadAll(res.Body)
		require.NoError(t, err)
		return res.StatusCode, string(b)
	}
	for _, host := range []string{"127.0.0.1:" + port, "localhost:" + port, "[::1]:" + port} {
		code, body := get(host)
		require.Equal(t, http.StatusOK, code, "%s: %s", host, body)
		require.Contains(t, body, value, host)
	}
	for _, host := range []string{"rebind.attacker.example:" + port, "127.0.0.1.attacker.example:" + port} {
		code, body := get(host)
		require.Equal(t, http.StatusForbidden, code, "%s: %s", host, body)
		require.NotContains(t, body, value, host)
		require.Contains(t, body, "--http-token-file", host)
	}
}
