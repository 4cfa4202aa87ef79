package handler

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync"
	"testing"
	"time"

	standardwebhooks "github.com/standard-webhooks/standard-webhooks/libraries/go"
	"github.com/stretchr/testify/require"
)

// batchReceiver takes batches, verifies each with the Standard Webhooks
// library and records it; answer decides from the number of POSTs so far
// (this one included).
type batchReceiver struct {
	t      *testing.T
	wh     *standardwebhooks.Webhook
	answer func(n int) int
	mu     sync.Mutex
	posts  []batchPost
	bad    []string
}

type batchPost struct {
	id, attempt, size string
	body              []byte
	ds                []Body
	at                time.Time
}

func newBatchReceiver(t *testing.T, secret string, answer func(n int) int) (*batchReceiver, *httptest.Server) {
	br := &batchReceiver{t: t, wh: verifier(t, secret), answer: answer}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		var b BatchBody
		err := json.Unmarshal(body, &b)
		br.mu.Lock()
		if err != nil {
			br.bad = append(br.bad, "not a batch: "+err.Error())
		}
		if err := br.wh.Verify(body, r.Header); err != nil {
			br.bad = append(br.bad, err.Error())
		}
		if r.Header.Get(HeaderDeliveryID) != "" {
			br.bad = append(br.bad, "a batch has no Epitaph-Delivery-Id")
		}
		br.posts = append(br.posts, batchPost{id: r.Header.Get("webhook-id"), attempt: r.Header.Get(HeaderAttempt),
			size: r.Header.Get(HeaderBatchSize), body: body, ds: b.Deliveries, at: time.Now()})
		n := len(br.posts)
		br.mu.Unlock()
		w.WriteHeader(answer(n))
	}))
	t.Cleanup(srv.Close)
	return br, srv
}

func (br *batchReceiver) got() []batchPost {
	br.mu.Lock()
	defer br.mu.Unlock()
	require.Empty(br.t, br.bad, "every batch verifies")
	return append([]batchPost(nil), br.posts...)
}

func ids(p batchPost) []string {
	out := make([]string, len(p.ds))
	for i, b := range p.ds {
		out[i] = b.DeliveryID
	}
	return out
}

func batchHandler(t *testing.T, size int, wait time.Duration, secret string) func(*Def) {
	return func(d *Def) {
		d.BatchSize, d.BatchWait, d.SecretFile = size, wait, writeSecret(t, secret)
	}
}

// A batch the receiver fails is retried as a whole: the same deliveries,
// the same webhook-id and byte-identical body, each delivery's attempt
// and last_error recording the batch's answer.
func TestWebhookBatchFailedAsAWholeIsRetriedAsAWhole(t *testing.T) {
	e := newTenv(t)
	secret := NewSecret()
	br, srv := newBatchReceiver(t, secret, func(n int) int {
		if n == 1 {
			return 503
		}
		return 200
	})
	e.addHandler(KindWebhook, srv.URL, batchHandler(t, 3, 50*time.Millisecond, secret))
	e.enqueue(1, e.row(1), e.row(2), e.row(3))
	e.flush(e.dispatcher(Config{}))
	posts := br.got()
	require.Len(t, posts, 2)
	require.Len(t, posts[0].ds, 3)
	require.Equal(t, ids(posts[0]), ids(posts[1]), "the same deliveries, in the same order")
	require.Equal(t, string(posts[0].body), string(posts[1].body), "byte-identical")
	require.Equal(t, BatchID(ids(posts[0])), posts[0].id)
	require.Equal(t, posts[0].id, posts[1].id, "one webhook-id for the batch")
	require.Equal(t, []string{"1", "2"}, []string{posts[0].attempt, posts[1].attempt})
	require.Equal(t, "3", posts[0].size)
	keys := map[string]bool{}
	for _, b := range posts[0].ds {
		keys[string(b.Key)] = true
	}
	require.Equal(t, map[string]bool{`{"id":1}`: true, `{"id":2}`: true, `{"id":3}`: true}, keys)
	for _, r := range e.deliveries() {
		require.Equal(t, StateDone, r.State)
		require.Equal(t, 2, r.Attempt)
		require.Contains(t, *r.LastError, "code=http_503", "the batch's answer on each delivery")
	}
}

// A key's deliveries are sent in commit order across batches: never two
// in one batch, and a later one only after the earlier one succeeded,
// also when the earlier one's batch failed and was retried.
func TestWebhookBatchKeepsAKeysOrderAcrossBatches(t *testing.T) {
	e := newTenv(t)
	secret := NewSecret()
	br, srv := newBatchReceiver(t, secret, func(n int) int {
		if n == 1 {
			return 503
		}
		return 200
	})
	e.addHandler(KindWebhook, srv.URL, batchHandler(t, 2, 50*time.Millisecond, secret))
	// Keys 1 and 2 deleted three times each, key 3 once, in this order.
	var rows []Row
	order := map[string]int{} // correlation id -> position in commit order
	for i, k := range []int{1, 2, 1, 3, 2, 1, 2} {
		r := e.row(k)
		order[r.CorrelationID] = i
		rows = append(rows, r)
	}
	e.enqueue(1, rows...)
	e.flush(e.dispatcher(Config{}))
	posts := br.got()
	sent := map[string]int{} // key -> the position of its last delivery acknowledged
	acked := 0
	for n, p := range posts {
		inPost := map[string]bool{}
		for _, b := range p.ds {
			k := string(b.Key)
			require.False(t, inPost[k], "post %d: two deliveries of key %s", n+1, k)
			inPost[k] = true
			pos := order[b.CorrelationID]
			for _, r := range rows {
				if string(r.Key) == k && order[r.CorrelationID] < pos {
					last, ok := sent[k]
					require.True(t, ok && last >= order[r.CorrelationID],
						"post %d sends key %s's delivery %d before its delivery %d was acknowledged", n+1, k, pos, order[r.CorrelationID])
				}
			}
		}
		if n == 0 {
			continue // refused: nothing acknowledged
		}
		for _, b := range p.ds {
			sent[string(b.Key)] = order[b.CorrelationID]
			acked++
		}
	}
	require.Equal(t, len(rows), acked, "every delivery acknowledged once")
	require.GreaterOrEqual(t, len(posts), 4, "a key's three deliveries need three batches, after the refused one")
	for _, r := range e.deliveries() {
		require.Equal(t, StateDone, r.State)
	}
}

// A delivery that revalidation stops leaves its batch (the rest is sent
// without it); a full batch is sent at once, a partial one after the
// batch wait; at the stop, a partial batch still waiting is handed back
// unstarted (no attempt spent).
func TestWebhookBatchRevalidationAndWait(t *testing.T) {
	e := newTenv(t)
	secret := NewSecret()
	br, srv := newBatchReceiver(t, secret, func(int) int { return 200 })
	e.addHandler(KindWebhook, srv.URL, batchHandler(t, 3, 3*time.Second, secret), func(d *Def) { d.ClaimTimeout = time.Minute })
	stop := func(_ context.Context, d Delivery) (Decision, error) {
		var k struct{ ID int }
		if json.Unmarshal(d.Key, &k) == nil && k.ID == 2 {
			return Decision{Outcome: StopCompleted}, nil
		}
		return Decision{Outcome: Send}, nil
	}
	d := e.dispatcher(Config{Revalidate: stop})
	e.enqueue(1, e.row(1), e.row(2), e.row(3))
	start := time.Now()
	require.NoError(t, d.Start(context.Background()))
	eventually(t, func() bool { return len(br.got()) == 1 }, "the full batch is sent")
	posts := br.got()
	require.Less(t, posts[0].at.Sub(start), 3*time.Second, "a full batch does not wait")
	require.Len(t, posts[0].ds, 2)
	require.Equal(t, `{"id":1}`, string(posts[0].ds[0].Key))
	require.Equal(t, `{"id":3}`, string(posts[0].ds[1].Key))
	eventually(t, func() bool {
		ds := e.deliveries()
		return ds[0].State == StateDone && ds[1].State == StateStopped && ds[2].State == StateDone
	}, "settled")
	require.Equal(t, string(StopCompleted), e.deliveries()[1].Outcome)

	// One more: a partial batch, sent after the wait.
	e.enqueue(1, e.row(4))
	at := time.Now()
	eventually(t, func() bool { return len(br.got()) == 2 }, "the partial batch is sent after the wait")
	require.GreaterOrEqual(t, br.got()[1].at.Sub(at), 3*time.Second)
	require.Len(t, br.got()[1].ds, 1)

	// A partial batch held at the stop is handed back.
	e.enqueue(1, e.row(5))
	eventually(t, func() bool {
		var n int
		require.NoError(t, e.pool.QueryRow(context.Background(), `SELECT count(*) FROM epitaph.deliveries WHERE state = 'in_flight'`).Scan(&n))
		return n == 1
	}, "claimed and held")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, d.Stop(ctx))
	require.NoError(t, d.Wait())
	ds := e.deliveries()
	require.Equal(t, StatePending, ds[4].State)
	require.Zero(t, ds[4].Attempt, "handed back: no attempt spent")
	require.Len(t, br.got(), 2, "never sent")
}

// Batching is for webhooks, bounded, and its wait fits in the claim.
func TestBatchSettingsAreValidated(t *testing.T) {
	base := Def{ID: newUUID(), Schema: "public", Table: "t", Kind: KindWebhook, Target: "https://h.example/", MaxAttempts: 1,
		Backoff: time.Second, ClaimTimeout: time.Minute}
	for i, mod := range []func(*Def){
		func(d *Def) { d.BatchSize = MaxBatchSize + 1; d.BatchWait = time.Second },
		func(d *Def) { d.BatchSize = -1 },
		func(d *Def) { d.BatchSize = 10 },
		func(d *Def) { d.BatchSize = 10; d.BatchWait = 7 * time.Second },
		func(d *Def) {
			d.BatchSize = 10
			d.BatchWait = time.Second
			d.Kind = KindExec
			d.Target = `["/bin/true"]`
		},
	} {
		d := base
		mod(&d)
		require.Error(t, d.Validate(), fmt.Sprint(i))
	}
	d := base
	d.BatchSize, d.BatchWait = 100, time.Second
	require.NoError(t, d.Validate())
	d = base
	d.BatchWait = time.Second
	require.NoError(t, d.Validate())
	require.Equal(t, 1, d.BatchSize)
	require.Zero(t, d.BatchWait, "no batch, no wait")
}

// A claim that held deliveries of batching handlers makes the next claim
// deep enough to fill a batch of each of them: with three handlers of
// batch size 100 interleaved in due order, a claim of claimAhead (64)
// fills none of their batches; the next claim takes the rest of the 300 at
// once. The handlers then send three full batches, none partial.
func TestClaimFillsTheBatchesOfEveryBatchingHandler(t *testing.T) {
	e := newTenv(t)
	ctx := context.Background()
	br := threeBatchingWebhooks(t, e)

	d := e.dispatcher(Config{Parallelism: 1})
	take := func() []*claimed {
		var cs []*claimed
		for len(d.queue) > 0 {
			cs = append(cs, <-d.queue)
		}
		return cs
	}
	n, err := d.claimAhead(ctx)
	require.NoError(t, err)
	require.Equal(t, claimAhead(1), n, "a cold dispatcher claims claimAhead")
	first := take()
	n, err = d.claimAhead(ctx)
	require.NoError(t, err)
	require.Equal(t, 300-claimAhead(1), n, "room for a batch of each of the three handlers")
	d.handBack(ctx, append(first, take()...))
	for _, r := range e.deliveries() {
		require.Equal(t, StatePending, r.State)
		require.Zero(t, r.Attempt, "handed back: no attempt spent")
	}

	start := time.Now()
	d = e.dispatcher(Config{Parallelism: 1})
	require.NoError(t, d.Start(ctx))
	eventually(t, func() bool { return len(br.got()) == 3 }, "three batches")
	require.Less(t, time.Since(start), 5*time.Second, "full batches do not wait")
	for _, p := range br.got() {
		require.Len(t, p.ds, 100)
	}
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	require.NoError(t, d.Stop(sctx))
	require.NoError(t, d.Wait())
	for _, r := range e.deliveries() {
		require.Equal(t, StateDone, r.State)
	}
}

// Flush sizes its claims as the claim loop does: with three handlers of
// batch size 100 interleaved in due order, its first claim of claimAhead
// (64) fills none of their batches, and the claim after it takes the
// other 236 at once, so the 300 deliveries go in six POSTs (three partial
// batches, then one of each handler's remainder), not in a claim of 64
// split three ways each time (fifteen).
func TestFlushFillsTheBatchesOfEveryBatchingHandler(t *testing.T) {
	e := newTenv(t)
	br := threeBatchingWebhooks(t, e)
	require.Equal(t, 64, claimAhead(1))

	e.flush(e.dispatcher(Config{Parallelism: 1}))
	posts := br.got()
	var sizes []int
	seen := map[string]bool{}
	for _, p := range posts {
		sizes = append(sizes, len(p.ds))
		for _, id := range ids(p) {
			require.False(t, seen[id], "delivery %s sent once", id)
			seen[id] = true
		}
	}
	slices.Sort(sizes)
	require.Equal(t, []int{21, 21, 22, 78, 79, 79}, sizes, "a claim of 64 split three ways, then the rest at once")
	require.Len(t, seen, 300)
	for _, r := range e.deliveries() {
		require.Equal(t, StateDone, r.State)
	}
}

// The batch room counts each batching handler's size once, ignores
// handlers that do not batch, and is bounded by the queue's spare room.
func TestBatchRoomCountsEachBatchingHandlerOnce(t *testing.T) {
	c := func(id, kind string, size int) *claimed {
		return &claimed{def: Def{ID: id, Kind: kind, BatchSize: size}}
	}
	require.Zero(t, batchRoomFor(nil))
	require.Zero(t, batchRoomFor([]*claimed{c("a", KindWebhook, 1), c("b", KindGo, 1)}))
	require.Equal(t, 150, batchRoomFor([]*claimed{c("a", KindWebhook, 100), c("a", KindWebhook, 100),
		c("b", KindWebhook, 50), c("g", KindGo, 1)}))
	require.Equal(t, maxBatchRoom, batchRoomFor([]*claimed{c("a", KindWebhook, MaxBatchSize),
		c("b", KindWebhook, MaxBatchSize), c("c", KindWebhook, MaxBatchSize)}))
}

// threeBatchingWebhooks adds a webhook handler of batch size 100 on each of
// the tables a, b and c, all to one receiver answering 200, and enqueues
// 300 deliveries interleaved across them in due order. The handlers
// revalidate, which keeps them on the queued path (a batching webhook
// without revalidation follows a cursor: see
// TestCursorHandlersEachFillTheirOwnBatches).
func threeBatchingWebhooks(t *testing.T, e *tenv) *batchReceiver {
	t.Helper()
	secret := NewSecret()
	br, srv := newBatchReceiver(t, secret, func(int) int { return 200 })
	tables := []string{"a", "b", "c"}
	for _, tb := range tables {
		def := e.addHandler(KindWebhook, srv.URL, batchHandler(t, 100, 5*time.Second, secret),
			func(d *Def) { d.Table, d.Revalidate, d.ClaimTimeout = tb, true, time.Minute })
		require.False(t, def.UsesCursor())
	}
	rows := make([]Row, 300)
	for i := range rows {
		rows[i] = e.row(i + 1)
		rows[i].Table = tables[i%3]
	}
	e.enqueue(1, rows...)
	return br
}
