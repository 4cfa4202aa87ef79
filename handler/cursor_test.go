package handler

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// cursorEnv is a migrated target with a real live archive (version 1, two
// partitions) whose rows are written directly.
type cursorEnv struct {
	t    *testing.T
	pool *pgxpool.Pool
	lsn  int
}

func newCursorEnv(t *testing.T) *cursorEnv {
	t.Helper()
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, testenv.NewDatabase(t))
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	require.NoError(t, migrations.Apply(ctx, pool))
	require.NoError(t, version.EnsureArchive(ctx, pool, 2, nil))
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := archive.EnsurePartitions(ctx, tx, archive.Schema(1), archive.DefaultPeriod, time.Now())
		return err
	}))
	return &cursorEnv{t: t, pool: pool, lsn: 0x1000}
}

// archive writes rows of table (keys) in one transaction each, verified
// unless told, and returns their commit LSNs.
func (e *cursorEnv) archive(table string, verified bool, keys ...int) []string {
	e.t.Helper()
	var lsns []string
	for _, k := range keys {
		e.lsn += 0x100
		lsn := fmt.Sprintf("0/%X", e.lsn)
		_, err := e.pool.Exec(context.Background(), `INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row,
			correlation_id, commit_lsn, commit_time, seq, verified)
			VALUES ('main', 'public', $1, $2::jsonb, $3::jsonb, $4, $5::pg_lsn, now(), 0, $6)`,
			table, fmt.Sprintf(`{"id": %d}`, k), fmt.Sprintf(`{"id": %d, "note": "n-%d"}`, k, k), "main:"+lsn, lsn, verified)
		require.NoError(e.t, err)
		lsns = append(lsns, lsn)
	}
	return lsns
}

// horizon sets every partition's watermark.
func (e *cursorEnv) horizon(lsn string) {
	e.t.Helper()
	_, err := e.pool.Exec(context.Background(), `UPDATE epitaph.progress SET source_lsn = $1::pg_lsn
		WHERE projection = 'archive' AND version = 1`, lsn)
	require.NoError(e.t, err)
}

func (e *cursorEnv) flush(d *Dispatcher) {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	_, err := d.Flush(ctx)
	require.NoError(e.t, err)
}

// A cursor handler's deliveries are the verified archived rows of its
// table after its cursor up to the horizon, in batches in commit order,
// each with the delivery id the queued path gives it; each is written
// once, done, when its batch succeeds. A failed batch is retried as a
// whole (same webhook-id and body); rows past the horizon wait for it.
func TestCursorHandlerDeliversArchivedRowsOnceInBatches(t *testing.T) {
	e := newCursorEnv(t)
	secret := NewSecret()
	br, srv := newBatchReceiver(t, secret, func(n int) int {
		if n == 1 {
			return 503
		}
		return 200
	})
	ctx := context.Background()
	def := Def{ID: newUUID(), Schema: "public", Table: "orders", Kind: KindWebhook, Target: srv.URL, MaxAttempts: 5,
		Backoff: time.Millisecond, ClaimTimeout: 30 * time.Second, BatchSize: 3, BatchWait: time.Second,
		SecretFile: writeSecret(t, secret)}
	require.NoError(t, Add(ctx, e.pool, def))
	require.True(t, def.UsesCursor())

	lsns := e.archive("orders", true, 1, 2, 3, 4)
	e.archive("customers", true, 9)             // another table's row
	unverified := e.archive("orders", false, 5) // waits for its commit: the cursor stops before it
	late := e.archive("orders", true, 6)        // past the horizon
	d, err := NewDispatcher(e.pool, Config{Poll: 20 * time.Millisecond})
	require.NoError(t, err)
	// One partition has applied nothing yet: its rows may still come,
	// so nothing is behind the horizon.
	_, err = e.pool.Exec(ctx, `UPDATE epitaph.progress SET source_lsn = $1::pg_lsn
		WHERE projection = 'archive' AND version = 1 AND partition = 0`, lsns[3])
	require.NoError(t, err)
	e.flush(d)
	require.Empty(t, br.got(), "a partition without a watermark holds the horizon")

	e.horizon(lsns[3])
	e.flush(d)
	time.Sleep(5 * time.Millisecond) // the backoff of the failed batch
	e.flush(d)
	posts := br.got()
	require.Len(t, posts, 3, "a batch of 3 refused, retried, then the partial batch of 1")
	require.Equal(t, ids(posts[0]), ids(posts[1]), "retried as a whole")
	require.Equal(t, string(posts[0].body), string(posts[1].body), "byte-identical")
	require.Equal(t, posts[0].id, posts[1].id)
	require.Equal(t, []string{"1", "2", "1"}, []string{posts[0].attempt, posts[1].attempt, posts[2].attempt})
	var got []string
	for _, p := range posts[1:] {
		for _, b := range p.ds {
			got = append(got, b.DeliveryID)
		}
	}
	var want []string
	for _, l := range lsns {
		want = append(want, DeliveryID(def.ID, "main", l, 0, 0))
	}
	require.Equal(t, want, got, "rows 1-4 in commit order, once each")

	// Past the horizon, but behind the unverified row: nothing yet.
	e.horizon(late[0])
	e.flush(d)
	require.Len(t, br.got(), 3)
	_, err = e.pool.Exec(ctx, `UPDATE archive_v1.rows SET verified = true WHERE commit_lsn = $1::pg_lsn`, unverified[0])
	require.NoError(t, err)
	e.flush(d)
	posts = br.got()
	require.Len(t, posts, 4)
	require.Equal(t, []string{DeliveryID(def.ID, "main", unverified[0], 0, 0), DeliveryID(def.ID, "main", late[0], 0, 0)}, ids(posts[3]))

	var states []string
	rows, err := e.pool.Query(ctx, `SELECT state || ':' || attempt FROM epitaph.deliveries ORDER BY commit_lsn`)
	require.NoError(t, err)
	states, err = pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, strings.Split("done:2 done:2 done:2 done:1 done:1 done:1", " "), states)
}
