package projection

import (
	"context"
	"testing"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// An empty fetch ends a window's read-back only when the stream no longer
// holds the message the read-back was to reach; while it does, the empty
// fetch is a server that did not answer in time, and the read-back fails
// (transient) rather than cut the window, which would refuse the real
// transaction and invent a gap.
func TestAnEmptyReadBackEndsOnlyWhereTheStreamEnds(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srv := testenv.NewNATS(t)
	nc, js := srv.Connect(t)
	defer nc.Close()
	const source = "readback"
	stream, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: event.StreamName(source), Subjects: []string{event.StreamSubjects(source)}})
	require.NoError(t, err)
	for i := 0; i < 3; i++ {
		_, err := js.Publish(ctx, event.CommitSubject(source, 0), []byte(`{}`))
		require.NoError(t, err)
	}
	w := &partitionWorker{stream: stream}

	require.ErrorContains(t, w.emptyReadBack(ctx, 1, 2), "did not answer in time", "the stream holds the message: the empty fetch timed out")
	require.NoError(t, stream.DeleteMsg(ctx, 2))
	require.NoError(t, w.emptyReadBack(ctx, 1, 2), "the message is gone: nothing more to read back")
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	require.ErrorContains(t, w.emptyReadBack(cancelled, 1, 3), "look up stream sequence 3", "a failed look-up is an error (transient), not the end")

	// The read-back itself: its fetch comes back empty (the server answers
	// 408; here because nothing matches the consumer's filter) while the
	// stream holds the page's message at 3. Before, the window was cut
	// there without an error.
	w.filter = event.CommitSubject(source, 1)
	w.cfg = &Config{VerifyWindowBytes: DefaultVerifyWindowBytes, Decoder: &event.Decoder{}}
	page := map[uint64]*item{3: {seq: 3, subject: event.CommitSubject(source, 0)}}
	_, err = w.readWindow(ctx, 1, 2, page)
	require.ErrorContains(t, err, "returned nothing before the page's message at 3")
}
