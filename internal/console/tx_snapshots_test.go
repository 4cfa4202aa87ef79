package console_test

import (
	"context"
	"net/http"
	"net/url"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/console"
	"github.com/epitaph-dev/epitaph/projection/snapshot"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// A bulk delete of 3,000 customers (a snapshot root table) has 3,000
// documents: the transaction's page, and the page of each of its rows,
// show a bounded number of them and say how many there are (as they do
// for the rows), not every document of the transaction; a row's page
// shows the document rooted at that row.
func TestConsoleTransactionPageBoundsItsSnapshotDocuments(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := edgeArchive(t)
	require.NoError(t, snapshot.Migrate(ctx, pool, "archive_v1"))
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return version.PointViews(ctx, tx, 1) }))
	const corr = "main:77:0/9000"
	_, err := pool.Exec(ctx, `INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row, correlation_id,
			commit_lsn, commit_time, seq, archived_at)
		SELECT 'main', 'public', 'customers', jsonb_build_object('id', g), jsonb_build_object('id', g), $1, '0/9000', now(), g, now()
		FROM generate_series(0, 2999) g`, corr)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO archive_v1.snapshots (correlation_id, root_table, root_key, status, payload, source, commit_lsn, root_seq)
		SELECT $1, 'public.customers', jsonb_build_object('id', g), 'complete',
		       jsonb_build_object('root', jsonb_build_object('table', 'public.customers', 'key', jsonb_build_object('id', g), 'row', jsonb_build_object('id', g))),
		       'main', '0/9000', g
		FROM generate_series(0, 2999) g`, corr)
	require.NoError(t, err)
	srv := edgeConsole(t, console.Config{DB: pool})

	code, body := edgeGet(t, srv.URL+"/console/tx?"+url.Values{"correlation_id": {corr}}.Encode())
	require.Equal(t, http.StatusOK, code)
	docs := strings.Count(body, `data-testid="snapshot"`)
	require.LessOrEqual(t, docs, 100, "documents on the transaction's page")
	require.Contains(t, body, `data-testid="snapshots-cut"`, "the page says it shows part of the documents")
	require.Contains(t, body, "of the transaction's 3000 snapshot documents")

	code, body = edgeGet(t, srv.URL+"/console/row?"+url.Values{"correlation_id": {corr}, "seq": {"2999"}}.Encode())
	require.Equal(t, http.StatusOK, code)
	require.LessOrEqual(t, strings.Count(body, `data-testid="snapshot"`), 100, "documents on a row's page")
	require.Contains(t, body, `<code>{&#34;id&#34;: 2999}</code> · complete`, "the row's own document")
}
