package statuspage_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/internal/statuspage"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/status"
)

// The page lists every row handler with its deliveries by state, the dead
// letters and the oldest pending delivery flagged.
func TestHandlersOnThePage(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	url := testenv.NewDatabase(t)
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	require.NoError(t, migrations.Apply(ctx, pool))
	const busy, idle = "0b6f5e43-3d0e-4c2b-9a51-6f7f2a8c1e90", "7a1c3f00-0000-4000-8000-000000000001"
	for _, id := range []string{busy, idle} {
		require.NoError(t, handler.Add(ctx, pool, handler.Def{ID: id, Name: "purge <blobs>", Schema: "public", Table: "attachments",
			Kind: handler.KindWebhook, Target: "https://example.invalid/hook", MaxAttempts: 3, Backoff: time.Second, ClaimTimeout: time.Minute}))
	}
	for i, state := range []string{"pending", "pending", "dead", "done", "done", "done"} {
		testenv.Exec(t, url, `INSERT INTO epitaph.deliveries (id, handler_id, source, commit_lsn, seq, schema_name, table_name, key,
			correlation_id, version, state, created_at, released_at) VALUES (gen_random_uuid(), $1, 'main', '0/10', $2, 'public', 'attachments',
			'{"id":1}', 'main:1:0/10', 1, $3, now() - interval '2 hours', now())`, busy, i, state)
	}
	h := statuspage.Handler(func(context.Context) (*status.Status, error) {
		return &status.Status{Source: "main", At: time.Now()}, nil
	}, statuspage.WithHandlerStats(pool, time.Second))
	_, _, body := get(t, h, "/")
	require.Contains(t, body, `data-handler="`+busy+`"`)
	require.Contains(t, body, `data-handler="`+idle+`"`)
	require.Contains(t, body, `purge &lt;blobs&gt;`, "escaped")
	require.Contains(t, body, `data-testid="handler-pending">2<`)
	require.Contains(t, body, `data-testid="handler-done">3<`)
	require.Contains(t, body, `data-testid="handler-dead"><span class="badge no">1</span>`)
	require.Contains(t, body, `data-testid="handler-oldest"><span class="badge no">2h`)
	require.Contains(t, body, `data-testid="handler-pending">0<`, "the idle handler")

	_, _, body = get(t, statuspage.Handler(func(context.Context) (*status.Status, error) {
		return &status.Status{Source: "main", At: time.Now()}, nil
	}), "/")
	require.Contains(t, body, `data-testid="handlers-note">not shown`)
}
