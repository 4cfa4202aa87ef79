package console_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/console"
	"github.com/epitaph-dev/epitaph/internal/httptoken"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/erasure"
)

// syncBuffer is a log destination the test reads while the server writes.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

// records are the log's JSON records whose message is msg.
func (b *syncBuffer) records(t *testing.T, msg string) []map[string]any {
	t.Helper()
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []map[string]any
	for _, line := range strings.Split(strings.TrimSpace(b.buf.String()), "\n") {
		if line == "" {
			continue
		}
		var rec map[string]any
		require.NoError(t, json.Unmarshal([]byte(line), &rec), line)
		if rec["msg"] == msg {
			out = append(out, rec)
		}
	}
	return out
}

// TestConsoleRemovesLegalHold: the holds page offers a remove action per
// hold when writes are on; a removal without the token is 401, without a
// reason 400, of an unknown hold 404, and each leaves the holds as they
// were; with the token and a reason exactly that hold goes, and the
// removal is recorded in the log with the hold, the reason and the actor.
func TestConsoleRemovesLegalHold(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, testenv.NewDatabase(t))
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	require.NoError(t, migrations.Apply(ctx, pool))
	first, err := erasure.AddLegalHold(ctx, pool, erasure.LegalHoldOptions{
		Table: "public.customers", Key: json.RawMessage(`{"id": 7}`), Reason: "litigation 2026-14", Actor: "cli"})
	require.NoError(t, err)
	second, err := erasure.AddLegalHold(ctx, pool, erasure.LegalHoldOptions{
		Table: "public.orders", Match: json.RawMessage(`{"customer_id": 7}`), Reason: "audit", Actor: "cli"})
	require.NoError(t, err)

	file := filepath.Join(t.TempDir(), "token")
	require.NoError(t, os.WriteFile(file, []byte(token), 0o600))
	tok, err := httptoken.Load(file)
	require.NoError(t, err)
	logs := &syncBuffer{}
	mux := http.NewServeMux()
	console.Register(mux, console.Config{DB: pool, Token: tok, Source: "main", Logger: slog.New(slog.NewJSONHandler(logs, nil))})
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)

	holds := func() []string {
		hs, err := erasure.ListLegalHolds(ctx, pool)
		require.NoError(t, err)
		var out []string
		for _, h := range hs {
			out = append(out, strings.Join([]string{h.Table, string(h.Key), string(h.Match), h.Reason, h.CreatedBy}, " | "))
		}
		return out
	}
	both := []string{
		`public.customers | {"id": 7} |  | litigation 2026-14 | cli`,
		`public.orders |  | {"customer_id": 7} | audit | cli`,
	}
	require.Equal(t, both, holds())

	// The page: a remove button for each hold.
	req, err := http.NewRequest(http.MethodGet, srv.URL+"/console/holds", nil)
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer "+token)
	res, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	page, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	require.NoError(t, res.Body.Close())
	require.Equal(t, http.StatusOK, res.StatusCode)
	require.Equal(t, 2, strings.Count(string(page), `data-testid="hold-remove"`))
	require.Contains(t, string(page), `data-hold-remove="`+itoa(first.ID)+`"`)
	require.Contains(t, string(page), `data-hold-remove="`+itoa(second.ID)+`"`)

	body := `{"id": ` + itoa(first.ID) + `, "reason": "case closed"}`
	for _, h := range [][]string{nil, {"Authorization", "Bearer not-the-token-at-all-xx"}, {"Authorization", "Basic " + basic(token)}} {
		code, text := post(t, srv.URL, "/console/api/holds/remove", body, h...)
		require.Equal(t, http.StatusUnauthorized, code, text)
	}
	bearer := []string{"Authorization", "Bearer " + token}
	code, text := post(t, srv.URL, "/console/api/holds/remove", `{"id": `+itoa(first.ID)+`}`, bearer...)
	require.Equal(t, http.StatusBadRequest, code, text)
	require.Contains(t, text, "needs a reason")
	code, text = post(t, srv.URL, "/console/api/holds/remove", `{"id": 9999, "reason": "x"}`, bearer...)
	require.Equal(t, http.StatusNotFound, code, text)
	code, text = post(t, srv.URL, "/console/api/holds/remove", `{"id": "one"}`, bearer...)
	require.Equal(t, http.StatusBadRequest, code, text)
	require.Equal(t, both, holds(), "refused removals change nothing")
	require.Empty(t, logs.records(t, "console: legal hold removed"))

	code, text = post(t, srv.URL, "/console/api/holds/remove", body, bearer...)
	require.Equal(t, http.StatusOK, code, text)
	require.JSONEq(t, `{"removed": `+itoa(first.ID)+`, "table": "public.customers", "reason": "case closed", "actor": "console"}`, text)
	require.Equal(t, both[1:], holds(), "exactly that hold is gone")
	recs := logs.records(t, "console: legal hold removed")
	require.Len(t, recs, 1)
	rec := recs[0]
	require.Equal(t, float64(first.ID), rec["id"])
	require.Equal(t, "public.customers", rec["table"])
	require.Equal(t, `{"id": 7}`, rec["key"])
	require.Equal(t, "litigation 2026-14", rec["hold_reason"])
	require.Equal(t, "cli", rec["added_by"])
	require.Equal(t, "case closed", rec["reason"])
	require.Equal(t, console.Actor, rec["actor"])

	// Removed twice: the second is 404 and the other hold stays.
	code, text = post(t, srv.URL, "/console/api/holds/remove", body, bearer...)
	require.Equal(t, http.StatusNotFound, code, text)
	require.Equal(t, both[1:], holds())
}

func itoa(n int64) string {
	b, _ := json.Marshal(n)
	return string(b)
}
