package handler

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A webhook that answers a POST with a redirect has not accepted the
// delivery: only a 2xx is done (docs/handlers.md, "Retries and dead
// letters"). The client must not follow the redirect with a GET and count
// the GET's 200 as the webhook's answer.
func TestWebhookRedirectIsNotDone(t *testing.T) {
	e := newTenv(t)
	var mu sync.Mutex
	var posts, gets int
	var postBodies []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		defer mu.Unlock()
		switch r.URL.Path {
		case "/hook":
			posts++
			postBodies = append(postBodies, string(b))
			http.Redirect(w, r, "/login", http.StatusFound)
		default:
			gets++
			w.WriteHeader(http.StatusOK) // a login page, say
		}
	}))
	defer srv.Close()
	e.addHandler(KindWebhook, srv.URL+"/hook", func(d *Def) { d.Revalidate = false; d.MaxAttempts = 1 })
	e.enqueue(1, e.row(1))
	d := e.dispatcher(Config{})
	e.flush(d)
	ds := e.deliveries()
	require.Len(t, ds, 1)
	mu.Lock()
	t.Logf("POSTs %d, GETs of the redirect target %d", posts, gets)
	mu.Unlock()
	require.NotEqual(t, StateDone, ds[0].State, "a 302 answer to the POST is not the webhook accepting it (state %s, outcome %s)", ds[0].State, ds[0].Outcome)
}

// A stopped delivery of a revoked handler can never run again (the claim
// skips revoked handlers, and flush does not wait for it): retry must say
// so rather than put it back to pending, where it stays for ever.
func TestRetryOfARevokedHandlersDeliveryIsRefused(t *testing.T) {
	e := newTenv(t)
	ctx := context.Background()
	// h fails permanently (dead); a later handler of the row, disabled,
	// keeps the row open, so h's dead delivery keeps its payload.
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusBadRequest) }))
	defer srv.Close()
	h := e.addHandler(KindWebhook, srv.URL, func(d *Def) { d.Revalidate = false })
	later := e.addHandler(KindWebhook, srv.URL, func(d *Def) { d.Revalidate = false; d.Priority = 1 })
	require.NoError(t, SetEnabled(ctx, e.pool, later.ID, false))
	e.enqueue(1, e.row(1))
	e.flush(e.dispatcher(Config{}))
	var id string
	require.NoError(t, e.pool.QueryRow(ctx, `SELECT id::text FROM epitaph.deliveries WHERE handler_id = $1 AND state = 'dead'`, h.ID).Scan(&id))
	// The operator revokes h, then retries its dead deliveries.
	_, err := Revoke(ctx, e.pool, h.ID)
	require.NoError(t, err)
	err = Retry(ctx, e.pool, id)
	if err == nil {
		info, serr := ShowDelivery(ctx, e.pool, id)
		require.NoError(t, serr)
		fctx, cancel := context.WithTimeout(ctx, 3*time.Second)
		defer cancel()
		left, _ := e.dispatcher(Config{}).Flush(fctx)
		after, _ := ShowDelivery(ctx, e.pool, id)
		t.Fatalf("retry of a revoked handler's delivery was accepted (state %s); flush then leaves %d open and the delivery stays %s for ever",
			info.State, left, after.State)
	}
	t.Logf("refused: %v", err)
}

// "exponential backoff from the handler's --backoff (doubling, ±25%
// jitter, at most an hour)" holds for a base above an hour too: every
// delay is at most an hour ±25% (the first waited the whole base, 2h ±
// 25%, and the second about an hour).
func TestBackoffBaseAboveAnHour(t *testing.T) {
	d := Def{ID: newUUID(), Schema: "public", Table: "orders", Kind: KindWebhook, Target: "https://x.example/h",
		MaxAttempts: 5, Backoff: 2 * time.Hour, ClaimTimeout: time.Minute}
	if err := d.Validate(); err != nil {
		return // refused: fine
	}
	first, second := Backoff(d.Backoff, 1), Backoff(d.Backoff, 2)
	t.Logf("--backoff 2h: first retry after %s, second after %s", first, second)
	require.LessOrEqual(t, first, time.Hour+15*time.Minute, "at most an hour (±25%%)")
	require.LessOrEqual(t, first, second*5/3, "the delays do not shrink")
}
