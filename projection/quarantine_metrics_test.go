package projection_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// EpitaphQuarantineGrowing fires on increase() of
// epitaph_projector_quarantined_events_total. increase() cannot see the
// first sample of a series, and the alert's other half only covers a
// version's first entry ever (its epitaph_projector_quarantine_unresolved
// series is new), so a worker's first quarantined event of a category
// since it started, in a version that had entries before, was never
// alerted on unless the counter is exported at 0 before it.
func TestQuarantinedCounterIsExportedBeforeTheFirstEvent(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	s := e.start(e.config("w1"))
	series := func() map[string]bool {
		mfs, err := s.Registry().Gather()
		require.NoError(t, err)
		out := map[string]bool{}
		for _, mf := range mfs {
			if mf.GetName() != "epitaph_projector_quarantined_events_total" {
				continue
			}
			for _, m := range mf.GetMetric() {
				l := map[string]string{}
				for _, p := range m.GetLabel() {
					l[p.GetName()] = p.GetValue()
				}
				if l["projection"] == "archive" && l["version"] == "1" {
					out[l["category"]] = true
				}
			}
		}
		return out
	}
	eventually(t, 20*time.Second, func() bool { return metricSum(t, s, "epitaph_projector_version_state") > 0 },
		"the status was published")
	eventually(t, 5*time.Second, func() bool { return series()["malformed"] && series()["incompatible"] && series()["unauthenticated"] },
		"epitaph_projector_quarantined_events_total of archive v1 exported at 0 before any event is quarantined: got %v", series())
}
