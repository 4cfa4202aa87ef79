package projection_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection"
	"github.com/epitaph-dev/epitaph/quarantine"
)

// batchCounter is a webhook receiver counting the deliveries of the
// batches it got, by id.
type batchCounter struct {
	mu  sync.Mutex
	got map[string]int
	bad []string
}

func newBatchCounter(t *testing.T) (*batchCounter, *httptest.Server) {
	bc := &batchCounter{got: map[string]int{}}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		var b handler.BatchBody
		bc.mu.Lock()
		defer bc.mu.Unlock()
		if err := json.Unmarshal(body, &b); err != nil {
			bc.bad = append(bc.bad, err.Error())
		}
		for _, d := range b.Deliveries {
			bc.got[d.DeliveryID]++
		}
	}))
	t.Cleanup(srv.Close)
	return bc, srv
}

func (bc *batchCounter) counts() map[string]int {
	bc.mu.Lock()
	defer bc.mu.Unlock()
	out := make(map[string]int, len(bc.got))
	for k, v := range bc.got {
		out[k] = v
	}
	return out
}

// A cursor handler (a batching webhook without revalidation) gets a row
// that a quarantine replay archives behind its cursor once, on the queued
// path; a replayed row still ahead of its cursor is the cursor's. Through
// the runtime's apply and the replay's: orders A and E are quarantined
// (a wire version this build does not know), B, C and F applied; the
// cursor delivers B and C; A and E are replayed: A is behind the cursor,
// E ahead of it. Every order is delivered exactly once and has one
// delivery row, done.
func TestCursorHandlerGetsARowReplayedBehindItsCursorOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	ctx := context.Background()
	pool := newPool(t, e.url)
	require.NoError(t, migrations.Apply(ctx, pool))
	bc, srv := newBatchCounter(t)
	secretFile := filepath.Join(t.TempDir(), "hook.secret")
	require.NoError(t, os.WriteFile(secretFile, []byte(handler.NewSecret()+"\n"), 0o600))
	def := handler.Def{ID: "5d0c2a61-7a4e-4b8e-9c39-2f1f6a0e0c11", Schema: "public", Table: "orders", Kind: handler.KindWebhook,
		Target: srv.URL, Phase: handler.PhaseImmediate, MaxAttempts: 5, Backoff: 10 * time.Millisecond,
		ClaimTimeout: 30 * time.Second, BatchSize: 10, BatchWait: time.Second, SecretFile: secretFile}
	require.NoError(t, handler.Add(ctx, pool, def))
	require.True(t, def.UsesCursor())

	unknownVersion := func(tx *txn) {
		msgs := e.messages(tx)
		msgs[0].Data = bytes.Replace(msgs[0].Data, []byte(`"v":1`), []byte(`"v":2`), 1)
		e.publishAll(msgs)
	}
	order := func(id int) *txn { return e.nextTx(orderRows(id, 0)...) }
	a, b, c := order(1), order(2), order(3)
	unknownVersion(a)
	e.publish(b)
	e.publish(c)
	e.start(e.config("w1"))
	conn := e.conn()
	applied := func(quarantined int, last *txn) func() bool {
		return func() bool {
			return count(t, conn, `SELECT count(*) FROM epitaph.quarantine WHERE status = 'open'`) == quarantined &&
				count(t, conn, `SELECT count(*) FROM epitaph.progress WHERE projection = 'archive' AND source_lsn >= $1::pg_lsn`,
					last.lsn.String()) == 1
		}
	}
	eventually(t, 20*time.Second, applied(1, c), "A quarantined, C's commit applied")

	d, err := handler.NewDispatcher(pool, handler.Config{Source: src, Poll: 20 * time.Millisecond, Logger: testLogger(t)})
	require.NoError(t, err)
	flushAll(t, d)
	id := func(tx *txn) string { return handler.DeliveryID(def.ID, src, tx.lsn.String(), 0, 0) }
	require.Equal(t, map[string]int{id(b): 1, id(c): 1}, bc.counts(), "the cursor passed A's position")

	ee, f := order(4), order(5)
	unknownVersion(ee)
	e.publish(f)
	eventually(t, 20*time.Second, applied(2, f), "E quarantined, F's commit applied")
	apply := projection.ReplayFunc(projection.ReplayConfig{Logger: testLogger(t),
		Decoder: &event.Decoder{Upgraders: map[int]func([]byte) ([]byte, error){
			2: func(b []byte) ([]byte, error) { return bytes.Replace(b, []byte(`"v":2`), []byte(`"v":1`), 1), nil },
		}}})
	res, err := quarantine.Replay(ctx, pool, quarantine.Selection{Filter: quarantine.Filter{Projection: "archive"}}, apply)
	require.NoError(t, err)
	require.Len(t, res.Replayed, 2)
	require.Equal(t, []string{"orders pending"}, keysOf(t, conn, `SELECT concat_ws(' ', table_name, state)
		FROM epitaph.deliveries WHERE state <> 'done'`), "A is queued (behind the cursor), E is not (ahead of it)")

	flushAll(t, d)
	require.Equal(t, map[string]int{id(a): 1, id(b): 1, id(c): 1, id(ee): 1, id(f): 1}, bc.counts(), "each order once")
	require.Empty(t, bc.bad)
	require.Equal(t, []string{"done", "done", "done", "done", "done"}, keysOf(t, conn, `SELECT state FROM epitaph.deliveries
		ORDER BY commit_lsn`))
}
