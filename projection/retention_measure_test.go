package projection_test

import (
	"testing"
	"time"
)

// A projector started with --cleanup-interval 0 deletes nothing, but still
// exports epitaph_projector_expired_oldest_seconds. The alert
// EpitaphRetentionBehind (max over the projectors) is the one that must
// fire when no projector cleans (its runbook: "check that some projector
// runs without --cleanup-interval 0"), so the gauge has to measure the
// rows due, not read 0 ("none") for a value nobody measured.
func TestExpiredOldestIsMeasuredWithoutCleanup(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	cfg := retentionConfig(e, "w1") // CleanupInterval -1: no cleanup here
	s := e.start(cfg)
	e.publish(e.nextTx(sessionRows(1, 3)...)) // committed 2026-11-30, TTL 1h
	c := e.conn()
	eventually(t, 20*time.Second, func() bool {
		return count(t, c, `SELECT count(*) FROM archive_v1.rows WHERE verified AND expires_at < now() - interval '1 hour'`) == 3
	})
	eventually(t, 30*time.Second, func() bool {
		return metricSum(t, s, "epitaph_projector_expired_oldest_seconds") > 3600
	}, "expired rows more than an hour past expires_at, nobody cleaning them: epitaph_projector_expired_oldest_seconds stays at %v",
		metricSum(t, s, "epitaph_projector_expired_oldest_seconds"))
	// Nothing was deleted: this worker does not clean.
	if n := count(t, c, `SELECT count(*) FROM archive_v1.rows`); n != 3 {
		t.Fatalf("a worker without cleanup deleted rows: %d left", n)
	}
}
