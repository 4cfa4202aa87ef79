package statuspage_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/internal/statuspage"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/status"
	projversion "github.com/epitaph-dev/epitaph/projection/version"
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

// A cursor handler (a webhook batching without revalidation) writes no
// delivery row before its batch settles: the page counts its archived rows
// after its cursor as pending and flags the oldest one's age.
func TestCursorHandlerBacklogOnThePage(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	url := testenv.NewDatabase(t)
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	require.NoError(t, migrations.Apply(ctx, pool))
	require.NoError(t, projversion.EnsureArchive(ctx, pool, 1, nil))
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := archive.EnsurePartitions(ctx, tx, archive.Schema(1), archive.DefaultPeriod, time.Now())
		return err
	}))
	const id = "3c9e2b7a-1d4f-4e6a-8b5c-7d9e0f1a2b3c"
	def := handler.Def{ID: id, Name: "batched", Schema: "public", Table: "attachments", Kind: handler.KindWebhook,
		Target: "https://example.invalid/hook", MaxAttempts: 3, Backoff: time.Second, ClaimTimeout: time.Minute,
		BatchSize: 100, BatchWait: time.Second}
	require.True(t, def.UsesCursor())
	require.NoError(t, handler.Add(ctx, pool, def))
	testenv.Exec(t, url, `INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row, correlation_id,
		commit_lsn, commit_time, seq, archived_at)
		SELECT 'main', 'public', 'attachments', jsonb_build_object('id', g), jsonb_build_object('id', g), 'main:' || g,
		       ('0/' || to_hex(4096 + g))::pg_lsn, now(), 0, now() - interval '3 hours'
		FROM generate_series(1, 7) g`)
	// Another one's backlog is larger than the count's cap.
	const big = "4d0f3c8b-2e5a-4f7b-9c6d-8e0f1a2b3c4d"
	def.ID, def.Table = big, "blobs"
	require.NoError(t, handler.Add(ctx, pool, def))
	testenv.Exec(t, url, fmt.Sprintf(`INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row, correlation_id,
		commit_lsn, commit_time, seq)
		SELECT 'main', 'public', 'blobs', jsonb_build_object('id', g), jsonb_build_object('id', g), 'main:' || g,
		       ('1/' || to_hex(g))::pg_lsn, now(), 0
		FROM generate_series(1, %d) g`, handler.CursorCountCap+1))
	h := statuspage.Handler(func(context.Context) (*status.Status, error) {
		return &status.Status{Source: "main", At: time.Now()}, nil
	}, statuspage.WithHandlerStats(pool, time.Second))
	_, _, body := get(t, h, "/")
	require.Contains(t, body, `data-handler="`+id+`"`)
	require.Contains(t, body, `data-testid="handler-pending">7<`, body)
	require.Contains(t, body, fmt.Sprintf(`data-testid="handler-pending">at least %d<`, handler.CursorCountCap), body)
	require.Contains(t, body, `data-testid="handler-oldest"><span class="badge no">3h`, body)
}
