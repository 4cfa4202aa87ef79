package console_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"regexp"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/internal/console"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// A cursor handler (a webhook batching without revalidation) writes no
// delivery row before its batch settles: the failed work page counts its
// archived rows after its cursor as pending, flags the oldest one's age,
// and lists them (not selectable: there is no row to retry or discard).
func TestConsoleShowsACursorHandlersBacklog(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testenv.NewDatabase(t)
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	require.NoError(t, migrations.Apply(ctx, pool))
	require.NoError(t, version.EnsureArchive(ctx, pool, 1, nil))
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := archive.EnsurePartitions(ctx, tx, archive.Schema(1), archive.DefaultPeriod, time.Now())
		return err
	}))
	def := handler.Def{ID: handler.NewID(), Name: "batched-hook", Schema: "public", Table: "notes", Kind: handler.KindWebhook,
		Target: "https://example.invalid/hook", MaxAttempts: 3, Backoff: time.Second, ClaimTimeout: time.Minute,
		BatchSize: 50, BatchWait: time.Second}
	require.NoError(t, handler.Add(ctx, pool, def))
	require.True(t, def.UsesCursor())
	var ids []string
	for k := 1; k <= 4; k++ {
		lsn := fmt.Sprintf("0/%X", 0x1000+k*0x100)
		_, err := pool.Exec(ctx, `INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row, correlation_id,
			commit_lsn, commit_time, seq, archived_at)
			VALUES ('main', 'public', 'notes', $1::jsonb, $1::jsonb, 'main:' || $2, $2::pg_lsn, now(), 0, now() - interval '1 hour')`,
			fmt.Sprintf(`{"id": %d}`, k), lsn)
		require.NoError(t, err)
		ids = append(ids, handler.DeliveryID(def.ID, "main", lsn, 0, 0))
	}

	mux := http.NewServeMux()
	console.Register(mux, console.Config{DB: pool, Source: "main", Logger: testLogger()})
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	res, err := http.Get(srv.URL + "/console/failed?state=pending")
	require.NoError(t, err)
	b, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	require.NoError(t, res.Body.Close())
	body := string(b)
	require.Equal(t, http.StatusOK, res.StatusCode, body)
	require.Contains(t, body, `data-handler="`+def.ID+`"`)
	require.Contains(t, body, `data-testid="handler-pending">4<`)
	require.Regexp(t, `data-testid="handler-oldest"><strong>1h0m\d+s</strong>`, body, "flagged past the backlog alert's 30 minutes")
	require.Len(t, regexp.MustCompile(`data-testid="from-archive"`).FindAllString(body, -1), 4, body)
	for _, id := range ids {
		require.NotContains(t, body, `value="`+id+`"`, "not selectable: no row to retry or discard")
	}
}
