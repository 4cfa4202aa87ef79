package statuspage_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/statuspage"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/projection/snapshot"
	"github.com/epitaph-dev/epitaph/projection/status"
)

// The snapshot job counts of the active archive versions come from their
// snapshots tables, read at most once per interval whatever the number of
// page loads; a version without a snapshots table is left out.
func TestSnapshotCounts(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	url := testenv.NewDatabase(t)
	testenv.Exec(t, url, `CREATE SCHEMA archive_v1; CREATE SCHEMA archive_v2`)
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	require.NoError(t, snapshot.Migrate(ctx, pool, "archive_v1"))
	insert := func(status string, n int) {
		for range n {
			testenv.Exec(t, url, `INSERT INTO archive_v1.snapshots (correlation_id, root_table, root_key, status, source, commit_lsn, root_seq)
				VALUES (gen_random_uuid()::text, 'public.orders', '{"id":1}', $1, 'main', '0/10', 0)`, status)
		}
	}
	insert("pending", 2)
	insert("complete", 5)
	insert("failed", 1)

	st := &status.Status{Source: "main", At: time.Now(), Versions: []status.VersionStatus{
		{Projection: "archive", Version: 1, State: "live", Health: "live", Schema: "archive_v1"},
		{Projection: "archive", Version: 2, State: "building", Health: "building", Schema: "archive_v2"},
	}}
	var (
		mu  sync.Mutex
		now = time.Date(2026, 11, 30, 10, 0, 0, 0, time.UTC)
	)
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	h := statuspage.Handler(func(context.Context) (*status.Status, error) { return st, nil },
		statuspage.WithSnapshotStats(pool, 10*time.Second), statuspage.WithClock(clock))

	_, _, body := get(t, h, "/")
	require.Contains(t, body, `data-schema="archive_v1"`)
	require.NotContains(t, body, `data-schema="archive_v2"`, "no snapshots table")
	require.Contains(t, body, `data-testid="snapshots-pending">2<`)
	require.Contains(t, body, `data-testid="snapshots-complete">5<`)
	require.Contains(t, body, `data-testid="snapshots-failed">1<`)
	require.Contains(t, body, `style="width:62%"`, "complete share of the bar")

	// Within the interval the counts are not read again.
	insert("complete", 3)
	_, _, body = get(t, h, "/?fragment=1")
	require.Contains(t, body, `data-testid="snapshots-complete">5<`)

	mu.Lock()
	now = now.Add(11 * time.Second)
	mu.Unlock()
	_, _, body = get(t, h, "/?fragment=1")
	require.Contains(t, body, `data-testid="snapshots-complete">8<`)
}
