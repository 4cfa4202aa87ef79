package console_test

import (
	"context"
	"encoding/base64"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/internal/console"
	"github.com/epitaph-dev/epitaph/internal/httptoken"
	"github.com/epitaph-dev/epitaph/internal/statuspage"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/version"
	"github.com/epitaph-dev/epitaph/quarantine"
)

// edgeArchive is a target with the archive's version 1 and its
// partitions, without a pipeline: rows are inserted as the apply would.
func edgeArchive(t *testing.T) *pgxpool.Pool {
	t.Helper()
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
	return pool
}

func edgeConsole(t *testing.T, cfg console.Config) *httptest.Server {
	t.Helper()
	cfg.Source, cfg.Logger = "main", testLogger()
	mux := http.NewServeMux()
	console.Register(mux, cfg)
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv
}

func edgeGet(t *testing.T, u string) (int, string) {
	t.Helper()
	res, err := http.Get(u)
	require.NoError(t, err)
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	return res.StatusCode, string(b)
}

// The search pages by (commit_lsn, seq, source), the archive's identity:
// a row of another source at the same (commit_lsn, seq) as a page's last
// row is on the next page (it was skipped when pages went by
// (commit_lsn, seq)).
func TestConsoleSearchPagesSkipNoRowOfAnotherSource(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := edgeArchive(t)
	// 50 rows of main at distinct LSNs, and one of another source at the
	// oldest one's (commit_lsn, seq): 51 rows of public.notes.
	_, err := pool.Exec(ctx, `INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row, correlation_id,
			commit_lsn, commit_time, seq, archived_at)
		SELECT src, 'public', 'notes', jsonb_build_object('id', g, 'src', src), jsonb_build_object('id', g),
		       src || ':' || g || ':' || ('0/' || to_hex(4096 + g * 256)), ('0/' || to_hex(4096 + g * 256))::pg_lsn, now(), 0, now()
		FROM generate_series(1, 50) g, (VALUES ('main'), ('other')) v(src)
		WHERE src = 'main' OR g = 1`)
	require.NoError(t, err)
	srv := edgeConsole(t, console.Config{DB: pool})

	keyRE := regexp.MustCompile(`data-testid="key">([^<]*)<`)
	nextRE := regexp.MustCompile(`data-testid="next" href="([^"]*)"`)
	seen := map[string]int{}
	path := "/console/?table=public.notes"
	for pages := 0; path != ""; pages++ {
		require.Less(t, pages, 10)
		code, body := edgeGet(t, srv.URL+path)
		require.Equal(t, http.StatusOK, code, body)
		for _, m := range keyRE.FindAllStringSubmatch(body, -1) {
			seen[m[1]]++
		}
		path = ""
		if m := nextRE.FindStringSubmatch(body); m != nil {
			path = regexp.MustCompile(`&amp;`).ReplaceAllString(m[1], "&")
		}
	}
	_, mainOne := seen[`{&#34;id&#34;: 1, &#34;src&#34;: &#34;main&#34;}`]
	_, otherOne := seen[`{&#34;id&#34;: 1, &#34;src&#34;: &#34;other&#34;}`]
	require.Equal(t, 51, len(seen), "every archived row of the table over the pages (main id 1 seen: %v, other id 1 seen: %v)", mainOne, otherOne)
}

// A transaction of more than 2000 rows (one bulk DELETE): the search
// links each of its rows to /console/row, and the row page shows every
// one (it read the row from the first 2000 of its transaction, and
// answered 404 "expired or erased" for the others).
func TestConsoleRowPageOfABigTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := edgeArchive(t)
	const corr = "main:77:0/9000"
	_, err := pool.Exec(ctx, `INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row, correlation_id,
			commit_lsn, commit_time, seq, archived_at)
		SELECT 'main', 'public', 'notes', jsonb_build_object('id', g), jsonb_build_object('id', g), $1, '0/9000', now(), g, now()
		FROM generate_series(0, 2000) g`, corr)
	require.NoError(t, err)
	srv := edgeConsole(t, console.Config{DB: pool})

	// The search page's link to the newest row (seq 2000).
	code, body := edgeGet(t, srv.URL+"/console/?table=public.notes")
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, `/console/row?correlation_id=`+url.QueryEscape(corr)+`&amp;seq=2000`)
	code, body = edgeGet(t, srv.URL+"/console/row?"+url.Values{"correlation_id": {corr}, "seq": {"2000"}}.Encode())
	require.Equal(t, http.StatusOK, code, "the row is archived: %s", regexp.MustCompile(`data-testid="error">[^<]*`).FindString(body))

	// The transaction's page shows 2,000 of its 2,001 rows, and says so.
	code, body = edgeGet(t, srv.URL+"/console/tx?"+url.Values{"correlation_id": {corr}}.Encode())
	require.Equal(t, http.StatusOK, code)
	require.True(t, strings.Contains(body, "2001 archived rows deleted"), "the count: %s", regexp.MustCompile(`· \d+ archived rows deleted`).FindString(body))
	require.True(t, strings.Contains(body, `data-testid="tx-cut">This page shows the first 2000 rows of 2001`), "the page says it shows part")
	require.Equal(t, 2000, strings.Count(body, `href="/console/row?`), "the rows shown")
}

// A cursor the page did not make, but that decodeCursor accepts, is a
// 4xx, not a 503 "unavailable" from the database.
func TestConsoleSearchBadCursorIs400(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := edgeArchive(t)
	_, err := pool.Exec(ctx, `INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row, correlation_id,
			commit_lsn, commit_time, seq, archived_at)
		VALUES ('main', 'public', 'notes', '{"id":1}', '{"id":1}', 'main:1:0/1000', '0/1000', now(), 0, now())`)
	require.NoError(t, err)
	srv := edgeConsole(t, console.Config{DB: pool})
	got := map[string]string{}
	for _, raw := range []string{"0/1000 99999999999", "000000000/1000 0"} {
		cursor := base64.RawURLEncoding.EncodeToString([]byte(raw))
		code, body := edgeGet(t, srv.URL+"/console/?table=public.notes&cursor="+cursor)
		got[raw] = fmt.Sprintf("%d %s", code, regexp.MustCompile(`data-testid="error">[^<]*`).FindString(body))
	}
	for raw, answer := range got {
		require.Regexp(t, `^4\d\d `, answer, "cursor %q: a client's error, never 5xx: %q", raw, got)
	}
}

// POST /console/api/quarantine {"action":"replay","ids":[0]} is refused:
// id 0 is quarantine.Replay's "every open entry", so one selected
// (nonexistent) id replayed every open entry of the quarantine.
func TestConsoleQuarantineActionRefusesIDZero(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := edgeArchive(t)
	_, err := pool.Exec(ctx, `INSERT INTO epitaph.quarantine (projection, version, partition, stream_seq, subject, data, category, error,
		source_schema, source_table, source_key) VALUES
		('archive', 1, 0, 7, 'epitaph.main.delete.0', 'x', 'decode', 'e1', 'public', 'notes', '{"id": 1}'),
		('archive', 1, 0, 8, 'epitaph.main.delete.0', 'y', 'decode', 'e2', 'public', 'notes', '{"id": 2}')`)
	require.NoError(t, err)
	var applied []uint64
	apply := func(_ context.Context, _ pgx.Tx, e quarantine.Entry) error {
		applied = append(applied, e.StreamSeq)
		return nil
	}
	file := filepath.Join(t.TempDir(), "token")
	require.NoError(t, os.WriteFile(file, []byte(token), 0o600))
	tok, err := httptoken.Load(file)
	require.NoError(t, err)
	srv := edgeConsole(t, console.Config{DB: pool, Token: tok, Quarantine: statuspage.QuarantineActions(pool, apply)})

	code, text := post(t, srv.URL, "/console/api/quarantine", `{"action": "replay", "ids": [0]}`, "Authorization", "Bearer "+token)
	var open int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM epitaph.quarantine WHERE status = 'open'`).Scan(&open))
	require.Equal(t, 2, open, "no entry 0 exists: nothing is replayed (answer %d %s, applied %v)", code, text, applied)
	require.NotEqual(t, http.StatusOK, code, text)
}

// 600 dead deliveries: the failed work page lists 500 (FailedLimit), and
// its button says "retry all 600 matching", what the action it sends
// ({"all": true}) acts on (every match, up to 10,000); it said 500.
func TestConsoleRetryAllCountsWhatTheActionTouches(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := edgeArchive(t)
	def := handler.Def{ID: handler.NewID(), Name: "hook", Schema: "public", Table: "notes", Kind: handler.KindWebhook,
		Target: "https://example.invalid/hook", MaxAttempts: 1, Backoff: time.Second, ClaimTimeout: time.Minute}
	require.NoError(t, handler.Add(ctx, pool, def))
	_, err := pool.Exec(ctx, `INSERT INTO epitaph.deliveries (id, handler_id, source, commit_lsn, seq, schema_name, table_name, key,
			correlation_id, version, state, attempt, outcome, last_error, payload, released_at)
		SELECT gen_random_uuid(), $1, 'main', ('0/' || to_hex(4096 + g * 256))::pg_lsn, 0, 'public', 'notes', jsonb_build_object('id', g),
		       'main:' || g, 1, 'dead', 1, 'failed', 'type=x code=none diag=d', jsonb_build_object('key', jsonb_build_object('id', g)), now()
		FROM generate_series(1, 600) g`, def.ID)
	require.NoError(t, err)
	file := filepath.Join(t.TempDir(), "token")
	require.NoError(t, os.WriteFile(file, []byte(token), 0o600))
	tok, err := httptoken.Load(file)
	require.NoError(t, err)
	srv := edgeConsole(t, console.Config{DB: pool, Token: tok})

	req, err := http.NewRequest(http.MethodGet, srv.URL+"/console/failed?state=dead", nil)
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer "+token)
	res, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	b, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	require.NoError(t, res.Body.Close())
	label := regexp.MustCompile(`retry all [^<]* matching`).FindString(string(b))
	code, text := post(t, srv.URL, "/console/api/deliveries", `{"action":"discard","all":true,"filter":{"state":"dead"}}`, "Authorization", "Bearer "+token)
	require.Equal(t, http.StatusOK, code, text)
	require.Contains(t, text, `"done":600`)
	require.Equal(t, "retry all 600 matching", label, "the button's count is what the action touches")
}
