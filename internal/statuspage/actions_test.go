package statuspage_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/httptoken"
	"github.com/epitaph-dev/epitaph/internal/statuspage"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/status"
	"github.com/epitaph-dev/epitaph/quarantine"
)

// plantedValue is a row value inside a quarantined message: it must never
// reach the page.
const plantedValue = "PLANTED-c4rd-4111-1111"

const pageToken = "op-token-5f1d2e3c4b5a69788796"

// quarantineSetup is a migrated target with three open quarantine entries
// whose messages carry plantedValue, and a page with the entries and its
// actions behind a token. applied records what the replay's apply did (a
// row per entry, in the replay's transaction).
func quarantineSetup(t *testing.T) (pool *pgxpool.Pool, srv *httptest.Server, ids []int64) {
	t.Helper()
	ctx := t.Context()
	url := testenv.NewDatabase(t)
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	require.NoError(t, migrations.Apply(ctx, pool))
	testenv.Exec(t, url, `CREATE TABLE applied (entry_seq bigint PRIMARY KEY)`)
	for i, cat := range []quarantine.Category{quarantine.CategoryIncompatible, quarantine.CategoryInvalid, quarantine.CategoryMalformed} {
		body := fmt.Sprintf(`{"v":1,"op":"delete","schema":"public","table":"orders","key":{"id":%d},"row":{"id":%d,"note":%q}}`, 40+i, 40+i, plantedValue)
		if cat == quarantine.CategoryMalformed {
			body = "not json " + plantedValue
		}
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		require.NoError(t, quarantine.Insert(ctx, tx, quarantine.Entry{Projection: archive.Projection, Version: 1, Partition: i,
			StreamSeq: uint64(100 + i), Subject: "epitaph.main.delete.0.public.orders", Data: []byte(body), Category: string(cat),
			Error:   "ERROR: insert or update on table \"orders\" violates a constraint (SQLSTATE 23503)",
			Headers: map[string][]string{"Nats-Msg-Id": {"m" + fmt.Sprint(i)}}}))
		require.NoError(t, tx.Commit(ctx))
	}
	recs, err := quarantine.List(ctx, pool, quarantine.Filter{Status: quarantine.StatusOpen})
	require.NoError(t, err)
	require.Len(t, recs, 3)
	for _, r := range recs {
		ids = append(ids, r.ID)
	}

	tokFile := filepath.Join(t.TempDir(), "token")
	require.NoError(t, os.WriteFile(tokFile, []byte(pageToken+"\n"), 0o600))
	tok, err := httptoken.Load(tokFile)
	require.NoError(t, err)
	apply := func(ctx context.Context, tx pgx.Tx, e quarantine.Entry) error {
		_, err := tx.Exec(ctx, `INSERT INTO applied VALUES ($1)`, int64(e.StreamSeq))
		return err
	}
	actions := statuspage.QuarantineActions(pool, apply)
	collect := func(ctx context.Context) (*status.Status, error) {
		return status.CollectStatus(ctx, pool, nil, source, time.Now())
	}
	mux := http.NewServeMux()
	mux.Handle("GET /{$}", statuspage.Handler(collect, statuspage.WithQuarantineEntries(pool, 0),
		statuspage.WithActions(actions, tok), statuspage.WithLogger(quietLogger())))
	mux.Handle(statuspage.ActionPattern, statuspage.ActionHandler(actions, tok, quietLogger()))
	srv = httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return pool, srv, ids
}

func post(t *testing.T, url, auth, body string) (int, map[string]any) {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, url, strings.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	if auth != "" {
		req.Header.Set("Authorization", auth)
	}
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	var out map[string]any
	require.NoError(t, json.Unmarshal(b, &out), string(b))
	return resp.StatusCode, out
}

func entryStatus(t *testing.T, pool *pgxpool.Pool, id int64) (status, reason string) {
	t.Helper()
	var r *string
	require.NoError(t, pool.QueryRow(t.Context(), `SELECT status, resolution_reason FROM epitaph.quarantine WHERE id = $1`, id).Scan(&status, &r))
	if r != nil {
		reason = *r
	}
	return status, reason
}

// The open entries are listed in the browser by table, key, category and
// sanitized error, and nothing of their messages shows. Without the token
// there are no buttons; with it (given to the page's script, which sends
// it in an Authorization header) each entry has replay and discard, and
// the token itself is nowhere in the page.
func TestQuarantineEntriesInBrowser(t *testing.T) {
	t.Parallel()
	bin := chromium(t)
	_, srv, ids := quarantineSetup(t)

	dom := browse(t, bin, srv.URL+"/", "--virtual-time-budget=3000", "--dump-dom")
	require.Contains(t, dom, `data-testid="quarantine-unresolved">3<`)
	rows := regexp.MustCompile(`data-testid="quarantine-entry" data-id="(\d+)"`).FindAllStringSubmatch(dom, -1)
	require.Len(t, rows, 3, "one row per open entry")
	for i, id := range ids {
		require.Equal(t, fmt.Sprint(id), rows[i][1])
	}
	require.Equal(t, 2, strings.Count(dom, `data-testid="entry-table">public.orders<`), "the table of the decodable ones")
	require.Contains(t, dom, `data-testid="entry-key"><code>{"id": 40}</code>`)
	require.Contains(t, dom, `data-testid="entry-key"><code>{"id": 41}</code>`)
	require.Contains(t, dom, `data-testid="entry-table">–<`, "the malformed one has no table")
	for _, cat := range []string{"incompatible", "invalid", "malformed"} {
		require.Contains(t, dom, `data-testid="entry-category">`+cat+`<`)
	}
	require.Contains(t, dom, `violates a constraint (SQLSTATE 23503)`)
	require.NotContains(t, dom, plantedValue, "a value from a quarantined message is on the page")
	require.NotContains(t, dom, `data-testid="replay"`, "buttons without the token")
	require.NotContains(t, dom, `data-testid="discard"`)
	require.Contains(t, dom, `data-testid="actions-locked">Replay and discard: give the operator token above`)
	require.Contains(t, dom, `data-testid="actions-form"`)

	// With the token: the script takes it from the address (and removes
	// it), refreshes with it at once, and the buttons are there.
	dom = browse(t, bin, srv.URL+"/#token="+pageToken, "--virtual-time-budget=3000", "--dump-dom")
	require.Regexp(t, `<div id="page" data-refreshed="[1-9]`, dom)
	require.Len(t, regexp.MustCompile(`data-testid="replay">replay</button>`).FindAllString(dom, -1), 3)
	require.Len(t, regexp.MustCompile(`data-testid="discard">discard</button>`).FindAllString(dom, -1), 3)
	require.Contains(t, dom, fmt.Sprintf(`data-action="replay" data-id="%d"`, ids[0]))
	require.NotContains(t, dom, pageToken, "the token shows in the page")
	require.NotContains(t, dom, plantedValue)

	// A wrong token is no token.
	dom = browse(t, bin, srv.URL+"/#token=not-the-token-at-all-0000", "--virtual-time-budget=3000", "--dump-dom")
	require.Regexp(t, `<div id="page" data-refreshed="[1-9]`, dom)
	require.NotContains(t, dom, `data-testid="replay"`)
}

// The actions answer 401 without the token (none, a wrong one, another
// scheme, or in a cookie or the URL), change nothing then, and with it
// replay (exactly once, through the same code as the CLI) and discard
// (with the reason kept).
func TestQuarantineActionsNeedToken(t *testing.T) {
	t.Parallel()
	pool, srv, ids := quarantineSetup(t)
	ctx := t.Context()
	replayURL := fmt.Sprintf("%s/quarantine/%d/replay", srv.URL, ids[0])
	discardURL := fmt.Sprintf("%s/quarantine/%d/discard", srv.URL, ids[1])
	reason := `{"reason":"hand-published by mistake"}`

	for _, auth := range []string{"", "Bearer wrong-token-00000000000", "Basic " + pageToken, pageToken} {
		code, out := post(t, replayURL, auth, "{}")
		require.Equal(t, http.StatusUnauthorized, code, "auth %q", auth)
		require.Contains(t, out["error"], "bearer token")
		code, _ = post(t, discardURL, auth, reason)
		require.Equal(t, http.StatusUnauthorized, code)
	}
	// Not from a cookie, not from the URL.
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, replayURL+"?token="+pageToken, strings.NewReader("{}"))
	require.NoError(t, err)
	req.AddCookie(&http.Cookie{Name: "token", Value: pageToken})
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusUnauthorized, resp.StatusCode)
	for _, id := range ids {
		st, _ := entryStatus(t, pool, id)
		require.Equal(t, "open", st, "nothing changed without the token")
	}
	var n int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM applied`).Scan(&n))
	require.Zero(t, n)

	auth := "Bearer " + pageToken
	code, out := post(t, replayURL, auth, "{}")
	require.Equal(t, http.StatusOK, code, "%v", out)
	require.Equal(t, "replayed", out["status"])
	st, why := entryStatus(t, pool, ids[0])
	require.Equal(t, "replayed", st)
	require.Equal(t, "replayed", why)
	var seq int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT entry_seq FROM applied`).Scan(&seq))
	require.Equal(t, int64(100), seq, "applied, in the replay's transaction")
	// Again: already resolved, not applied twice.
	code, out = post(t, replayURL, auth, "{}")
	require.Equal(t, http.StatusConflict, code)
	require.Contains(t, out["error"], "already resolved")
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM applied`).Scan(&n))
	require.Equal(t, 1, n)

	code, out = post(t, discardURL, auth, `{}`)
	require.Equal(t, http.StatusBadRequest, code)
	require.Contains(t, out["error"], "reason")
	code, out = post(t, discardURL, auth, reason)
	require.Equal(t, http.StatusOK, code, "%v", out)
	require.Equal(t, "discarded", out["status"])
	st, why = entryStatus(t, pool, ids[1])
	require.Equal(t, "discarded", st)
	require.Equal(t, "hand-published by mistake", why)

	code, _ = post(t, srv.URL+"/quarantine/999999/discard", auth, reason)
	require.Equal(t, http.StatusNotFound, code)
	code, _ = post(t, srv.URL+"/quarantine/abc/replay", auth, "{}")
	require.Equal(t, http.StatusBadRequest, code)
	code, _ = post(t, fmt.Sprintf("%s/quarantine/%d/explode", srv.URL, ids[2]), auth, "{}")
	require.Equal(t, http.StatusNotFound, code)

	// The page lists what is still open: the third entry only.
	resp, err = http.Get(srv.URL + "/")
	require.NoError(t, err)
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.NoError(t, err)
	body := string(b)
	require.Equal(t, 1, strings.Count(body, `data-testid="quarantine-entry"`))
	require.Contains(t, body, fmt.Sprintf(`data-id="%d"`, ids[2]))

	// Without a token file the actions are off.
	off := httptest.NewServer(statuspage.ActionHandler(statuspage.QuarantineActions(pool, nil), nil, quietLogger()))
	t.Cleanup(off.Close)
	code, out = post(t, off.URL+"/", auth, "{}")
	require.Equal(t, http.StatusUnauthorized, code)
	require.Contains(t, out["error"], "--http-token-file")
}
