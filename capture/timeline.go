package capture

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"strconv"
	"strings"

	"github.com/jackc/pglogrepl"

	"github.com/epitaph-dev/epitaph/event"
)

// A promoted standby goes on from the WAL it had on a new timeline: what
// the old primary wrote after that point (its switchpoint) is gone, and
// the new timeline writes other WAL at the same positions. A stream whose
// last position lies past the switchpoint holds messages of WAL the new
// primary does not have, and a resume "after the stream's last position"
// would take the new timeline's deletes up to it for them and drop them.
// PostgreSQL holds the capture back until a standby has the WAL where
// synchronized_standby_slots names it; where it does not (a standby left
// out, PostgreSQL before 17 with a slot made again on the new primary) the
// capture notices it here: it records the source's timeline with the
// slot's position (the seq of the slotPosPartition row, before it
// publishes anything on the timeline) and compares at every session.

// sourceTimeline is the timeline of the replication connection's server.
func (s *Service) sourceTimeline(ctx context.Context) (int32, error) {
	id, err := pglogrepl.IdentifySystem(ctx, s.repl)
	if err != nil {
		return 0, fmt.Errorf("identify the source's timeline: %w", err)
	}
	return id.Timeline, nil
}

// timelineEnd is where timeline tli ends in the history file content of a
// later timeline (lines "<parent tli>\t<switchpoint>\t<reason>"); ok is
// false when tli is not one of its ancestors.
func timelineEnd(content []byte, tli int32) (end event.LSN, ok bool) {
	sc := bufio.NewScanner(bytes.NewReader(content))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 2 || strings.HasPrefix(f[0], "#") {
			continue
		}
		n, err := strconv.ParseInt(f[0], 10, 32)
		if err != nil || int32(n) != tli {
			continue
		}
		if end, err = event.ParseLSN(f[1]); err == nil {
			return end, true
		}
	}
	return 0, false
}

// checkTimeline compares the source's timeline cur with the one recorded
// (t.timeline; 0: none): a stream whose tail lies past where the recorded
// timeline ended is refused, or with recreate given a gap from the
// switchpoint to the tail. A source on an older timeline than recorded (a
// former primary back) is always refused.
func (s *Service) checkTimeline(ctx context.Context, t tail, cur int32) (*gapInfo, error) {
	if !t.has || t.timeline == 0 || t.timeline == cur {
		return nil, nil
	}
	if t.timeline > cur {
		return nil, configErr("the source is on timeline %d, before timeline %d the capture last streamed from: it is not the current primary (a former primary started again?); point --source-url at the current primary", cur, t.timeline)
	}
	h, err := pglogrepl.TimelineHistory(ctx, s.repl, cur)
	if err != nil {
		return nil, fmt.Errorf("read the history of the source's timeline %d: %w", cur, err)
	}
	end, ok := timelineEnd(h.Content, t.timeline)
	if ok && t.pos.lsn <= end {
		return nil, nil
	}
	where := "(not one of its ancestors)"
	if ok {
		where = "at " + end.String()
	}
	reason := fmt.Sprintf("the source's timeline %d left timeline %d %s, before the stream's last position %s: the stream holds deletes of WAL the promoted server does not have, and its own deletes up to that position were not read", cur, t.timeline, where, t.pos.lsn)
	if !s.cfg.RecreateSlot {
		return nil, configErr("%s. Restart once with --recreate-slot to record a gap event for the range", reason)
	}
	return &gapInfo{from: end, to: t.pos.lsn, reason: reason}, nil
}

// recordTimeline records the session's timeline (and start, the slot's
// position) on the source before anything is published on it. A failing
// record is logged, as the sequences' are: the next confirmation records
// it again.
func (s *Service) recordTimeline(ctx context.Context, start event.LSN) {
	if !s.seqTableOK.Load() {
		return
	}
	_, err := s.pool.Exec(ctx, sqlSeqRecord, event.StreamName(s.cfg.SourceName), []int64{}, start.String(), int64(s.timeline.Load()))
	if err != nil {
		s.m.seqRecordErrors.Inc()
		s.log.Warn("cannot record the source's timeline; retrying at the next confirmation", "table", seqTable, "timeline", s.timeline.Load(), "err", redactErr(err))
	}
}
