package statuspage

import (
	"context"
	"errors"
	"fmt"
	"net"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/projection/status"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// The reason a page shows is a class, never the error's text (which names
// hosts, users and values).
func TestUnavailableReason(t *testing.T) {
	t.Parallel()
	const secretish = "host=db.internal user=alice password=hunter2"
	wrap := func(err error) error { return fmt.Errorf("list versions (%s): %w", secretish, err) }
	for _, tc := range []struct {
		err  error
		want string
	}{
		{wrap(context.DeadlineExceeded), "the target database did not answer in time"},
		{wrap(&pgconn.PgError{Code: "28P01", Message: secretish}), "refused the credentials (SQLSTATE 28P01)"},
		{wrap(&pgconn.PgError{Code: "42P01", Message: secretish}), "no Epitaph schema: run projector migrate up (SQLSTATE 42P01)"},
		{wrap(&pgconn.PgError{Code: "57P01", Message: secretish}), "shutting down or unavailable (SQLSTATE 57P01)"},
		{wrap(&pgconn.PgError{Code: "42501", Message: secretish}), "refused access to the Epitaph tables"},
		{wrap(&pgconn.PgError{Code: "22P02", Message: secretish}), "answered with an error (SQLSTATE 22P02)"},
		{wrap(&net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}), "refuses connections (connection refused)"},
		{wrap(&net.DNSError{Err: "no such host", Name: "db.internal"}), "the target database cannot be reached"},
		{wrap(errors.New(secretish)), "the target database cannot be read"},
	} {
		got := unavailableReason(tc.err)
		require.Contains(t, got, tc.want, "%v", tc.err)
		require.NotContains(t, got, "hunter2")
		require.NotContains(t, got, "db.internal")
	}
}

// The page measures a rebuild's rate over its own samples: from the
// oldest one of the last 30 s that is at least 2 s old, whatever the
// source filled in; a sample too recent leaves the source's rate.
func TestRatesFromPageSamples(t *testing.T) {
	t.Parallel()
	at := time.Date(2026, 12, 1, 10, 0, 0, 0, time.UTC)
	sample := func(d time.Duration, done uint64, rate float64) *status.Status {
		return &status.Status{At: at.Add(d), Versions: []status.VersionStatus{{Projection: "archive", Version: 2,
			State: version.StateBuilding, Lifecycle: &status.VersionLifecycle{EventsDone: done, EventsToBoundary: 1000,
				EventsPerSecond: rate, ETASeconds: -1}}}}
	}
	h := Handler(nil).(*handler)
	first := sample(0, 100, 0)
	h.rates(first)
	require.Equal(t, -1.0, first.Versions[0].Lifecycle.ETASeconds, "nothing to measure from yet")

	recent := sample(time.Second, 150, 7)
	h.rates(recent)
	require.Equal(t, 7.0, recent.Versions[0].Lifecycle.EventsPerSecond, "a sample 1s old: the source's rate stays")

	st := sample(10*time.Second, 300, 0)
	h.rates(st)
	lc := st.Versions[0].Lifecycle
	require.InDelta(t, 20.0, lc.EventsPerSecond, 0.001, "200 events in 10s, from the first sample")
	require.Equal(t, 35.0, lc.ETASeconds, "700 left at 20/s")

	// 40 s later the first samples are out of the window: measured from
	// the oldest one left (the one at 10 s).
	late := sample(40*time.Second, 900, 0)
	h.rates(late)
	require.InDelta(t, 20.0, late.Versions[0].Lifecycle.EventsPerSecond, 0.001, "600 events in 30s")
	require.Len(t, h.samples, 2, "the samples in the window only")
}

// A rebuild that made no progress over the window has no ETA, not the
// source's older estimate.
func TestStalledRebuildHasNoETA(t *testing.T) {
	t.Parallel()
	at := time.Date(2026, 12, 1, 10, 0, 0, 0, time.UTC)
	sample := func(d time.Duration, eta float64) *status.Status {
		return &status.Status{At: at.Add(d), Versions: []status.VersionStatus{{Projection: "archive", Version: 2,
			State: version.StateBuilding, Lifecycle: &status.VersionLifecycle{EventsDone: 100, EventsToBoundary: 1000,
				EventsPerSecond: 5, ETASeconds: eta, Progress: 0.1}}}}
	}
	h := Handler(nil).(*handler)
	h.rates(sample(0, 180))
	st := sample(5*time.Second, 180)
	h.rates(st)
	require.Zero(t, st.Versions[0].Lifecycle.EventsPerSecond)
	require.Equal(t, -1.0, st.Versions[0].Lifecycle.ETASeconds)
	v, ok := newRebuildView(st.Versions[0])
	require.True(t, ok)
	require.Equal(t, "0 events/s", v.Rate)
	require.Equal(t, "unknown (no progress measured)", v.ETA)
	require.Equal(t, "10.0%", v.PctText)
}

// Which versions get a progress bar, and towards what: building to its
// boundary, catching up to no lag, ready full; a failed rebuild never
// finishes; a live version or the first one has none.
func TestRebuildViews(t *testing.T) {
	t.Parallel()
	lc := func(done, toBoundary uint64, progress float64) *status.VersionLifecycle {
		return &status.VersionLifecycle{BoundarySeq: 5000, EventsDone: done, EventsToBoundary: toBoundary, Progress: progress,
			EventsPerSecond: 250, ETASeconds: 90, PartitionsAtBoundary: 1}
	}
	parts := []status.PartitionStatus{{Partition: 0, Cursor: 5200, ReachedBoundary: true}, {Partition: 1, Cursor: 1200, NextSeq: 2501}}
	for _, tc := range []struct {
		v                  status.VersionStatus
		ok                 bool
		pct, eta, towards  string
		part1Pct, part1Pos int
	}{
		{status.VersionStatus{State: version.StateBuilding, Lifecycle: lc(1234, 5000, 0.2468), Partitions: parts},
			true, "24.6%", "1m30s", "the boundary (stream seq 5000)", 50, 2500},
		{status.VersionStatus{State: version.StateCatchingUp, LagEvents: 100, Lifecycle: lc(900, 5000, 1), Partitions: parts},
			true, "90.0%", "1m30s", "the stream's last message (no lag)", 50, 2500},
		{status.VersionStatus{State: version.StateReady, Lifecycle: lc(6000, 5000, 1), Partitions: parts},
			true, "100.0%", "1m30s", "the stream's last message (no lag)", 50, 2500},
		{status.VersionStatus{State: version.StateFailed, Lifecycle: lc(10, 5000, 0.002), Partitions: parts},
			true, "0.2%", "never (failed)", "the boundary (stream seq 5000)", 50, 2500},
		{status.VersionStatus{State: version.StateLive, Lifecycle: lc(6000, 5000, 1)}, false, "", "", "", 0, 0},
		{status.VersionStatus{State: version.StateBuilding}, false, "", "", "", 0, 0},
	} {
		r, ok := newRebuildView(tc.v)
		require.Equal(t, tc.ok, ok, tc.v.State)
		if !ok {
			continue
		}
		require.Equal(t, tc.pct, r.PctText, tc.v.State)
		require.Equal(t, tc.eta, r.ETA, tc.v.State)
		require.Equal(t, tc.towards, r.Target, tc.v.State)
		require.Equal(t, "250 events/s", r.Rate)
		require.Len(t, r.Parts, 2)
		require.Equal(t, rebuildPartView{Partition: 0, Position: 5200, Pct: 100, Reached: true}, r.Parts[0])
		require.Equal(t, tc.part1Pct, r.Parts[1].Pct, "2500 of 5000")
		require.Equal(t, uint64(tc.part1Pos), r.Parts[1].Position, "the one before the next unapplied message")
	}
}
