package console_test

import (
	"context"
	"html"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/internal/console"
	"github.com/epitaph-dev/epitaph/internal/httptoken"
)

// A table filter without its schema ("notes"): the failed work page must
// not list deliveries and offer "retry all N matching" for a filter the
// action it sends then refuses (400 "want schema.table"). Whatever the page
// offers, the body of its own "retry all" button acts on the count it shows.
func TestConsoleFailedTableFilterWithoutSchemaOffersNoActionItRefuses(t *testing.T) {
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
		FROM generate_series(1, 5) g`, def.ID)
	require.NoError(t, err)
	file := filepath.Join(t.TempDir(), "token")
	require.NoError(t, os.WriteFile(file, []byte(token), 0o600))
	tok, err := httptoken.Load(file)
	require.NoError(t, err)
	srv := edgeConsole(t, console.Config{DB: pool, Token: tok})

	req, err := http.NewRequest(http.MethodGet, srv.URL+"/console/failed?state=dead&table=notes", nil)
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer "+token)
	res, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	b, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	require.NoError(t, res.Body.Close())
	page := string(b)
	listed := len(regexp.MustCompile(`data-testid="delivery"`).FindAllString(page, -1))
	label := regexp.MustCompile(`retry all (\d+) matching`).FindStringSubmatch(page)
	require.NotNil(t, label, page)
	m := regexp.MustCompile(`data-testid="retry-all" data-deliveries="([^"]*)"`).FindStringSubmatch(page)
	require.NotNil(t, m, page)
	body := html.UnescapeString(m[1])

	code, text := post(t, srv.URL, "/console/api/deliveries", body, "Authorization", "Bearer "+token)
	if listed == 0 && label[1] == "0" {
		// The page refused the filter: it lists nothing and offers nothing.
		require.Equal(t, http.StatusBadRequest, res.StatusCode, page)
		require.Contains(t, page, "want schema.table")
		return
	}
	require.Equal(t, http.StatusOK, code, "the page listed %d rows and offered %q; its own button's action answered %d %s",
		listed, label[0], code, text)
	require.Contains(t, text, `"done":`+label[1])
}
