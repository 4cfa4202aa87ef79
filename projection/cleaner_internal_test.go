package projection

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/projection/retention"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// liveBusy follows the live version's pages: busy for a second after one
// was admitted.
func TestLiveBusy(t *testing.T) {
	s, err := New(Config{TargetURL: "postgres://x", NATSURL: "nats://x", WorkerID: "w"})
	require.NoError(t, err)
	live := version.Version{Projection: "archive", Version: 1, State: version.StateLive}
	s.setLive([]version.Version{live})
	clock := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	s.now = func() time.Time { return clock }
	require.False(t, s.liveBusy(), "nothing applied yet")
	release, err := s.admit(context.Background(), live)
	require.NoError(t, err)
	release()
	require.True(t, s.liveBusy())
	clock = clock.Add(liveIdle + time.Millisecond)
	require.False(t, s.liveBusy())
	require.Equal(t, retention.DefaultCleanupRate, s.cfg.CleanupRate)
}
