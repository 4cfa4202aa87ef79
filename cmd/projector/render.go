package main

import (
	"fmt"
	"io"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/status"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// The text the commands print for people: the status, gaps and
// comparison tables. The documents themselves (JSON) are the packages'.

// writeStatusTable prints the status (`projector status`) as aligned text tables for people.
func writeStatusTable(w io.Writer, st *status.Status) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "source %s\tstream %s\tlast seq %d\tpartitions %d\n", st.Source, st.Stream, st.StreamLast, st.Partitions)
	if st.StreamError != "" {
		fmt.Fprintf(tw, "stream: %s\n", st.StreamError)
	}
	fmt.Fprintln(tw)
	writeVersionRows(tw, st)
	for _, line := range st.LagsUnknown() {
		fmt.Fprintf(tw, "%s\n", line)
	}
	for _, v := range st.Versions {
		if v.State == version.StateLive && !v.Ready && len(v.NotReadyReasons) > 0 {
			fmt.Fprintf(tw, "\n%s v%d is not ready: %s\n", v.Projection, v.Version, strings.Join(v.NotReadyReasons, "; "))
		}
	}
	for _, v := range st.Versions {
		if len(v.Gaps) == 0 {
			continue
		}
		fmt.Fprintf(tw, "\n%s v%d gaps\n", v.Projection, v.Version)
		fmt.Fprintln(tw, "GAP\tKIND\tTABLE\tPARTITION\tFROM LSN\tTO LSN\tSTREAM SEQ\tDETECTED\tACKNOWLEDGED")
		for _, g := range v.Gaps {
			writeGapRow(tw, g)
		}
	}
	for _, v := range st.Versions {
		if len(v.Partitions) == 0 {
			continue
		}
		fmt.Fprintf(tw, "\n%s v%d\n", v.Projection, v.Version)
		fmt.Fprintln(tw, "PARTITION\tOWNER\tEPOCH\tCURSOR\tSOURCE LSN\tLAG EVENTS\tOLDEST PENDING\tLAST ADVANCE\tFAILURE")
		for _, p := range v.Partitions {
			owner := p.Owner
			if !p.Leased {
				owner = "(none)"
			}
			last := "-"
			if p.LastAdvanceAt != nil {
				last = p.LastAdvanceAt.UTC().Format(time.RFC3339)
			}
			fail := p.LastFailureCategory
			if fail == "" {
				fail = "-"
			} else {
				fail = fmt.Sprintf("%s (x%d)", fail, p.Attempts)
			}
			lag, oldest := lagText(p.LagUnknown, p.LagEvents, p.OldestPendingAgeSeconds)
			fmt.Fprintf(tw, "%d\t%s\t%d\t%d\t%s\t%s\t%s\t%s\t%s\n", p.Partition, owner, p.Epoch, p.Cursor,
				orDash(p.SourceLSN), lag, oldest, last, fail)
		}
	}
	writeLifecycle(tw, st)
	if len(st.Workers) > 0 {
		fmt.Fprintln(tw, "\nWORKER\tLIVE\tHEARTBEAT AGE")
		for _, wk := range st.Workers {
			fmt.Fprintf(tw, "%s\t%t\t%s\n", wk.ID, wk.Live, seconds(wk.HeartbeatAgeSeconds))
		}
	}
	if len(st.Quarantine) > 0 {
		fmt.Fprintln(tw, "\nQUARANTINE\tVERSION\tOPEN\tOLDEST\tBY CATEGORY")
		for _, q := range st.Quarantine {
			cats := make([]string, 0, len(q.ByCategory))
			for c, n := range q.ByCategory {
				cats = append(cats, fmt.Sprintf("%s=%d", c, n))
			}
			sort.Strings(cats)
			fmt.Fprintf(tw, "%s\t%d\t%d\t%s\t%s\n", q.Projection, q.Version, q.Unresolved, seconds(q.OldestAgeSeconds), strings.Join(cats, " "))
		}
	}
	return tw.Flush()
}

// writeVersionRows prints the versions table of the status.
func writeVersionRows(tw io.Writer, st *status.Status) {
	fmt.Fprintln(tw, "PROJECTION\tVERSION\tSTATE\tHEALTH\tSCHEMA\tLAG EVENTS\tOLDEST PENDING\tQUARANTINE\tGAPS OPEN\tREADY\tCOMPLETE UP TO")
	for _, v := range st.Versions {
		open := 0
		for _, c := range v.GapCounts {
			if !c.Acknowledged && c.Kind != event.GapTruncate {
				open += c.Count
			}
		}
		lag, oldest := lagText(v.LagUnknown, v.LagEvents, v.OldestPendingAgeSeconds)
		if v.State == version.StateRetired {
			lag, oldest = "-", "-" // not measured
		}
		fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s\t%s\t%s\t%d\t%d\t%t\t%s\n", v.Projection, v.Version, v.State, v.Health, v.Schema,
			lag, oldest, v.QuarantineOpen, open, v.Ready, orDash(v.CompleteUpToLSN))
	}
}

// lagText is a lag and its oldest pending age for people: "unknown" when
// it could not be measured.
func lagText(unknown string, events uint64, oldest float64) (string, string) {
	if unknown != "" {
		return "unknown", "unknown"
	}
	return fmt.Sprint(events), seconds(oldest)
}

func seconds(s float64) string {
	if s == 0 {
		return "-"
	}
	return (time.Duration(s * float64(time.Second))).Round(time.Millisecond).String()
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// writeGapRow prints one gap as a row of the gaps table (status and
// `projector gaps`).
func writeGapRow(w io.Writer, g archive.Gap) {
	table, part := "(all)", "(all)"
	if g.Schema != nil && g.Table != nil {
		table = *g.Schema + "." + *g.Table
	}
	if g.Partition != nil {
		part = fmt.Sprint(*g.Partition)
	}
	seqs := "-"
	if g.FromSeq != nil || g.ToSeq != nil {
		seqs = g.SeqRange()
	}
	ack := "no"
	if g.Kind == event.GapTruncate && g.AcknowledgedAt == nil {
		ack = "(informational)"
	}
	if g.AcknowledgedAt != nil {
		ack = g.AcknowledgedAt.UTC().Format(time.RFC3339) + ": " + deref(g.AckReason)
	}
	from, to := g.LSNRange()
	fmt.Fprintf(w, "%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", g.ID, g.Kind, table, part, from, to, seqs,
		g.DetectedAt.UTC().Format(time.RFC3339), ack)
}

// writeGaps prints the gaps of versions as text tables (`projector gaps`).
func writeGaps(w io.Writer, vgs []status.VersionGaps) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	for i, vg := range vgs {
		if i > 0 {
			fmt.Fprintln(tw)
		}
		fmt.Fprintf(tw, "%s v%d (%s): %d gaps\n", vg.Projection, vg.Version, vg.State, len(vg.Gaps))
		if len(vg.Gaps) == 0 {
			continue
		}
		fmt.Fprintln(tw, "GAP\tKIND\tTABLE\tPARTITION\tFROM LSN\tTO LSN\tSTREAM SEQ\tDETECTED\tACKNOWLEDGED")
		for _, g := range vg.Gaps {
			writeGapRow(tw, g)
		}
	}
	return tw.Flush()
}

// writeLifecycle prints the lifecycle of every version that is not simply
// live: boundary, state times, progress, rate, ETA and per-partition
// positions against the boundary.
func writeLifecycle(w io.Writer, st *status.Status) {
	for _, v := range st.Versions {
		lc := v.Lifecycle
		if lc == nil || v.State == version.StateRetired {
			continue
		}
		fmt.Fprintf(w, "\n%s v%d %s: boundary seq %d (lsn %s)", v.Projection, v.Version, v.State, lc.BoundarySeq, orDash(lc.BoundaryLSN))
		if lc.FromTime != nil {
			fmt.Fprintf(w, ", partial rebuild from %s", lc.FromTime.UTC().Format(time.RFC3339))
		}
		fmt.Fprintln(w)
		var times []string
		for _, t := range []struct {
			name string
			at   *time.Time
		}{{"building", lc.BuildingAt}, {"catching_up", lc.CatchingUpAt}, {"ready", lc.ReadyAt}, {"live", lc.LiveAt}} {
			if t.at != nil {
				times = append(times, t.name+" "+t.at.UTC().Format(time.RFC3339))
			}
		}
		if len(times) > 0 {
			fmt.Fprintf(w, "  since: %s\n", strings.Join(times, ", "))
		}
		if lc.FailedReason != "" {
			fmt.Fprintf(w, "  failed: %s\n", lc.FailedReason)
		}
		if lc.BoundarySeq == 0 && v.State == version.StateLive {
			continue // the first version: nothing was rebuilt
		}
		fmt.Fprintf(w, "  %s  %d/%d events  %.0f events/s  ETA %s  partitions at boundary %d/%d\n",
			bar(lc.Progress, 30), lc.EventsDone, lc.EventsToBoundary, lc.EventsPerSecond, eta(lc.ETASeconds),
			lc.PartitionsAtBoundary, len(v.Partitions))
		if v.State == version.StateLive {
			continue
		}
		fmt.Fprintln(w, "  PARTITION\tCURSOR\tNEXT\tBOUNDARY\tREACHED")
		for _, p := range v.Partitions {
			fmt.Fprintf(w, "  %d\t%d\t%d\t%d\t%t\n", p.Partition, p.Cursor, p.NextSeq, lc.BoundarySeq, p.ReachedBoundary)
		}
	}
}

// bar draws a progress bar of width cells for a fraction in [0, 1].
func bar(fraction float64, width int) string {
	fraction = min(max(fraction, 0), 1)
	n := int(fraction * float64(width))
	return fmt.Sprintf("[%s%s] %5.1f%%", strings.Repeat("#", n), strings.Repeat("-", width-n), fraction*100)
}

func eta(s float64) string {
	switch {
	case s < 0:
		return "?"
	case s == 0:
		return "now"
	}
	return (time.Duration(s) * time.Second).String()
}

// writeComparison prints the comparison for people (`projector compare`).
func writeComparison(w io.Writer, c *version.Comparison) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	bound := "every archived row"
	if c.UpTo != "" {
		bound = "transactions committed at or before " + c.UpTo + " (both versions reflect them)"
	}
	fmt.Fprintf(tw, "%s v%d vs v%d: %s\n\n", c.Projection, c.A, c.B, bound)
	fmt.Fprintln(tw, "TABLE\tROWS A\tROWS B\tCHECKSUM A\tCHECKSUM B\tONLY A\tONLY B\tCONTENT DIFFERS\tEXPIRES_AT DIFFERS")
	for _, t := range c.Tables {
		fmt.Fprintf(tw, "%s.%s\t%d\t%d\t%s\t%s\t%d\t%d\t%d\t%d\n", t.Schema, t.Table, t.RowsA, t.RowsB,
			orDash(t.ChecksumA), orDash(t.ChecksumB), t.OnlyA, t.OnlyB, t.ContentDiffers, t.ExpiresAtDiffers)
	}
	if len(c.Snapshots) > 0 {
		fmt.Fprintln(tw, "\nSNAPSHOT ROOT\tSTATUS\tA\tB")
		for _, s := range c.Snapshots {
			fmt.Fprintf(tw, "%s\t%s\t%d\t%d\n", s.RootTable, s.Status, s.A, s.B)
		}
	}
	if len(c.DifferingDocuments) > 0 {
		fmt.Fprintf(tw, "\nDIFFERING DOCUMENT (%d)\tROOT KEY\tCORRELATION ID\tWHAT\n", c.DocumentsDiffer)
		for _, d := range c.DifferingDocuments {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", d.RootTable, string(d.RootKey), d.CorrelationID, d.What)
		}
	}
	if len(c.DifferingKeys) > 0 {
		fmt.Fprintln(tw, "\nDIFFERING ROW\tKEY\tCOMMIT LSN\tSEQ\tWHAT")
		for _, d := range c.DifferingKeys {
			fmt.Fprintf(tw, "%s.%s\t%s\t%s\t%d\t%s\n", d.Schema, d.Table, string(d.Key), d.CommitLSN, d.Seq, d.What)
		}
	}
	var verdict []string
	switch {
	case !c.ContentEqual:
		verdict = append(verdict, "DIFFERENT content")
	case c.Equal:
		verdict = append(verdict, "EQUAL content")
	default:
		verdict = append(verdict, "EQUAL content, but DIFFERENT")
	}
	switch {
	case c.ExpiresAtDiffers > 0 && c.IgnoreExpiresAt:
		verdict = append(verdict, fmt.Sprintf("expires_at differs on %d rows (accepted: --ignore expires_at)", c.ExpiresAtDiffers))
	case c.ExpiresAtDiffers > 0:
		verdict = append(verdict, fmt.Sprintf("expires_at differs on %d rows (pass --ignore expires_at if the TTL change is intended)", c.ExpiresAtDiffers))
	}
	switch {
	case !c.SnapshotsEqual && c.IgnoreSnapshots:
		verdict = append(verdict, "snapshot jobs or documents differ (accepted: --ignore snapshots)")
	case !c.SnapshotsEqual:
		verdict = append(verdict, "snapshot jobs or documents differ (pass --ignore snapshots if the change of snapshot roots is intended)")
	}
	fmt.Fprintf(tw, "\n%s\n", strings.Join(verdict, "; "))
	return tw.Flush()
}

// cutAtLimit returns the first limit items of a list read with one item
// more than asked, and says on w (format, with the limit) when there was
// more: a list never stops at its limit without a word.
func cutAtLimit[T any](w io.Writer, items []T, limit int, format string) []T {
	if len(items) <= limit {
		return items
	}
	fmt.Fprintf(w, format+"\n", limit)
	return items[:limit]
}
