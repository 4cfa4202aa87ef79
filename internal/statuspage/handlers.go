package statuspage

import (
	"context"
	"strconv"
	"time"

	rowhandler "github.com/epitaph-dev/epitaph/handler"
)

// WithHandlerStats shows the row handlers with their backlog and dead
// letters, read through db (the projector's target pool) at most once per
// interval (0: DefaultSnapshotStatsInterval); the done and stopped counts
// as of a count of the whole table at most rowhandler.FinishedStatsRefresh
// old (rowhandler.StatsReader).
func WithHandlerStats(db rowhandler.DB, interval time.Duration) Option {
	return func(o *options) { o.handlers, o.handlersInterval = db, interval }
}

// handlerRow is one row handler on the page. Pending is a count, or
// "at least N" for a cursor handler's backlog counted up to
// rowhandler.CursorCountCap rows.
type handlerRow struct {
	ID, Name, Table            string
	Pending                    string
	InFlight, Done             int64
	Stopped, Dead              int64
	OldestPending              string
	HasDead, HasBacklogWarning bool
}

// handlerStats returns the handlers' delivery counts, read at most once per
// interval.
func (h *handler) handlerStats(ctx context.Context) ([]handlerRow, string, bool) {
	if h.o.handlers == nil {
		return nil, "not shown: this page was not given the target database", false
	}
	interval := h.o.handlersInterval
	if interval <= 0 {
		interval = DefaultSnapshotStatsInterval
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	now := h.o.now()
	if !h.hAt.IsZero() && now.Sub(h.hAt) < interval {
		return h.hRows, h.hNote, h.hUnavailable
	}
	if h.hStats == nil {
		// The open and dead deliveries exactly at each read, the finished
		// ones (kept as long as their rows) as of a count at most
		// rowhandler.FinishedStatsRefresh old: a page left open does not
		// read the whole table every interval.
		h.hStats = rowhandler.NewStatsReader(h.o.handlers, rowhandler.FinishedStatsRefresh, h.o.log)
	}
	stats, err := h.hStats.Read(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return h.hRows, h.hNote, h.hUnavailable
		}
		h.o.log.Warn("status page: handler stats", "err", unavailableReason(err))
		// Not cached: the next load asks again.
		return nil, "unavailable: " + unavailableReason(err), true
	}
	var rows []handlerRow
	idx := map[string]int{}
	for _, s := range stats {
		i, ok := idx[s.HandlerID]
		if !ok {
			i = len(rows)
			idx[s.HandlerID] = i
			rows = append(rows, handlerRow{ID: s.HandlerID, Name: s.Name, Table: s.Table, Pending: "0", OldestPending: "-"})
		}
		r := &rows[i]
		switch s.State {
		case rowhandler.StatePending:
			r.Pending = strconv.FormatInt(s.Count, 10)
			if s.AtLeast {
				r.Pending = "at least " + r.Pending
			}
			if s.Count > 0 {
				r.OldestPending = age(s.OldestSec)
			}
			r.HasBacklogWarning = s.Count > 0 && s.OldestSec > 1800
		case rowhandler.StateInFlight:
			r.InFlight = s.Count
		case rowhandler.StateDone:
			r.Done = s.Count
		case rowhandler.StateStopped:
			r.Stopped = s.Count
		case rowhandler.StateDead:
			r.Dead, r.HasDead = s.Count, s.Count > 0
		}
	}
	note := ""
	if len(rows) == 0 {
		note = "no row handlers (projector handlers add)"
	}
	h.hRows, h.hNote, h.hUnavailable, h.hAt = rows, note, false, now
	return rows, note, false
}

// handlerStatsReader reads the handler counts (statuspage.go names it
// without importing the handler package).
type handlerStatsReader = rowhandler.StatsReader

// handlerDB is what the handler counts are read through.
type handlerDB = rowhandler.DB
