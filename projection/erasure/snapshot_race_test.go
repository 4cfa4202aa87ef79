package erasure_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/erasure"
	"github.com/epitaph-dev/epitaph/projection/snapshot"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// A transaction spanning pages has its rows archived invisible and made
// visible by the page of its commit, which also makes its snapshot jobs;
// that page inserts no row, so it does not take the erasure lock. An
// erase of the root row racing that page waits for the row and then
// removes it: the document rooted at it, made by the page meanwhile, must
// go too. It stayed, with the erased key as its root_key (and, once the
// batcher found its root gone, as a failed document read by
// /v1/snapshots?key=).
func TestEraseOfARootRacingItsCommitDeletesTheDocumentMadeMeanwhile(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	url := testenv.NewDatabase(t)
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	require.NoError(t, migrations.Apply(ctx, pool))
	require.NoError(t, version.EnsureArchive(ctx, pool, 1, snapshot.DDL))

	lsn, xid := event.LSN(0x1000100), int64(4242)
	corr := event.CorrelationID("main", xid, lsn)
	// The earlier page: the customer and an order, not verified yet.
	_, err = pool.Exec(ctx, `
		INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row, identity, correlation_id, xid, commit_lsn, commit_time, seq, columns, refs, verified)
		VALUES ('main', 'public', 'customers', '{"id": 42}', '{"id": 42, "email": "ann@example.com"}', 'full', $1, $2, $3::pg_lsn, now(), 0, '[]', NULL, false),
		       ('main', 'public', 'orders', '{"id": 7}', '{"id": 7, "customer_id": 42}', 'full', $1, $2, $3::pg_lsn, now(), 1, '[]',
		        '[{"columns": ["customer_id"], "schema": "public", "table": "customers", "ref_columns": ["id"]}]', false)`,
		corr, xid, lsn.String())
	require.NoError(t, err)

	// The commit's page, as the apply does it: the rows become visible,
	// the jobs are made; not committed yet.
	page, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer page.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // committed below
	_, err = page.Exec(ctx, `UPDATE archive_v1.rows SET verified = true WHERE source = 'main' AND commit_lsn = $1::pg_lsn AND NOT verified`, lsn.String())
	require.NoError(t, err)
	n, err := snapshot.CreateJobs(ctx, page, "archive_v1", &event.Event{Op: event.OpCommit, Source: "main", XID: xid, CommitLSN: lsn,
		CommitTime: time.Now(), Rows: 2, Tables: map[string]int{"public.customers": 1, "public.orders": 1}}, []string{"public.customers"})
	require.NoError(t, err)
	require.Equal(t, 1, n)

	type outcome struct {
		rc  erasure.Receipt
		err error
	}
	done := make(chan outcome, 1)
	go func() {
		rc, err := erasure.Erase(ctx, pool, erasure.EraseOptions{Table: "public.customers", Key: json.RawMessage(`{"id": 42}`),
			Reason: "GDPR", Actor: "dpo"})
		done <- outcome{rc, err}
	}()
	require.Eventually(t, func() bool {
		var waiting int
		err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&waiting)
		return err == nil && waiting == 1
	}, time.Minute, 10*time.Millisecond, "the erase waits for the page's row lock")
	require.NoError(t, page.Commit(ctx))
	o := <-done
	require.NoError(t, o.err)
	require.Equal(t, 1, o.rc.Removed["rows:public.customers"])

	// The batcher runs, as it would.
	_, err = snapshot.RunBatch(ctx, pool, snapshot.Config{Schema: "archive_v1"})
	require.NoError(t, err)
	var left []string
	rows, err := pool.Query(ctx, `SELECT to_jsonb(s)::text FROM archive_v1.snapshots s WHERE root_key = '{"id": 42}'`)
	require.NoError(t, err)
	left, err = pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Empty(t, left, "a snapshot document rooted at the erased row is left")
}
