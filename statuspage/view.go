package statuspage

import (
	_ "embed"
	"fmt"
	"html/template"
	"math"
	"sort"
	"strings"
	"time"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/projection"
	"github.com/epitaph-dev/epitaph/projection/snapshot"
)

//go:embed page.html
var pageHTML string

var pageTemplate = template.Must(template.New("page").Parse(pageHTML))

// page is what the template renders: every figure already formatted, so the
// template only lays it out.
type page struct {
	Refresh        time.Duration
	RefreshMillis  int64
	RefreshSeconds int
	// Error is why the status could not be collected (the rest is empty).
	Error string

	Source      string
	Stream      string
	StreamLast  uint64
	Partitions  int
	Worker      string
	At          string
	StreamError string

	Versions   []versionView
	Quarantine []quarantineView
	Workers    []workerView

	Capture       captureView
	Snapshots     []snapshotRow
	SnapshotsNote string
	Handlers      []handlerRow
	HandlersNote  string
}

type versionView struct {
	Projection     string
	Version        int
	State          string
	Health         string
	Schema         string
	LagEvents      uint64
	OldestPending  string
	QuarantineOpen int
	Retired        bool
	Partitions     []partitionView
	// Readiness (archive.status) and what the version is known to miss.
	Ready        bool
	NotReady     string
	CompleteUpTo string
	GapsOpen     int
	Gaps         []gapView
}

type gapView struct {
	ID           int64
	Kind         string
	Table        string
	Partition    string
	From, To     string
	Seqs         string
	Detected     string
	Blocking     bool
	Acknowledged string
}

type partitionView struct {
	Partition   int
	Owner       string
	Leased      bool
	Epoch       int64
	Cursor      uint64
	SourceLSN   string
	LagEvents   uint64
	LagPct      int
	Oldest      string
	OldestPct   int
	LastAdvance string
	Failure     string
}

type quarantineView struct {
	Projection string
	Version    int
	Unresolved int
	Categories string
	Oldest     string
}

type workerView struct {
	ID        string
	Live      bool
	Heartbeat string
	This      bool
}

// captureView is the capture's slot as the page shows it; Known is false
// (and Note says why) when the capture's status could not be read.
type captureView struct {
	Known              bool
	Note               string
	Source             string
	Slot               string
	Active             bool
	ConfirmedLSN       string
	LagBytes           string
	LagSeconds         string
	Retained           string
	Safe               string
	SlotUsedPct        int
	TimeToInvalidation string
	WALStatus          string
	Heartbeat          string
	Error              string
	Danger             bool
}

type snapshotRow struct {
	Schema      string
	Version     int
	Pending     int64
	Complete    int64
	Failed      int64
	PendingPct  int
	CompletePct int
	FailedPct   int
	Oldest      string
}

func (p *page) fill(st *projection.Status) {
	p.Source, p.Stream, p.StreamLast, p.Partitions = st.Source, st.Stream, st.StreamLast, st.Partitions
	p.Worker, p.StreamError = st.Worker, st.StreamError
	p.At = st.At.UTC().Format("2006-01-02 15:04:05 UTC")
	for _, v := range st.Versions {
		vv := versionView{Projection: v.Projection, Version: v.Version, State: v.State, Health: v.Health, Schema: v.Schema,
			LagEvents: v.LagEvents, OldestPending: age(v.OldestPendingAgeSeconds), QuarantineOpen: v.QuarantineOpen,
			Retired: v.State == projection.StateRetired, Ready: v.Ready, NotReady: strings.Join(v.NotReadyReasons, "; "),
			CompleteUpTo: v.CompleteUpToLSN}
		if vv.CompleteUpTo == "" {
			vv.CompleteUpTo = "–"
		}
		for _, c := range v.GapCounts {
			if !c.Acknowledged && c.Kind != event.GapTruncate {
				vv.GapsOpen += c.Count
			}
		}
		for _, g := range v.Gaps {
			vv.Gaps = append(vv.Gaps, newGapView(g))
		}
		var maxLag uint64
		var maxAge float64
		for _, ps := range v.Partitions {
			maxLag = max(maxLag, ps.LagEvents)
			maxAge = max(maxAge, ps.OldestPendingAgeSeconds)
		}
		for _, ps := range v.Partitions {
			pv := partitionView{Partition: ps.Partition, Owner: ps.Owner, Leased: ps.Leased, Epoch: ps.Epoch, Cursor: ps.Cursor,
				SourceLSN: ps.SourceLSN, LagEvents: ps.LagEvents, LagPct: pct(float64(ps.LagEvents), float64(maxLag)),
				Oldest: age(ps.OldestPendingAgeSeconds), OldestPct: pct(ps.OldestPendingAgeSeconds, maxAge), LastAdvance: "never"}
			if ps.LastAdvanceAt != nil {
				pv.LastAdvance = st.At.Sub(*ps.LastAdvanceAt).Round(time.Second).String() + " ago"
			}
			if ps.LastFailureCategory != "" {
				pv.Failure = fmt.Sprintf("%s ×%d", ps.LastFailureCategory, ps.Attempts)
			}
			vv.Partitions = append(vv.Partitions, pv)
		}
		p.Versions = append(p.Versions, vv)
	}
	for _, q := range st.Quarantine {
		cats := make([]string, 0, len(q.ByCategory))
		for c, n := range q.ByCategory {
			cats = append(cats, fmt.Sprintf("%s %d", c, n))
		}
		sort.Strings(cats)
		p.Quarantine = append(p.Quarantine, quarantineView{Projection: q.Projection, Version: q.Version, Unresolved: q.Unresolved,
			Categories: strings.Join(cats, ", "), Oldest: age(q.OldestAgeSeconds)})
	}
	for _, w := range st.Workers {
		p.Workers = append(p.Workers, workerView{ID: w.ID, Live: w.Live, Heartbeat: age(w.HeartbeatAgeSeconds) + " ago",
			This: w.ID == st.Worker})
	}
}

func newGapView(g projection.Gap) gapView {
	v := gapView{ID: g.ID, Kind: g.Kind, Table: "every table", Partition: "every", From: "?", To: "?", Seqs: "–",
		Detected: g.DetectedAt.UTC().Format("2006-01-02 15:04:05 UTC"), Blocking: g.Blocking()}
	if g.Schema != nil && g.Table != nil {
		v.Table = *g.Schema + "." + *g.Table
	}
	if g.Partition != nil {
		v.Partition = fmt.Sprint(*g.Partition)
	}
	if g.FromLSN != nil {
		v.From = g.FromLSN.String()
	}
	if g.ToLSN != nil {
		v.To = g.ToLSN.String()
	}
	if g.FromSeq != nil || g.ToSeq != nil {
		v.Seqs = fmt.Sprintf("%s–%s", seqText(g.FromSeq), seqText(g.ToSeq))
	}
	if g.AcknowledgedAt != nil {
		v.Acknowledged = g.AcknowledgedAt.UTC().Format("2006-01-02 15:04 UTC")
		if g.AckReason != nil {
			v.Acknowledged += ": " + *g.AckReason
		}
	}
	return v
}

func seqText(n *int64) string {
	if n == nil {
		return "?"
	}
	return fmt.Sprint(*n)
}

// dangerSeconds: a slot this close to invalidation is shown in red.
const dangerSeconds = 3600

func newCaptureView(cs *captureStatus) captureView {
	ss := cs.SlotStats
	v := captureView{Known: true, Source: cs.Source, Slot: cs.Slot, Active: cs.Active, ConfirmedLSN: cs.ConfirmedLSN,
		LagBytes: bytesText(cs.LagBytes), LagSeconds: age(cs.LagSeconds), Retained: bytesText(ss.RetainedBytes),
		WALStatus: ss.WALStatus, Heartbeat: age(cs.HeartbeatAgeSec), Error: cs.Error,
		Safe: "unlimited", TimeToInvalidation: "no limit"}
	if v.LagSeconds == "–" {
		v.LagSeconds = "0s"
	}
	if ss.SafeBytes >= 0 {
		v.Safe = bytesText(ss.SafeBytes)
		v.SlotUsedPct = pct(float64(ss.RetainedBytes), float64(ss.RetainedBytes+ss.SafeBytes))
		v.TimeToInvalidation = "unknown (WAL not growing)"
		if ss.TimeToInvalidS >= 0 {
			v.TimeToInvalidation = age(ss.TimeToInvalidS)
			v.Danger = ss.TimeToInvalidS < dangerSeconds
		}
	}
	if ss.WALStatus == "unreserved" || ss.WALStatus == "lost" {
		v.Danger = true
	}
	return v
}

func newSnapshotRow(v projection.VersionStatus, s snapshot.Stats) snapshotRow {
	total := float64(s.Pending + s.Complete + s.Failed)
	r := snapshotRow{Schema: v.Schema, Version: v.Version, Pending: s.Pending, Complete: s.Complete, Failed: s.Failed,
		PendingPct: pct(float64(s.Pending), total), FailedPct: pct(float64(s.Failed), total),
		Oldest: age(s.OldestPendingAge.Seconds())}
	r.CompletePct = max(0, 100-r.PendingPct-r.FailedPct)
	if s.Complete == 0 {
		r.CompletePct = 0
	}
	return r
}

// pct is v as a whole percentage of of, at least 2 when v is not zero so
// a small figure still shows.
func pct(v, of float64) int {
	if v <= 0 || of <= 0 {
		return 0
	}
	return min(100, max(2, int(math.Round(100*v/of))))
}

// age formats seconds for people; zero is a dash.
func age(s float64) string {
	switch {
	case s <= 0:
		return "–"
	case s < 10:
		return fmt.Sprintf("%.1fs", s)
	case s < 60:
		return fmt.Sprintf("%.0fs", s)
	}
	d := time.Duration(s) * time.Second
	switch {
	case d < time.Hour:
		return fmt.Sprintf("%dm%02ds", int(d.Minutes()), int(d.Seconds())%60)
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh%02dm", int(d.Hours()), int(d.Minutes())%60)
	default:
		return fmt.Sprintf("%dd%02dh", int(d.Hours())/24, int(d.Hours())%24)
	}
}

// bytesText formats a byte count in binary units.
func bytesText(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	f, i := float64(n), 0
	for f >= unit && i < 5 {
		f /= unit
		i++
	}
	return fmt.Sprintf("%.1f %ciB", f, "KMGTPE"[i-1])
}
