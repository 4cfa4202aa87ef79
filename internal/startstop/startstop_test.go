package startstop_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/epitaph-dev/epitaph/internal/startstop"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// worker is a component that works in pages: a page, once begun, runs to
// its end unless the hard stop abandons it.
type worker struct {
	startstop.Base
	pageStarted chan struct{}
	release     chan struct{} // closed: the page in flight may finish
	committed   int
	abandoned   int
}

func newWorker() *worker {
	return &worker{pageStarted: make(chan struct{}, 100), release: make(chan struct{})}
}

func (w *worker) Start(ctx context.Context) error {
	soft, hard, ok := w.StartInit(ctx)
	if !ok {
		return errors.New("already started")
	}
	go func() {
		for soft.Err() == nil {
			w.pageStarted <- struct{}{}
			select {
			case <-w.release:
				w.committed++
			case <-hard.Done():
				w.abandoned++
				w.Finish(nil)
				return
			}
		}
		w.Finish(nil)
	}()
	return nil
}

func TestSoftStopFinishesThePageInFlight(t *testing.T) {
	t.Parallel()
	w := newWorker()
	require.NoError(t, w.Start(context.Background()))
	require.Error(t, w.Start(context.Background()), "a Base starts once")
	<-w.pageStarted
	stopped := make(chan error, 1)
	go func() { stopped <- w.Stop(context.Background()) }()
	require.Eventually(t, w.StopRequested, 10*time.Second, time.Millisecond)
	select {
	case err := <-stopped:
		t.Fatalf("Stop returned before the page finished: %v", err)
	default:
	}
	close(w.release)
	require.NoError(t, <-stopped)
	require.NoError(t, w.Wait())
	require.Equal(t, 1, w.committed, "the page in flight was committed")
	require.Zero(t, w.abandoned)
	require.NoError(t, w.Stop(context.Background()), "Stop again is a no-op")
}

func TestStopTurnsHardWhenItsContextEnds(t *testing.T) {
	t.Parallel()
	w := newWorker()
	require.NoError(t, w.Start(context.Background()))
	<-w.pageStarted
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	err := w.Stop(ctx)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.ErrorContains(t, err, "stopped hard")
	require.Equal(t, 0, w.committed)
	require.Equal(t, 1, w.abandoned, "the page in flight was abandoned")
	<-w.Done()
}

func TestCancellingStartsContextIsTheHardStop(t *testing.T) {
	t.Parallel()
	w := newWorker()
	ctx, cancel := context.WithCancel(context.Background())
	require.NoError(t, w.Start(ctx))
	<-w.pageStarted
	cancel()
	require.NoError(t, w.Wait())
	require.Equal(t, 1, w.abandoned)
	require.NoError(t, w.Stop(context.Background()), "Stop after the end returns at once")
}

func TestBeforeStartAndFinishWithError(t *testing.T) {
	t.Parallel()
	var b startstop.Base
	require.NoError(t, b.Stop(context.Background()), "Stop before Start")
	require.NoError(t, b.Wait(), "Wait before Start")
	require.False(t, b.StopRequested())
	b.RequestStop()

	_, _, ok := b.StartInit(context.Background())
	require.True(t, ok)
	boom := errors.New("boom")
	b.Finish(boom)
	b.Finish(nil) // only the first counts
	require.ErrorIs(t, b.Wait(), boom)
	require.NoError(t, b.Stop(context.Background()))
	require.True(t, b.StopRequested(), "the end cancels the contexts")
}

func TestRequestStopThenStopEach(t *testing.T) {
	t.Parallel()
	ws := []*worker{newWorker(), newWorker(), newWorker()}
	for _, w := range ws {
		require.NoError(t, w.Start(context.Background()))
		<-w.pageStarted
	}
	for _, w := range ws {
		w.RequestStop()
	}
	for _, w := range ws {
		require.True(t, w.StopRequested())
		close(w.release)
	}
	for _, w := range ws {
		require.NoError(t, w.Stop(context.Background()))
		require.Equal(t, 1, w.committed)
	}
}
