package observe_test

import (
	"context"
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/epitaph-dev/epitaph/internal/observe"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// start serves a /slow route that answers once release is closed and
// reports each request it received on entered.
func start(t *testing.T, ctx context.Context) (srv *observe.Server, entered chan struct{}, release chan struct{}) {
	t.Helper()
	entered, release = make(chan struct{}, 1), make(chan struct{})
	srv = observe.New(observe.Config{Addr: "127.0.0.1:0",
		Healthy: func(context.Context) error { return nil }})
	srv.Handle("GET /slow", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		entered <- struct{}{}
		select {
		case <-release:
			_, _ = io.WriteString(w, "finished")
		case <-r.Context().Done():
		}
	}))
	require.NoError(t, srv.Start(ctx))
	return srv, entered, release
}

// get requests path in the background and returns the body or the error.
func get(srv *observe.Server, path string) <-chan string {
	out := make(chan string, 1)
	go func() {
		resp, err := http.Get("http://" + srv.Addr() + path)
		if err != nil {
			out <- "error: " + err.Error()
			return
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			out <- "error: " + err.Error()
			return
		}
		out <- string(b)
	}()
	return out
}

func TestStopLetsTheRequestInFlightFinish(t *testing.T) {
	t.Parallel()
	srv, entered, release := start(t, context.Background())
	require.Equal(t, "ok\n", <-get(srv, "/healthz"))
	body := get(srv, "/slow")
	<-entered
	stopped := make(chan error, 1)
	go func() { stopped <- srv.Stop(context.Background()) }()
	select {
	case err := <-stopped:
		t.Fatalf("Stop returned with a request in flight: %v", err)
	case <-time.After(200 * time.Millisecond): // not a wait for an event: Stop must still be blocked
	}
	close(release)
	require.Equal(t, "finished", <-body)
	require.NoError(t, <-stopped)
	require.NoError(t, srv.Wait())
	_, err := http.Get("http://" + srv.Addr() + "/healthz")
	require.Error(t, err, "no longer listening")
}

func TestStopBoundedByItsContextCutsTheRequestOff(t *testing.T) {
	t.Parallel()
	srv, entered, _ := start(t, context.Background())
	body := get(srv, "/slow")
	<-entered
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	err := srv.Stop(ctx)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Contains(t, <-body, "error:", "the connection was closed")
}

func TestCancellingStartsContextClosesAtOnce(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	srv, entered, _ := start(t, ctx)
	body := get(srv, "/slow")
	<-entered
	cancel()
	require.Contains(t, <-body, "error:", "the connection was closed")
	require.NoError(t, srv.Wait())
}

func TestNoAddressServesNothing(t *testing.T) {
	t.Parallel()
	srv := observe.New(observe.Config{})
	require.NoError(t, srv.Start(context.Background()))
	require.Empty(t, srv.Addr())
	require.NoError(t, srv.Wait())
	require.NoError(t, srv.Stop(context.Background()))
	require.Error(t, srv.Start(context.Background()), "a server starts once")
}
