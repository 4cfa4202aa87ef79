package handler

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// `deliveries discard` gives up a pending or dead delivery. An in-flight
// one is being sent: the receiver may get it whatever the record says, so
// discard must refuse it (as retry does) rather than record "discarded" for
// a delivery the receiver then accepts.
func TestDiscardRefusesAnInFlightDeliveryTheReceiverStillGets(t *testing.T) {
	e := newTenv(t)
	ctx := context.Background()
	arrived, release := make(chan struct{}, 1), make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		arrived <- struct{}{}
		<-release
		w.WriteHeader(http.StatusOK)
	}))
	defer srv.Close()
	e.addHandler(KindWebhook, srv.URL, func(d *Def) { d.Revalidate = false })
	e.enqueue(1, e.row(1))
	d := e.dispatcher(Config{})
	flushed := make(chan error, 1)
	go func() {
		fctx, cancel := context.WithTimeout(ctx, 60*time.Second)
		defer cancel()
		_, err := d.Flush(fctx)
		flushed <- err
	}()
	select {
	case <-arrived:
	case <-time.After(60 * time.Second):
		t.Fatal("the webhook was never called")
	}
	var id, state string
	require.NoError(t, e.pool.QueryRow(ctx, `SELECT id::text, state FROM epitaph.deliveries`).Scan(&id, &state))
	require.Equal(t, StateInFlight, state)

	discardErr := Discard(ctx, e.pool, id)
	close(release) // the receiver accepts it
	require.NoError(t, <-flushed)

	info, err := ShowDelivery(ctx, e.pool, id)
	require.NoError(t, err)
	require.Error(t, discardErr, "discard of an in-flight delivery was accepted; the receiver got it anyway (record: %s)", info.State)
	require.Contains(t, discardErr.Error(), "in_flight")
	require.Equal(t, StateDone, info.State, "the receiver accepted it")
}
