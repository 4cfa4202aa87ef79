package projection

import "github.com/prometheus/client_golang/prometheus"
import "github.com/epitaph-dev/epitaph/projection/status"
import "github.com/epitaph-dev/epitaph/projection/version"

// lifecycleMetrics show how far each version being built has come.
type lifecycleMetrics struct {
	progress   *prometheus.GaugeVec
	rate       *prometheus.GaugeVec
	eta        *prometheus.GaugeVec
	boundary   *prometheus.GaugeVec
	atBoundary *prometheus.GaugeVec
}

func newLifecycleMetrics(reg prometheus.Registerer) *lifecycleMetrics {
	pv := []string{"projection", "version"}
	m := &lifecycleMetrics{
		progress: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "epitaph_projector_version_progress_ratio",
			Help: "How far the version is to its boundary (events applied / events in the stream at the boundary); 1 once past it."}, pv),
		rate: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "epitaph_projector_version_events_per_second",
			Help: "Events the version applied per second between the last two status refreshes (all workers)."}, pv),
		eta: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "epitaph_projector_version_eta_seconds",
			Help: "Estimated seconds until the version reaches its boundary (building) or has no lag (after); -1 unknown."}, pv),
		boundary: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "epitaph_projector_version_boundary_seq",
			Help: "The stream's last sequence when the version was created."}, pv),
		atBoundary: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "epitaph_projector_version_partitions_at_boundary",
			Help: "Partitions of the version that applied every message up to the boundary."}, pv),
	}
	reg.MustRegister(m.progress, m.rate, m.eta, m.boundary, m.atBoundary)
	return m
}

func (m *lifecycleMetrics) publish(st *status.Status) {
	for _, g := range []*prometheus.GaugeVec{m.progress, m.rate, m.eta, m.boundary, m.atBoundary} {
		g.Reset()
	}
	for _, v := range st.Versions {
		lc := v.Lifecycle
		if lc == nil || v.State == version.StateRetired {
			continue
		}
		l := []string{v.Projection, itoa(v.Version)}
		m.boundary.WithLabelValues(l...).Set(float64(lc.BoundarySeq))
		if v.LagUnknown != "" {
			// Measured against the stream, which could not be read: no
			// series rather than a 0 nobody measured.
			continue
		}
		m.progress.WithLabelValues(l...).Set(lc.Progress)
		m.rate.WithLabelValues(l...).Set(lc.EventsPerSecond)
		m.eta.WithLabelValues(l...).Set(lc.ETASeconds)
		m.atBoundary.WithLabelValues(l...).Set(float64(lc.PartitionsAtBoundary))
	}
}
