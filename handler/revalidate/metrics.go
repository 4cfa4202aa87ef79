package revalidate

import (
	"errors"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

type metrics struct {
	outcomes *prometheus.CounterVec
	paths    *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		outcomes: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "epitaph_delivery_revalidations_total",
			Help: "Revalidations of deliveries before an attempt, by handler and outcome (send, stop_completed, stop_changed, stop_revoked, stop_superseded, defer)."},
			[]string{"handler", "outcome"}),
		paths: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "epitaph_delivery_revalidation_set_checks_total",
			Help: "Fingerprint checks of revalidations by path: cheap (the count and greatest identity matched) or full (the set was read and hashed)."},
			[]string{"path"}),
	}
	if reg == nil {
		return m, nil
	}
	for _, c := range []**prometheus.CounterVec{&m.outcomes, &m.paths} {
		if err := reg.Register(*c); err != nil {
			// Several evaluators on one registry share the counters.
			var are prometheus.AlreadyRegisteredError
			existing, ok := prometheus.Collector(nil), false
			if errors.As(err, &are) {
				existing = are.ExistingCollector
				_, ok = existing.(*prometheus.CounterVec)
			}
			if !ok {
				return nil, fmt.Errorf("register revalidation metrics: %w", err)
			}
			*c = existing.(*prometheus.CounterVec)
		}
	}
	return m, nil
}

func (m *metrics) observe(handlerID string, res Result) {
	m.outcomes.WithLabelValues(handlerID, string(res.Outcome)).Inc()
	if res.Path != "" {
		m.paths.WithLabelValues(res.Path).Inc()
	}
}
