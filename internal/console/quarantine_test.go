package console_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/console"
	"github.com/epitaph-dev/epitaph/internal/httptoken"
	"github.com/epitaph-dev/epitaph/internal/statuspage"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/projection"
)

// post sends a console write (JSON body) with the given headers and
// returns its status and body.
func post(t *testing.T, base, path, body string, header ...string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, base+path, strings.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	res, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	return res.StatusCode, string(b)
}

// TestConsoleReplaysQuarantine: a transaction whose first row comes in a
// wire version this build does not know is quarantined by the real
// projector (its other row archived); a replay without the token is 401
// and changes nothing; with the token, the console's replay (through the
// runtime's replay hook, taught the version) archives the row and
// resolves the entry, and a second replay of it is refused.
func TestConsoleReplaysQuarantine(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const src = "main"
	url := testenv.NewDatabase(t)
	ns := testenv.NewNATS(t)
	nc, js := ns.Connect(t)
	testenv.NewSourceStream(t, js, src)

	// Signed as a capture signs, so that the only thing wrong is the
	// row's wire version.
	signer := testenv.NewSignerV2()
	for _, m := range testenv.OrdersTx(t, src, event.LSN(0x5000100), time.Date(2026, 11, 30, 9, 0, 0, 0, time.UTC),
		testenv.FirstRowV2, `{"id":2,"total":"20.00"}`, `{"id":20,"total":"0.50"}`) {
		signer.Sign(m)
		require.NoError(t, nc.PublishMsg(m))
	}
	require.NoError(t, nc.Flush())

	svc, err := projection.New(projection.Config{
		TargetURL: url, NATSURL: ns.URL, SourceName: src, WorkerID: "w1",
		LeaseTTL: 3 * time.Second, BalanceInterval: 300 * time.Millisecond, FetchWait: 100 * time.Millisecond,
		StatusInterval: 300 * time.Millisecond, MaxBackoff: time.Second,
	}, projection.WithLogger(testLogger()), projection.WithRegistry(prometheus.NewRegistry()))
	require.NoError(t, err)
	require.NoError(t, svc.Start(ctx))
	t.Cleanup(func() { require.NoError(t, svc.Stop(context.Background())) })
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	count := func(sql string, args ...any) int {
		var n int
		if err := pool.QueryRow(ctx, sql, args...).Scan(&n); err != nil {
			return -1
		}
		return n
	}
	rows := func() []string {
		r, err := pool.Query(ctx, `SELECT concat_ws(' ', table_name, seq, key::text, row::text, (is_root IS NOT NULL)::text)
			FROM archive.rows ORDER BY seq`)
		require.NoError(t, err)
		defer r.Close()
		var out []string
		for r.Next() {
			var s string
			require.NoError(t, r.Scan(&s))
			out = append(out, s)
		}
		require.NoError(t, r.Err())
		return out
	}
	deadline := time.Now().Add(30 * time.Second)
	for count(`SELECT count(*) FROM epitaph.quarantine WHERE status = 'open' AND category = 'unknown_version'`) != 1 ||
		count(`SELECT count(*) FROM archive.rows`) != 1 {
		var entries string
		_ = pool.QueryRow(ctx, `SELECT coalesce(string_agg(category || ': ' || error, '; '), '') FROM epitaph.quarantine`).Scan(&entries)
		require.True(t, time.Now().Before(deadline), "the v2 row is quarantined, the other archived: %d rows, entries %q",
			count(`SELECT count(*) FROM archive.rows`), entries)
		time.Sleep(50 * time.Millisecond)
	}
	var id int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT id FROM epitaph.quarantine`).Scan(&id))
	before := rows()
	require.Equal(t, []string{`orders 1 {"id": 20} {"id": 20, "total": "0.50"} true`}, before)

	file := filepath.Join(t.TempDir(), "token")
	require.NoError(t, os.WriteFile(file, []byte(token), 0o600))
	tok, err := httptoken.Load(file)
	require.NoError(t, err)
	mux := http.NewServeMux()
	console.Register(mux, console.Config{DB: pool, Token: tok, Source: src, Logger: testLogger(),
		Quarantine: statuspage.QuarantineActions(pool, projection.ReplayFunc(projection.ReplayConfig{Decoder: testenv.V2Decoder()}))})
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)

	body := fmt.Sprintf(`{"action": "replay", "ids": [%d]}`, id)
	for _, h := range [][]string{nil, {"Authorization", "Bearer not-the-token-at-all-xx"}, {"Authorization", "Basic " + basic(token)}} {
		code, text := post(t, srv.URL, "/console/api/quarantine", body, h...)
		require.Equal(t, http.StatusUnauthorized, code, text)
	}
	require.Equal(t, before, rows(), "a refused replay archives nothing")
	require.Equal(t, 1, count(`SELECT count(*) FROM epitaph.quarantine WHERE status = 'open'`), "and leaves the entry open")

	code, text := post(t, srv.URL, "/console/api/quarantine", body, "Authorization", "Bearer "+token)
	require.Equal(t, http.StatusOK, code, text)
	var ans console.DeliveriesAnswer
	require.NoError(t, json.Unmarshal([]byte(text), &ans))
	require.Equal(t, console.DeliveriesAnswer{Action: "replay", Done: 1, Failed: map[string]string{}}, ans)
	require.Equal(t, []string{
		`orders 0 {"id": 2} {"id": 2, "total": "20.00"} true`,
		`orders 1 {"id": 20} {"id": 20, "total": "0.50"} true`,
	}, rows(), "the replayed row is archived once, its transaction's roots decided")
	var status, reason string
	require.NoError(t, pool.QueryRow(ctx, `SELECT status, resolution_reason FROM epitaph.quarantine WHERE id = $1`, id).Scan(&status, &reason))
	require.Equal(t, "replayed", status)
	require.Equal(t, "replayed", reason)

	// Again: the entry is resolved, so nothing is done and nothing doubles.
	code, text = post(t, srv.URL, "/console/api/quarantine", body, "Authorization", "Bearer "+token)
	require.Equal(t, http.StatusConflict, code, text)
	require.Len(t, rows(), 2)
}
