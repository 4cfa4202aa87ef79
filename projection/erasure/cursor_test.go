package erasure_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/erasure"
	"github.com/epitaph-dev/epitaph/projection/retention"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// cursorFlow is a live archive (version 1, two partitions) whose rows are
// written directly, a webhook receiver and a cursor handler posting to it.
type cursorFlow struct {
	t    *testing.T
	pool *pgxpool.Pool
	def  handler.Def
	d    *handler.Dispatcher
	lsn  int
	lsns map[int]string // key -> commit LSN

	mu    sync.Mutex
	posts [][]string     // the delivery ids of each POST received
	hold  chan chan bool // when set, each POST waits for a reply on it
}

func newCursorFlow(t *testing.T) *cursorFlow {
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
	f := &cursorFlow{t: t, pool: pool, lsn: 0x1000, lsns: map[int]string{}}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		var body handler.BatchBody
		if err := json.Unmarshal(b, &body); err != nil {
			w.WriteHeader(http.StatusBadRequest)
			return
		}
		var ids []string
		for _, d := range body.Deliveries {
			ids = append(ids, d.DeliveryID)
		}
		f.mu.Lock()
		f.posts = append(f.posts, ids)
		hold := f.hold
		f.mu.Unlock()
		if hold != nil {
			reply := make(chan bool)
			hold <- reply
			<-reply
		}
		w.WriteHeader(http.StatusOK)
	}))
	t.Cleanup(srv.Close)
	f.def = handler.Def{ID: "5f0c1a3e-7d2b-4c4e-9a51-1e2f3a4b5c6d", Schema: "public", Table: "orders", Kind: handler.KindWebhook,
		Target: srv.URL, MaxAttempts: 5, Backoff: time.Millisecond, ClaimTimeout: 30 * time.Second, BatchSize: 3, BatchWait: time.Second}
	require.NoError(t, handler.Add(ctx, pool, f.def))
	require.True(t, f.def.UsesCursor())
	f.d, err = handler.NewDispatcher(pool, handler.Config{Source: "main", Poll: 20 * time.Millisecond})
	require.NoError(t, err)
	return f
}

// archive writes expired, verified rows of public.<table> (one
// transaction each).
func (f *cursorFlow) archive(table string, keys ...int) {
	f.t.Helper()
	for _, k := range keys {
		f.lsn += 0x100
		lsn := fmt.Sprintf("0/%X", f.lsn)
		_, err := f.pool.Exec(context.Background(), `INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row,
			correlation_id, commit_lsn, commit_time, seq, expires_at)
			VALUES ('main', 'public', $1, $2::jsonb, $2::jsonb, $3, $4::pg_lsn, now(), 0, now() - interval '1 day')`,
			table, fmt.Sprintf(`{"id": %d}`, k), "main:"+lsn, lsn)
		require.NoError(f.t, err)
		f.lsns[k] = lsn
	}
}

// horizon sets every partition's watermark to key's commit.
func (f *cursorFlow) horizon(key int) {
	f.t.Helper()
	_, err := f.pool.Exec(context.Background(), `UPDATE epitaph.progress SET source_lsn = $1::pg_lsn
		WHERE projection = 'archive' AND version = 1`, f.lsns[key])
	require.NoError(f.t, err)
}

func (f *cursorFlow) flush() error {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	_, err := f.d.Flush(ctx)
	return err
}

func (f *cursorFlow) cleanup() retention.CleanupResult {
	f.t.Helper()
	res, err := retention.CleanupBatch(context.Background(), f.pool, retention.CleanupOptions{Batch: 1000})
	require.NoError(f.t, err)
	return res
}

func (f *cursorFlow) id(key int) string {
	return handler.DeliveryID(f.def.ID, "main", f.lsns[key], 0, 0)
}

func (f *cursorFlow) ids(keys ...int) []string {
	var out []string
	for _, k := range keys {
		out = append(out, f.id(k))
	}
	return out
}

func (f *cursorFlow) received() [][]string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([][]string(nil), f.posts...)
}

// left lists the archived rows, "table:key".
func (f *cursorFlow) left() []string {
	f.t.Helper()
	rows, err := f.pool.Query(context.Background(), `SELECT table_name || ':' || (key->>'id') FROM archive_v1.rows ORDER BY commit_lsn, seq`)
	require.NoError(f.t, err)
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(f.t, err)
	return out
}

// deliveries lists epitaph.deliveries, "id state outcome key".
func (f *cursorFlow) deliveries() []string {
	f.t.Helper()
	rows, err := f.pool.Query(context.Background(), `SELECT id::text || ' ' || state || ' ' || COALESCE(outcome, '-') || ' ' || COALESCE(key::text, '-')
		FROM epitaph.deliveries ORDER BY commit_lsn, seq`)
	require.NoError(f.t, err)
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(f.t, err)
	return out
}

func (f *cursorFlow) erase(key int) erasure.Receipt {
	f.t.Helper()
	rc, err := erasure.Erase(context.Background(), f.pool, erasure.EraseOptions{Table: "public.orders",
		Key: json.RawMessage(fmt.Sprintf(`{"id": %d}`, key)), Actor: "dpo"})
	require.NoError(f.t, err)
	return rc
}

// The whole flow, row by row: expired rows of a cursor handler's table
// stay while they wait after its cursor, and go once it delivers them; an
// erased row it has not delivered leaves the archive, is never delivered
// and is recorded stopped (stop_revoked) without its key, as an erased
// row's open queued delivery is.
func TestErasureAndRetentionWithACursorHandler(t *testing.T) {
	f := newCursorFlow(t)
	f.archive("orders", 1, 2, 3, 4, 5, 6, 7, 8)
	f.archive("customers", 9)

	res := f.cleanup()
	require.Equal(t, map[string]int{"public.customers": 1}, res.ByTable, "the orders rows all wait for the handler")
	orders := []string{"orders:1", "orders:2", "orders:3", "orders:4", "orders:5", "orders:6", "orders:7", "orders:8"}
	require.Equal(t, orders, f.left())

	rc := f.erase(4)
	require.Equal(t, 1, rc.Removed["archive_v1.rows"])
	require.Equal(t, 1, rc.Removed["epitaph.deliveries"], "its pending delivery, recorded stopped")
	require.Equal(t, []string{f.id(4) + " stopped stop_revoked -"}, f.deliveries())

	f.horizon(3)
	require.NoError(t, f.flush())
	require.Equal(t, [][]string{f.ids(1, 2, 3)}, f.received())
	res = f.cleanup()
	require.Equal(t, map[string]int{"public.orders": 3}, res.ByTable)
	require.Equal(t, 3, res.Deliveries, "the delivered rows' done deliveries go with them")
	require.Equal(t, []string{"orders:5", "orders:6", "orders:7", "orders:8"}, f.left())

	f.horizon(8)
	require.NoError(t, f.flush())
	require.Equal(t, [][]string{f.ids(1, 2, 3), f.ids(5, 6, 7), f.ids(8)}, f.received(), "row 4 never")
	require.Len(t, f.deliveries(), 5)
	res = f.cleanup()
	require.Equal(t, map[string]int{"public.orders": 4}, res.ByTable)
	require.Empty(t, f.left())
	require.Equal(t, []string{f.id(4) + " stopped stop_revoked -"}, f.deliveries(),
		"the erased row's record stays, as a queued one does: its row is gone, retention never meets it")
}

// A batch in flight that holds a row erased meanwhile was read before the
// erasure and goes out as it is (a request cannot be recalled); the
// erased row's delivery stays recorded stopped, without its key: the
// batch's settle never writes the erased key back. The other rows of the
// batch are done, once, and the cursor passes the batch.
func TestErasureOfARowInACursorBatchInFlight(t *testing.T) {
	f := newCursorFlow(t)
	f.archive("orders", 1, 2, 3, 4)
	f.horizon(4)
	hold := make(chan chan bool)
	f.mu.Lock()
	f.hold = hold
	f.mu.Unlock()
	done := make(chan error, 1)
	go func() { done <- f.flush() }()
	reply := <-hold // the batch of 1, 2, 3 is in flight
	require.Equal(t, [][]string{f.ids(1, 2, 3)}, f.received())
	rc := f.erase(2)
	require.Equal(t, 1, rc.Removed["archive_v1.rows"])
	f.mu.Lock()
	f.hold = nil
	f.mu.Unlock()
	reply <- true
	require.NoError(t, <-done)
	require.Equal(t, [][]string{f.ids(1, 2, 3), f.ids(4)}, f.received(), "nothing sent twice")
	require.Equal(t, []string{
		f.id(1) + ` done done {"id": 1}`,
		f.id(2) + " stopped stop_revoked -",
		f.id(3) + ` done done {"id": 3}`,
		f.id(4) + ` done done {"id": 4}`,
	}, f.deliveries())
}
