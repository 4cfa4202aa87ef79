package status

import (
	"math"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/epitaph-dev/epitaph/projection/version"
)

// VersionLifecycle is the lifecycle part of a version's status: its
// boundary, transition times, and how far a rebuild has come.
type VersionLifecycle struct {
	BoundarySeq  int64      `json:"boundary_seq"`
	BoundaryLSN  string     `json:"boundary_lsn,omitempty"`
	FromTime     *time.Time `json:"from_time,omitempty"`
	CreatedAt    time.Time  `json:"created_at"`
	BuildingAt   *time.Time `json:"building_at,omitempty"`
	CatchingUpAt *time.Time `json:"catching_up_at,omitempty"`
	ReadyAt      *time.Time `json:"ready_at,omitempty"`
	LiveAt       *time.Time `json:"live_at,omitempty"`
	FailedReason string     `json:"failed_reason,omitempty"`
	// PartitionsAtBoundary counts partitions that applied everything up to
	// the boundary.
	PartitionsAtBoundary int `json:"partitions_at_boundary"`
	// EventsDone is how many of the stream's messages the version has
	// applied (the stream's messages minus the version's unapplied ones);
	// EventsToBoundary is how many the stream held at the boundary.
	EventsDone       uint64 `json:"events_done"`
	EventsToBoundary uint64 `json:"events_to_boundary"`
	// Progress is EventsDone / EventsToBoundary while building (1 after).
	Progress float64 `json:"progress"`
	// EventsPerSecond is the apply rate between two status samples (0
	// until there are two); ETASeconds the time to the boundary while
	// building, to no lag after (-1 unknown).
	EventsPerSecond float64 `json:"events_per_second"`
	ETASeconds      float64 `json:"eta_seconds"`
}

func lifecycleOf(v version.Version, vst *VersionStatus, stream jetstream.Stream) *VersionLifecycle {
	lc := &VersionLifecycle{FromTime: v.FromTime, CreatedAt: v.CreatedAt, BuildingAt: v.BuildingAt, CatchingUpAt: v.CatchingUpAt,
		ReadyAt: v.ReadyAt, LiveAt: v.LiveAt, FailedReason: v.FailedReason, ETASeconds: -1}
	if v.BoundarySeq != nil {
		lc.BoundarySeq = *v.BoundarySeq
	}
	if v.BoundaryLSN != 0 {
		lc.BoundaryLSN = v.BoundaryLSN.String()
	}
	boundary := uint64(max(lc.BoundarySeq, 0))
	for i := range vst.Partitions {
		p := &vst.Partitions[i]
		p.ReachedBoundary = p.Cursor >= boundary || (stream != nil && (p.NextSeq == 0 || p.NextSeq > boundary))
		if p.ReachedBoundary {
			lc.PartitionsAtBoundary++
		}
	}
	if stream == nil {
		return lc
	}
	state := stream.CachedInfo().State
	if state.Msgs > vst.LagEvents {
		lc.EventsDone = state.Msgs - vst.LagEvents
	}
	if boundary >= state.FirstSeq && state.FirstSeq > 0 {
		lc.EventsToBoundary = min(boundary-state.FirstSeq+1, state.Msgs)
	}
	lc.Progress = 1
	if v.State == version.StateBuilding && lc.EventsToBoundary > 0 {
		lc.Progress = min(1, float64(lc.EventsDone)/float64(lc.EventsToBoundary))
	}
	return lc
}

// FillRates sets each version's events/s and ETA from an earlier sample
// of the status (from the same source), e.g. the previous refresh.
func (st *Status) FillRates(prev *Status) {
	if prev == nil {
		return
	}
	dt := st.At.Sub(prev.At).Seconds()
	before := map[version.VersionKey]*VersionLifecycle{}
	for _, v := range prev.Versions {
		if v.LagUnknown != "" {
			continue // nothing was counted against the stream: no base for a rate
		}
		before[version.VersionKey{Projection: v.Projection, Version: v.Version}] = v.Lifecycle
	}
	for i := range st.Versions {
		v := &st.Versions[i]
		lc, was := v.Lifecycle, before[version.VersionKey{Projection: v.Projection, Version: v.Version}]
		if lc == nil || was == nil {
			continue
		}
		if dt < 0.2 {
			lc.EventsPerSecond = was.EventsPerSecond
		} else if lc.EventsDone >= was.EventsDone {
			lc.EventsPerSecond = float64(lc.EventsDone-was.EventsDone) / dt
		}
		if v.LagUnknown != "" {
			lc.ETASeconds = -1
			continue
		}
		remaining := float64(v.LagEvents)
		if v.State == version.StateBuilding {
			remaining = float64(lc.EventsToBoundary) - float64(lc.EventsDone)
		}
		switch {
		case remaining <= 0:
			lc.ETASeconds = 0
		case lc.EventsPerSecond > 0:
			lc.ETASeconds = math.Round(remaining / lc.EventsPerSecond)
		}
	}
}
