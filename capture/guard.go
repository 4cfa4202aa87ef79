package capture

import (
	"github.com/nats-io/nats.go/jetstream"
)

// Stream settings that decide whether stored events can be removed without
// a per-message delete, as named in the stream's JSON configuration.
const (
	guardDenyPurge   = "deny_purge"
	guardAllowRollup = "allow_rollup_hdrs"
	guardAllowMsgTTL = "allow_msg_ttl"
	guardDenyDelete  = "deny_delete"
)

// guardChange is one stream setting that is not the one the capture keeps.
type guardChange struct {
	name      string
	now, want bool
	// restorable: the server lets the capture set it back. JetStream never
	// disables allow_msg_ttl or cancels deny_delete once set.
	restorable bool
}

// guardsPlan compares a stream's settings with the ones the capture keeps:
//   - deny_purge true: a purge (STREAM.PURGE, by anyone allowed the API)
//     would empty the stream, and with it the capture's proof of what it
//     published; once set, JetStream refuses to cancel it;
//   - allow_rollup_hdrs false: one message with a Nats-Rollup header on
//     any subject of the stream would purge it (JetStream refuses roll-ups
//     on a stream that denies purges, so deny_purge settles this too);
//   - allow_msg_ttl false: a message could carry its own time to live;
//   - deny_delete false: erase --purge-stream deletes single messages.
//
// The last two cannot be undone on the server once changed: they are
// reported, not restored.
func guardsPlan(sc jetstream.StreamConfig) []guardChange {
	var cs []guardChange
	if !sc.DenyPurge {
		cs = append(cs, guardChange{name: guardDenyPurge, now: false, want: true, restorable: true})
	}
	if sc.AllowRollup {
		cs = append(cs, guardChange{name: guardAllowRollup, now: true, want: false, restorable: true})
	}
	if sc.AllowMsgTTL {
		cs = append(cs, guardChange{name: guardAllowMsgTTL, now: true, want: false})
	}
	if sc.DenyDelete {
		cs = append(cs, guardChange{name: guardDenyDelete, now: true, want: false})
	}
	return cs
}

// applyGuards sets the restorable settings on sc.
func applyGuards(sc *jetstream.StreamConfig) {
	sc.DenyPurge, sc.AllowRollup = true, false
}

// restorable reports whether cs holds a change the capture can make.
func restorable(cs []guardChange) bool {
	for _, c := range cs {
		if c.restorable {
			return true
		}
	}
	return false
}

// reportGuards logs and counts what enforceLimits found of the stream's
// settings (cs, restored when restorable). A setting found on a stream the
// capture did not check before (streaming false: at start, where an
// existing stream made by a capture before deny_purge is brought to it) is
// logged at info when it was only deny_purge missing; anything else, or
// anything while streaming, was done behind the capture's back.
func (s *Service) reportGuards(stream string, cs []guardChange, streaming bool) {
	rollup := false
	for _, c := range cs {
		rollup = rollup || c.name == guardAllowRollup
	}
	for _, c := range cs {
		switch {
		case !c.restorable:
			s.m.streamUnsafe.WithLabelValues(c.name).Set(1)
			if _, seen := s.unsafeWarned.LoadOrStore(c.name, true); !seen || !streaming {
				what := "a message may carry its own time to live (Nats-TTL) and expire from the stream"
				if c.name == guardDenyDelete {
					what = "erase --purge-stream cannot delete erased rows' messages"
				}
				s.log.Error("stream setting changed behind the capture's back, and the broker never lets it be undone: "+what,
					"stream", stream, "setting", c.name, "now", c.now)
			}
		case c.name == guardDenyPurge && !streaming && !rollup:
			s.log.Info("stream now denies purges: only single messages can be deleted from it", "stream", stream, "setting", c.name, "was", c.now, "now", c.want)
		default:
			s.m.limitsRestored.WithLabelValues(c.name).Inc()
			s.log.Warn("stream setting changed behind the capture's back, letting the stream be emptied; restored",
				"stream", stream, "setting", c.name, "was", c.now, "restored", c.want)
		}
	}
}
