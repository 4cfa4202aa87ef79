package console_test

import (
	"context"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/internal/console"
	"github.com/epitaph-dev/epitaph/internal/httptoken"
)

// More dead deliveries match than one action takes (MaxSelection): the
// "all matching" buttons act on the first MaxSelection only, and must say
// that more match rather than "retry all 10000 matching".
func TestConsoleAllMatchingButtonsSayWhenMoreMatchThanOneActionTakes(t *testing.T) {
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
		FROM generate_series(1, $2::int) g`, def.ID, console.MaxSelection+5)
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
	retry := regexp.MustCompile(`data-testid="retry-all"[^>]*>([^<]*)<`).FindStringSubmatch(string(b))
	discard := regexp.MustCompile(`data-testid="discard-all"[^>]*>([^<]*)<`).FindStringSubmatch(string(b))
	require.Len(t, retry, 2)
	require.Len(t, discard, 2)
	t.Logf("buttons: %q, %q", retry[1], discard[1])
	n := strconv.Itoa(console.MaxSelection)
	require.Equal(t, "retry "+n+" of more than "+n+" matching", retry[1], "more match than the action takes")
	require.Equal(t, "discard "+n+" of more than "+n+" matching", discard[1], "more match than the action takes")
}
