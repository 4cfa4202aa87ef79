package projection_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/projection/status"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// Events/s come from two samples; the ETA is what is left to the
// boundary while building, the lag after.
func TestFillRates(t *testing.T) {
	at := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	sample := func(at time.Time, state string, done, toBoundary, lag uint64) *status.Status {
		return &status.Status{At: at, Versions: []status.VersionStatus{{Projection: "archive", Version: 2, State: state,
			LagEvents: lag, Lifecycle: &status.VersionLifecycle{EventsDone: done, EventsToBoundary: toBoundary, ETASeconds: -1}}}}
	}
	first := sample(at, version.StateBuilding, 1000, 10000, 9000)
	second := sample(at.Add(2*time.Second), version.StateBuilding, 3000, 10000, 7000)
	second.FillRates(first)
	lc := second.Versions[0].Lifecycle
	require.InDelta(t, 1000, lc.EventsPerSecond, 0.001)
	require.Equal(t, 7.0, lc.ETASeconds)

	third := sample(at.Add(4*time.Second), version.StateCatchingUp, 11000, 10000, 50)
	third.FillRates(second)
	lc = third.Versions[0].Lifecycle
	require.InDelta(t, 4000, lc.EventsPerSecond, 0.001)
	require.Equal(t, 0.0, lc.ETASeconds)

	none := sample(at.Add(6*time.Second), version.StateCatchingUp, 11000, 10000, 50)
	none.FillRates(nil)
	require.Equal(t, -1.0, none.Versions[0].Lifecycle.ETASeconds, "one sample: unknown")
}
