package revalidate

import "github.com/epitaph-dev/epitaph/handler"

// Outcome is the decision taken before one attempt of a delivery: the
// dispatcher's type (handler.Outcome).
type Outcome = handler.Outcome

// The outcomes. Every one but Send and Defer ends the
// delivery as stopped; Defer retries later without spending an attempt.
const (
	// Send: the deletion still stands; run the handler.
	Send = handler.Send
	// StopCompleted: the work no longer exists (its archived row expired or
	// was removed, or the handler was removed).
	StopCompleted = handler.StopCompleted
	// StopChanged: the set the delivery was queued for changed (a row of
	// the group archived later, or one removed); the next generation is
	// queued for the current set.
	StopChanged = handler.StopChanged
	// StopRevoked: disclosure stopped for a security reason (the row was
	// erased, or the handler revoked). Audited apart from completion.
	StopRevoked = handler.StopRevoked
	// StopSuperseded: the deletion no longer stands (a later delivery for
	// the same handler, table and key, or the key exists in the source).
	StopSuperseded = handler.StopSuperseded
	// Defer: authoritative state could not be read; retry later, no
	// attempt spent, counted in defers.
	Defer = handler.Defer
)

// Outcomes lists every outcome, for metrics and documentation.
var Outcomes = []Outcome{Send, StopCompleted, StopChanged, StopRevoked, StopSuperseded, Defer}

// Machine codes saying why (Result.Reason). Safe to store and log: they
// never carry data or error text.
const (
	ReasonUnchanged        = "unchanged"
	ReasonNotRevalidated   = "revalidation_off"
	ReasonHandlerRemoved   = "handler_removed"
	ReasonHandlerRevoked   = "handler_revoked"
	ReasonHandlerDisabled  = "handler_disabled"
	ReasonLaterDelivery    = "later_delivery"
	ReasonKeyInSource      = "key_in_source"
	ReasonRowExpired       = "row_expired"
	ReasonRowRemoved       = "row_removed"
	ReasonRowErased        = "row_erased"
	ReasonSetChanged       = "set_changed"
	ReasonNoLiveVersion    = "no_live_version"
	ReasonTargetUnreadable = "target_unreadable"
	ReasonNoSourceURL      = "no_source_url"
	ReasonSourceURLFile    = "source_url_file_unreadable"
	ReasonSourceDown       = "source_unavailable"
	ReasonSourcePermission = "source_permission_denied"
	ReasonSourceNoTable    = "source_table_missing"
	ReasonSourceKeyInvalid = "source_key_invalid"
)

// NoSourceURLText is the failure of an attempt of a revalidating handler
// when the projector has no source to read.
const NoSourceURLText = "revalidation reads the source database and the projector has none: " +
	"set EPITAPH_SOURCE_URL (--source-url) on the projector and restart it, or add the handler with --no-revalidate"

// Paths of the fingerprint check (Result.Path).
const (
	PathCheap = "cheap" // the pair matched: the set was not read
	PathFull  = "full"  // the pair differed (or was never stamped): the set was read and hashed
)

// Result is one evaluation of a delivery.
type Result struct {
	Outcome Outcome
	// Reason is a machine code (the Reason* constants).
	Reason string
	// ObservedFingerprint is the fingerprint of the set as observed: the
	// stored one when the cheap pair matched, the recomputed one after a
	// full read, empty when the set was not looked at.
	ObservedFingerprint string
	// Path says how the fingerprint was checked ("" when it was not).
	Path string

	d       delivery
	current set // the current set, for stop_changed and re-stamping
}
