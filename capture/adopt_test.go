package capture

import (
	"context"
	"fmt"
	"log/slog"
	"testing"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// The adopter reads every stored candidate after the resume point, in
// stream order, skipping deleted messages, whether they are in the middle
// (the batch read steps over them) or at the end (a batch comes back empty
// before the last candidate: the rest is read one message at a time, and
// only the stream's "not found" ends it). Batches, not a request per
// message: the whole walk takes a few API requests.
func TestAdopterReadsEveryStoredCandidate(t *testing.T) {
	t.Parallel()
	n := testenv.NewNATS(t)
	nc, js := n.Connect(t)
	ctx := context.Background()
	st, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "ADOPT", Subjects: []string{"adopt.>"}, Storage: jetstream.FileStorage})
	require.NoError(t, err)
	const total = 3000
	for i := 1; i <= total; i++ {
		_, err := js.Publish(ctx, fmt.Sprintf("adopt.%d", i%4), []byte(fmt.Sprintf("m%d", i)))
		require.NoError(t, err)
	}
	deleted := map[uint64]bool{}
	for _, seq := range []uint64{1500, 1501, 2999, 3000} { // inside, and the tail
		require.NoError(t, st.DeleteMsg(ctx, seq))
		deleted[seq] = true
	}
	before, err := js.AccountInfo(ctx)
	require.NoError(t, err)

	a := &adopter{s: &Service{nc: nc, log: slog.New(slog.DiscardHandler)}, st: st, next: 1000, to: total}
	var got []uint64
	for {
		m, more, err := a.read(ctx)
		require.NoError(t, err)
		if !more {
			break
		}
		require.Equal(t, fmt.Sprintf("m%d", m.seq), string(m.data))
		require.Equal(t, fmt.Sprintf("adopt.%d", m.seq%4), m.subject)
		got = append(got, m.seq)
	}
	var want []uint64
	for seq := uint64(1000); seq <= total; seq++ {
		if !deleted[seq] {
			want = append(want, seq)
		}
	}
	require.Equal(t, want, got)
	require.True(t, a.direct, "the deleted tail was read one message at a time")
	_, more, err := a.read(ctx)
	require.NoError(t, err)
	require.False(t, more, "nothing after the last candidate")

	after, err := js.AccountInfo(ctx)
	require.NoError(t, err)
	requests := after.API.Total - before.API.Total - 1
	t.Logf("%d candidates read with %d API requests", len(got), requests)
	require.Less(t, requests, uint64(50), "one request per candidate")
}
