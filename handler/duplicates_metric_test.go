package handler

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
)

// EpitaphDeliveriesDuplicated (critical) fires on
// increase(epitaph_projector_delivery_duplicates_total[15m]) > 0, and
// increase() cannot see the first sample of a series: a handler's counter
// must be exported at 0 before its first duplicate, or the first (usually
// the only) duplicate of a process never raises the alert.
func TestDuplicatesCounterIsExportedBeforeTheFirstDuplicate(t *testing.T) {
	e := newCursorEnv(t)
	secret := NewSecret()
	_, srv := newBatchReceiver(t, secret, func(int) int { return 200 })
	def := e.handler(srv.URL, secret)
	lsns := e.archive("orders", true, 1, 2)
	e.horizon(lsns[1])
	preg := prometheus.NewRegistry()
	d, err := NewDispatcher(e.pool, Config{Poll: 20 * time.Millisecond, Registerer: preg})
	require.NoError(t, err)
	e.flush(d)
	require.Equal(t, []string{"done:done:1", "done:done:1"}, e.settled(def.ID), "the batch was sent")

	mfs, err := preg.Gather()
	require.NoError(t, err)
	found := false
	for _, mf := range mfs {
		if mf.GetName() != "epitaph_projector_delivery_duplicates_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "handler" && l.GetValue() == def.ID {
					found = true
					require.Zero(t, m.GetCounter().GetValue())
				}
			}
		}
	}
	require.True(t, found, "epitaph_projector_delivery_duplicates_total{handler=%q} exported at 0 once the handler's cursor runs", def.ID)
}
