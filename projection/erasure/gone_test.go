package erasure

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// A message deleted already (another purge of the same erasure ran at the
// same time) counts as gone, as a message deleted now does; a delete the
// server did not do (a stream that denies deletes) does not.
func TestDeleteOfADeletedMessageCountsAsGone(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	srv := testenv.NewNATS(t)
	nc, err := nats.Connect(srv.URL)
	require.NoError(t, err)
	defer nc.Close()
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	stream, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "GONE", Subjects: []string{"gone.>"}})
	require.NoError(t, err)
	for range 2 {
		_, err = js.Publish(ctx, "gone.x", []byte("m"))
		require.NoError(t, err)
	}
	require.True(t, gone(stream.SecureDeleteMsg(ctx, 1)))
	again := stream.SecureDeleteMsg(ctx, 1)
	require.Error(t, again)
	require.True(t, gone(again), "deleted already: %v", again)

	cfg := stream.CachedInfo().Config
	cfg.DenyDelete = true
	stream, err = js.UpdateStream(ctx, cfg)
	require.NoError(t, err)
	refused := stream.SecureDeleteMsg(ctx, 2)
	require.Error(t, refused)
	require.False(t, gone(refused), "refused: %v", refused)
	require.False(t, gone(errors.New("nats: timeout")))
}
