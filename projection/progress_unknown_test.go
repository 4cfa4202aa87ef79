package projection_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/projection"
)

// gaugeSeries returns the values of a gauge's series of archive v1.
func gaugeSeries(t *testing.T, s *projection.Service, name string) []float64 {
	t.Helper()
	mfs, err := s.Registry().Gather()
	require.NoError(t, err)
	var out []float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			l := map[string]string{}
			for _, p := range m.GetLabel() {
				l[p.GetName()] = p.GetValue()
			}
			if l["projection"] == "archive" && l["version"] == "1" {
				out = append(out, m.GetGauge().GetValue())
			}
		}
	}
	return out
}

// While JetStream is down the lag of every version is unknown (the lag
// metrics have no series), and so is how far a version is: its progress,
// rate, ETA and partitions at the boundary are measured against the
// stream. They are not 0 (a live, caught-up version "0% done", no
// partition at its boundary): an unknown value has no series.
func TestVersionProgressIsUnknownWhileTheStreamIs(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	s := e.start(e.config("w1"))
	e.publish(e.nextTx(orderRows(1, 2)...))
	c := e.conn()
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 3 })
	eventually(t, 20*time.Second, func() bool {
		p := gaugeSeries(t, s, "epitaph_projector_version_progress_ratio")
		return len(p) == 1 && p[0] == 1
	}, "the live version is done")

	e.nats.Stop()
	// The status was refreshed without the stream: no lag series, the
	// version's state still published.
	eventually(t, 20*time.Second, func() bool {
		return len(gaugeSeries(t, s, "epitaph_projector_lag_events")) == 0 &&
			len(gaugeSeries(t, s, "epitaph_projector_version_state")) > 0
	}, "lag unknown while JetStream is down")
	time.Sleep(time.Second) // a few more refreshes
	for _, name := range []string{"epitaph_projector_version_progress_ratio", "epitaph_projector_version_events_per_second",
		"epitaph_projector_version_eta_seconds", "epitaph_projector_version_partitions_at_boundary"} {
		require.Empty(t, gaugeSeries(t, s, name), "%s while the stream cannot be read", name)
	}
	require.Len(t, gaugeSeries(t, s, "epitaph_projector_version_boundary_seq"), 1, "the boundary is the registry's, known")

	// Back: nothing was applied meanwhile, so no rate (a refresh without
	// the stream counted every event as not done yet, and the next one
	// all of them as done within one status interval).
	e.nats.Start()
	eventually(t, 20*time.Second, func() bool { return len(gaugeSeries(t, s, "epitaph_projector_lag_events")) == 2 },
		"lag measured again")
	require.Equal(t, []float64{0}, gaugeSeries(t, s, "epitaph_projector_version_events_per_second"), "events applied per second")
}
