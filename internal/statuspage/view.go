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
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/snapshot"
	"github.com/epitaph-dev/epitaph/projection/status"
	"github.com/epitaph-dev/epitaph/projection/version"
	"github.com/epitaph-dev/epitaph/quarantine"
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
	// Unavailable is why the status could not be collected, as a class
	// of reason without the error's text (which can name hosts and
	// users); every section then says it is unavailable instead of
	// showing a false "nothing".
	Unavailable string

	Source      string
	Stream      string
	StreamLast  uint64
	Partitions  int
	Worker      string
	At          string
	StreamError string

	Versions   []versionView
	Rebuilds   []rebuildView
	Quarantine []quarantineView
	Workers    []workerView

	// The open quarantine entries (at most the limit): EntriesNote says
	// why there are none to show, EntriesMore how many were left off.
	// CanAct: the request carried the token, so replay and discard
	// buttons are rendered.
	Entries     []entryView
	EntriesNote string
	EntriesMore bool
	// EntriesUnavailable: the entries could not be read (EntriesNote says
	// why), which is not "none".
	EntriesUnavailable bool
	CanAct             bool
	// ActionsOn: the page has actions and a token (--http-token-file), so
	// it offers the token field; without, it says how to turn them on.
	ActionsOn bool

	Capture             captureView
	Snapshots           []snapshotRow
	SnapshotsNote       string
	Handlers            []handlerRow
	HandlersNote        string
	HandlersUnavailable bool
}

type versionView struct {
	Projection     string
	Version        int
	State          string
	Health         string
	Schema         string
	LagEvents      string
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

// rebuildView is the progress of a version being built or caught up: to
// its boundary while building (the stream's messages up to it), to no lag
// while catching up.
type rebuildView struct {
	Projection   string
	Version      int
	State        string
	Target       string // what the bar fills towards
	Pct          int    // the bar's width
	PctText      string // one decimal
	Done, Total  uint64
	Rate         string
	ETA          string
	AtBoundary   int
	Partitions   int
	BoundarySeq  int64
	FailedReason string
	Parts        []rebuildPartView
}

// rebuildPartView is one partition's position against the boundary.
type rebuildPartView struct {
	Partition int
	Position  uint64
	Pct       int
	Reached   bool
}

// entryView is one open quarantine entry: where it is, what row it is
// about and why it is there. Never the message (it holds row values).
type entryView struct {
	ID         int64
	Projection string
	Version    int
	Partition  int
	Seq        uint64
	Table      string
	Key        string
	Category   string
	Error      string
	Attempts   int
	Age        string
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
	LagEvents   string
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

func (p *page) fill(st *status.Status) {
	p.Source, p.Stream, p.StreamLast, p.Partitions = st.Source, st.Stream, st.StreamLast, st.Partitions
	p.Worker, p.StreamError = st.Worker, st.StreamError
	p.At = st.At.UTC().Format("2006-01-02 15:04:05 UTC")
	for _, v := range st.Versions {
		vv := versionView{Projection: v.Projection, Version: v.Version, State: v.State, Health: v.Health, Schema: v.Schema,
			LagEvents: fmt.Sprint(v.LagEvents), OldestPending: age(v.OldestPendingAgeSeconds), QuarantineOpen: v.QuarantineOpen,
			Retired: v.State == version.StateRetired, Ready: v.Ready, NotReady: strings.Join(v.NotReadyReasons, "; "),
			CompleteUpTo: v.CompleteUpToLSN}
		switch {
		case v.LagUnknown != "": // never a 0 nobody measured
			vv.LagEvents, vv.OldestPending = "unknown", "unknown"
		case vv.Retired:
			vv.LagEvents, vv.OldestPending = "–", "–"
		}
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
				SourceLSN: ps.SourceLSN, LagEvents: fmt.Sprint(ps.LagEvents), LagPct: pct(float64(ps.LagEvents), float64(maxLag)),
				Oldest: age(ps.OldestPendingAgeSeconds), OldestPct: pct(ps.OldestPendingAgeSeconds, maxAge), LastAdvance: "never"}
			if ps.LagUnknown != "" {
				pv.LagEvents, pv.Oldest = "unknown", "unknown"
			}
			if ps.LastAdvanceAt != nil {
				pv.LastAdvance = st.At.Sub(*ps.LastAdvanceAt).Round(time.Second).String() + " ago"
			}
			if ps.LastFailureCategory != "" {
				pv.Failure = fmt.Sprintf("%s ×%d", ps.LastFailureCategory, ps.Attempts)
			}
			vv.Partitions = append(vv.Partitions, pv)
		}
		p.Versions = append(p.Versions, vv)
		if rv, ok := newRebuildView(v); ok {
			p.Rebuilds = append(p.Rebuilds, rv)
		}
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

// newRebuildView is the progress of a version being built, caught up or
// ready to promote; ok is false for the others.
func newRebuildView(v status.VersionStatus) (rebuildView, bool) {
	lc := v.Lifecycle
	switch {
	case lc == nil:
		return rebuildView{}, false
	case v.State == version.StateBuilding, v.State == version.StateCatchingUp, v.State == version.StateReady:
	case v.State == version.StateFailed && lc.BoundarySeq > 0:
	default:
		return rebuildView{}, false
	}
	r := rebuildView{Projection: v.Projection, Version: v.Version, State: v.State, Done: lc.EventsDone,
		Rate: fmt.Sprintf("%.0f events/s", lc.EventsPerSecond), ETA: etaText(lc.ETASeconds),
		AtBoundary: lc.PartitionsAtBoundary, Partitions: len(v.Partitions), BoundarySeq: lc.BoundarySeq, FailedReason: lc.FailedReason}
	frac := lc.Progress
	switch v.State {
	case version.StateBuilding, version.StateFailed:
		r.Target, r.Total = fmt.Sprintf("the boundary (stream seq %d)", lc.BoundarySeq), lc.EventsToBoundary
		if v.State == version.StateFailed {
			r.ETA = "never (failed)"
		}
	default: // caught up to the stream's end: done of done + lag
		r.Target, r.Total = "the stream's last message (no lag)", lc.EventsDone+v.LagEvents
		frac = 1
		if r.Total > 0 {
			frac = float64(lc.EventsDone) / float64(r.Total)
		}
	}
	frac = min(max(frac, 0), 1)
	r.Pct, r.PctText = int(math.Floor(100*frac)), fmt.Sprintf("%.1f%%", math.Floor(1000*frac)/10)
	if v.LagUnknown != "" { // counted against the stream, which could not be read
		r.Pct, r.PctText, r.Rate = 0, "unknown", "unknown events/s"
		if v.State != version.StateFailed {
			r.ETA = "unknown (the stream cannot be read)"
		}
	}
	boundary := uint64(max(lc.BoundarySeq, 0))
	for _, ps := range v.Partitions {
		pos := ps.Cursor
		if ps.NextSeq > 0 {
			pos = max(pos, ps.NextSeq-1)
		}
		pv := rebuildPartView{Partition: ps.Partition, Position: pos, Reached: ps.ReachedBoundary, Pct: 100}
		if !pv.Reached && boundary > 0 {
			pv.Pct = min(99, pct(float64(pos), float64(boundary)))
		}
		r.Parts = append(r.Parts, pv)
	}
	return r, true
}

// etaText formats an ETA in seconds (negative: not known yet).
func etaText(s float64) string {
	switch {
	case s < 0:
		return "unknown (no progress measured)"
	case s == 0:
		return "now"
	}
	return age(s)
}

func newGapView(g archive.Gap) gapView {
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

func newSnapshotRow(v status.VersionStatus, s snapshot.Stats) snapshotRow {
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

// maxKeyText and maxErrorText bound what one entry shows.
const (
	maxKeyText   = 200
	maxErrorText = 300
)

func newEntryView(r quarantine.Record, now time.Time) entryView {
	e := entryView{ID: r.ID, Projection: r.Projection, Version: r.Version, Partition: r.Partition, Seq: r.StreamSeq,
		Table: "–", Key: "–", Category: r.Category, Error: clip(r.Error, maxErrorText), Attempts: r.Attempts,
		Age: age(now.Sub(r.FirstSeen).Seconds())}
	if r.SourceTable != "" {
		e.Table = r.SourceSchema + "." + r.SourceTable
	}
	if len(r.SourceKey) > 0 {
		e.Key = clip(string(r.SourceKey), maxKeyText)
	}
	return e
}

// clip is s on one line, at most n runes.
func clip(s string, n int) string {
	s = strings.Join(strings.Fields(s), " ")
	if r := []rune(s); len(r) > n {
		return string(r[:n]) + "…"
	}
	return s
}
