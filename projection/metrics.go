package projection

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/status"
	"github.com/epitaph-dev/epitaph/projection/version"
	"github.com/epitaph-dev/epitaph/quarantine"
)

func itoa(i int) string { return strconv.Itoa(i) }

// metrics are the projector's Prometheus metrics (names fixed by the
// shared contract).
type metrics struct {
	lagEvents        *prometheus.GaugeVec
	lagSeconds       *prometheus.GaugeVec
	oldestPending    *prometheus.GaugeVec
	partitionOldest  *prometheus.GaugeVec
	applied          *prometheus.CounterVec
	replayed         *prometheus.CounterVec
	quarantined      *prometheus.CounterVec
	versionState     *prometheus.GaugeVec
	owned            *prometheus.GaugeVec
	unowned          *prometheus.GaugeVec
	heartbeatAge     *prometheus.GaugeVec
	transient        *prometheus.CounterVec
	rewinds          *prometheus.CounterVec
	consumerResets   *prometheus.CounterVec
	statusRefreshErr prometheus.Counter
	gaps             *prometheus.GaugeVec
}

func newMetrics(reg prometheus.Registerer) *metrics {
	pvp := []string{"projection", "version", "partition"}
	pv := []string{"projection", "version"}
	m := &metrics{
		lagEvents: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "epitaph_projector_lag_events",
			Help: "Events of the partition in the stream not yet applied."}, pvp),
		lagSeconds: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "epitaph_projector_lag_seconds",
			Help: "How long the oldest unapplied event of the partition has been in the stream (0 when caught up)."}, pvp),
		oldestPending: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "epitaph_projector_oldest_pending_age_seconds",
			Help: "Age of the oldest unapplied event over all partitions of the version."}, pv),
		partitionOldest: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "epitaph_projector_partition_oldest_pending_age_seconds",
			Help: "Age of the oldest unapplied event of the partition (stream timestamp)."}, pvp),
		applied: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "epitaph_projector_applied_events_total",
			Help: "Events applied by this worker."}, pv),
		replayed: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "epitaph_projector_replayed_events_total",
			Help: "Signed messages (commits, marks) published again after they were applied (partition sequence not above the last applied one, position not new): ignored with their transaction's rows."}, pv),
		quarantined: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "epitaph_projector_quarantined_events_total",
			Help: "Events this worker set aside in quarantine, by category."}, []string{"projection", "version", "category"}),
		versionState: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "epitaph_projector_version_state",
			Help: "1 for the current state of each projection version."}, []string{"projection", "version", "state"}),
		owned: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "epitaph_projector_partitions_owned",
			Help: "Partitions of the version leased by this worker."}, pv),
		unowned: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "epitaph_projector_partitions_unowned",
			Help: "Partitions of the version with no valid lease by any worker."}, pv),
		heartbeatAge: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "epitaph_projector_worker_heartbeat_age_seconds",
			Help: "Seconds since each registered worker's last heartbeat."}, []string{"worker"}),
		transient: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "epitaph_projector_transient_errors_total",
			Help: "Transient failures retried with backoff, by kind."}, []string{"kind"}),
		rewinds: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "epitaph_projector_rewinds_total",
			Help: "Partitions rewound because the stream lost its tail."}, pv),
		consumerResets: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "epitaph_projector_consumer_resets_total",
			Help: "Durable consumers deleted and recreated at the cursor because they stood elsewhere (another reader moved them, a crash between commit and ack), by reason: ack_pending, ack_floor, stalled, config."},
			[]string{"projection", "version", "reason"}),
		statusRefreshErr: prometheus.NewCounter(prometheus.CounterOpts{Name: "epitaph_projector_status_errors_total",
			Help: "Failed refreshes of the lag metrics."}),
		gaps: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "epitaph_projector_gaps",
			Help: "Rows of the version's gaps table (archive.gaps for the live version) by kind and acknowledgement: lost_upstream and removed_from_stream keep the archive from being ready until acknowledged; truncate is informational."},
			[]string{"version", "kind", "acknowledged"}),
	}
	reg.MustRegister(m.lagEvents, m.lagSeconds, m.oldestPending, m.partitionOldest, m.applied, m.replayed, m.quarantined,
		m.versionState, m.owned, m.unowned, m.heartbeatAge, m.transient, m.rewinds, m.consumerResets, m.statusRefreshErr, m.gaps)
	return m
}

// statusUnknown drops the series of what changes with time: the status
// could not be collected, so no lag was measured, and the leases (they
// expire) and heartbeats (they age) were not read (an unknown value has no
// series, never a stale one).
func (m *metrics) statusUnknown() {
	m.lagEvents.Reset()
	m.lagSeconds.Reset()
	m.partitionOldest.Reset()
	m.oldestPending.Reset()
	m.owned.Reset()
	m.unowned.Reset()
	m.heartbeatAge.Reset()
}

// publish sets the gauges from a status document.
func (m *metrics) publish(st *status.Status) {
	m.lagEvents.Reset()
	m.lagSeconds.Reset()
	m.partitionOldest.Reset()
	m.oldestPending.Reset()
	m.versionState.Reset()
	m.owned.Reset()
	m.unowned.Reset()
	m.heartbeatAge.Reset()
	m.gaps.Reset()
	for _, v := range st.Versions {
		ver := itoa(v.Version)
		for _, s := range version.States {
			val := 0.0
			if s == v.State {
				val = 1
			}
			m.versionState.WithLabelValues(v.Projection, ver, s).Set(val)
		}
		if v.State == version.StateRetired {
			continue
		}
		// Every category exists at 0 before its first event: increase()
		// (EpitaphQuarantineGrowing) cannot see a series' first sample.
		for _, c := range quarantine.Categories {
			m.quarantined.WithLabelValues(v.Projection, ver, string(c))
		}
		if v.LagUnknown == "" { // an unknown lag has no series, never a 0
			m.oldestPending.WithLabelValues(v.Projection, ver).Set(v.OldestPendingAgeSeconds)
		}
		if v.Projection == archive.Projection {
			// Every kind is exported, 0 when there is none, so alerts see it.
			for _, k := range []string{event.GapLostUpstream, event.GapRemovedFromStream, event.GapTruncate} {
				m.gaps.WithLabelValues(ver, k, "false").Set(0)
				m.gaps.WithLabelValues(ver, k, "true").Set(0)
			}
			for _, c := range v.GapCounts {
				m.gaps.WithLabelValues(ver, c.Kind, strconv.FormatBool(c.Acknowledged)).Set(float64(c.Count))
			}
		}
		owned, unowned := 0, 0
		for _, p := range v.Partitions {
			part := itoa(p.Partition)
			if p.LagUnknown == "" {
				m.lagEvents.WithLabelValues(v.Projection, ver, part).Set(float64(p.LagEvents))
				m.lagSeconds.WithLabelValues(v.Projection, ver, part).Set(p.LagSeconds)
				m.partitionOldest.WithLabelValues(v.Projection, ver, part).Set(p.OldestPendingAgeSeconds)
			}
			if !p.Leased {
				unowned++
			} else if p.Owner == st.Worker {
				owned++
			}
		}
		m.owned.WithLabelValues(v.Projection, ver).Set(float64(owned))
		m.unowned.WithLabelValues(v.Projection, ver).Set(float64(unowned))
	}
	for _, w := range st.Workers {
		m.heartbeatAge.WithLabelValues(w.ID).Set(w.HeartbeatAgeSeconds)
	}
}
