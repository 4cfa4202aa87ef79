// Package handler runs row handlers: durable, at-least-
// once side effects of an archived delete. A handler (epitaph.handlers) is
// a webhook, a command, a NATS subject or a Go Handler registered by an
// embedding program; a delivery (epitaph.deliveries) is one (handler,
// archived row) piece of work, inserted by the projector's apply in the
// transaction that archives the row (Enqueue) and run by a Dispatcher.
package handler

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/epitaph-dev/epitaph/internal/redact"
)

// Kinds of handler.
const (
	KindWebhook = "webhook"
	KindExec    = "exec"
	KindNATS    = "nats"
	KindGo      = "go"
)

// Phases: when a delivery may be dispatched.
const (
	// PhaseImmediate: once its row is archived (and verified).
	PhaseImmediate = "immediate"
	// PhaseAfterGroup: once its source transaction's commit is applied.
	PhaseAfterGroup = "after-group"
)

// States of a delivery.
const (
	StatePending  = "pending"
	StateInFlight = "in_flight"
	StateDone     = "done"
	StateStopped  = "stopped"
	StateDead     = "dead"
)

// Delivery is one (handler, archived row) piece of work as a handler and
// a Revalidator see it.
type Delivery struct {
	ID            string
	HandlerID     string
	Source        string
	CommitLSN     string
	Seq           int
	Generation    int
	Schema, Table string
	// Key is the row's key; Columns the handler's kept columns (nil: the
	// key only, or the payload was scrubbed).
	Key           json.RawMessage
	Columns       map[string]json.RawMessage
	CorrelationID string
	CommitTime    *time.Time
	// Version is the archive version that was live when the row was
	// applied.
	Version int
	Phase   string
	// Attempt is 1 on the first attempt; a handler must be idempotent
	// (Attempt > 1: the work may have been done already).
	Attempt int
	Defers  int
	// Fingerprint, GroupRows and GroupMax are what revalidation computed
	// when the delivery was queued (NULL until something sets them).
	Fingerprint *string
	GroupRows   *int
	GroupMax    *string
	// Group is set on a delivery that revalidation queued because its set
	// changed (generation > 0): {"rows": the set's count now, "added": the
	// keys of its rows archived since the earlier delivery was queued}.
	Group json.RawMessage
}

// Body is the JSON a webhook, a command (on stdin) and a NATS message get.
// It holds no attempt number: a retry sends the same bytes.
type Body struct {
	DeliveryID    string                     `json:"delivery_id"`
	HandlerID     string                     `json:"handler_id"`
	Table         string                     `json:"table"`
	Key           json.RawMessage            `json:"key"`
	Columns       map[string]json.RawMessage `json:"columns,omitempty"`
	Group         json.RawMessage            `json:"group,omitempty"`
	CorrelationID string                     `json:"correlation_id"`
	CommitTime    *time.Time                 `json:"commit_time,omitempty"`
}

// Body is the delivery's payload as handlers get it: byte-identical on
// every attempt, whichever worker makes it (the attempt is in a header or
// the environment; the commit time is in UTC, not the worker's zone).
func (d Delivery) Body() Body {
	key := d.Key
	if len(key) == 0 {
		key = json.RawMessage("null")
	}
	ct := d.CommitTime
	if ct != nil {
		u := ct.UTC()
		ct = &u
	}
	return Body{DeliveryID: d.ID, HandlerID: d.HandlerID, Table: d.Schema + "." + d.Table, Key: key,
		Columns: d.Columns, Group: d.Group, CorrelationID: d.CorrelationID, CommitTime: ct}
}

// Handler is a Go row handler, registered by name in a Registry by an
// embedding program and named by a handler of kind "go" (its target). It
// must honour ctx (cancelled at nine tenths of the claim timeout) and be
// idempotent. A returned error is retried with backoff unless it is
// Permanent.
type Handler interface {
	Handle(ctx context.Context, d Delivery) error
}

// Func adapts a function to Handler.
type Func func(ctx context.Context, d Delivery) error

// Handle calls f.
func (f Func) Handle(ctx context.Context, d Delivery) error { return f(ctx, d) }

// Registry holds the Go handlers of an embedding program, by the name a
// handler of kind "go" targets. Deliveries of a "go" handler whose name is
// not registered in a dispatcher's Registry are left for a dispatcher that
// has it.
type Registry struct {
	mu sync.RWMutex
	m  map[string]Handler
}

// NewRegistry returns an empty Registry.
func NewRegistry() *Registry { return &Registry{m: map[string]Handler{}} }

// Register adds h under name. A name registered twice is an error.
func (r *Registry) Register(name string, h Handler) error {
	if name == "" || h == nil {
		return errors.New("register handler: a name and a handler are required")
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.m[name]; ok {
		return fmt.Errorf("register handler %q: already registered", name)
	}
	r.m[name] = h
	return nil
}

// Lookup returns the handler registered under name.
func (r *Registry) Lookup(name string) (Handler, bool) {
	if r == nil {
		return nil, false
	}
	r.mu.RLock()
	defer r.mu.RUnlock()
	h, ok := r.m[name]
	return h, ok
}

// Names lists the registered names.
func (r *Registry) Names() []string {
	if r == nil {
		return []string{}
	}
	r.mu.RLock()
	defer r.mu.RUnlock()
	out := make([]string, 0, len(r.m))
	for n := range r.m {
		out = append(out, n)
	}
	return out
}

// Outcome is a revalidation's decision or a dispatcher's result.
type Outcome string

// Outcomes before an attempt (Decision) and recorded on deliveries.
const (
	Send           Outcome = "send"
	StopCompleted  Outcome = "stop_completed"
	StopChanged    Outcome = "stop_changed"
	StopRevoked    Outcome = "stop_revoked"
	StopSuperseded Outcome = "stop_superseded"
	Defer          Outcome = "defer"
)

// Outcomes the dispatcher records itself.
const (
	OutcomeDone           = "done"
	OutcomeFailed         = "failed"
	OutcomeUnknownHandler = "unknown_handler"
	OutcomePayloadGone    = "payload_scrubbed"
	OutcomeClaimExpired   = "claim_expired"
	OutcomeUnverified     = "unverified"
	OutcomeDiscarded      = "discarded"
)

// Decision is what happens to a delivery before an attempt: Send runs it;
// a Stop* outcome ends it stopped with that outcome; Defer tries again
// later (after the handler's base backoff) without spending an attempt.
// Fingerprint, when set, is recorded as the observed fingerprint.
type Decision struct {
	Outcome     Outcome
	Fingerprint string
}

// Revalidator decides, before every attempt, whether a delivery is still
// to be sent (package revalidate builds it). An error counts as a failed attempt.
type Revalidator func(ctx context.Context, d Delivery) (Decision, error)

// Verdict is a BatchRevalidator's answer for one delivery: what a
// Revalidator would have returned for it.
type Verdict struct {
	Decision Decision
	Err      error
}

// BatchRevalidator decides for a claimed batch at once (verdicts[i] for
// ds[i]), with what one Revalidator call per delivery would decide, in
// fewer reads. The dispatcher calls it on each batch it claims.
type BatchRevalidator func(ctx context.Context, ds []Delivery) []Verdict

// AlwaysSend is the default Revalidator.
func AlwaysSend(context.Context, Delivery) (Decision, error) { return Decision{Outcome: Send}, nil }

// Error is a handler failure with a machine code that is safe to store
// (never error text): "http_503", "exit_3", "deadline_exceeded".
type Error struct {
	Code      string
	Permanent bool
	Err       error
	// cause is what the projector may store and log of Err: set only by
	// the built-in kinds (webhook, exec, nats), whose error texts carry no
	// row data, with the webhook URL redacted. A Go handler's own error
	// text is never stored or logged: it may hold row values.
	cause string
}

func (e *Error) Error() string {
	if e.Err == nil {
		return e.Code
	}
	return e.Code + ": " + e.Err.Error()
}

func (e *Error) Unwrap() error { return e.Err }

// Permanent marks err as a failure that retrying cannot fix: the delivery
// is dead at once. code must be safe to store (no data, no error text).
func Permanent(code string, err error) error { return &Error{Code: code, Permanent: true, Err: err} }

// Retryable marks err as a failure worth retrying, with a safe code.
func Retryable(code string, err error) error { return &Error{Code: code, Err: err} }

// Explained is a retryable failure whose text is stored in last_error and
// logged as it is: for the projector's own failures (a missing setting),
// never for text that may hold row values or secrets.
func Explained(code, text string) error {
	return &Error{Code: code, Err: errors.New(text), cause: text}
}

// sanitized is the last_error of a failure: its Go type, its safe code
// where there is one, a diagnostic id that is also in the log line, and
// the cause when a built-in kind gave one it may show (the transport's
// error with the URL redacted, "webhook answered 503 Service
// Unavailable", "exit status 3"). Never a Go handler's error text, a
// response body or a command's output.
func sanitized(err error) (text, diag string) {
	diag = newDiagID()
	typ := fmt.Sprintf("%T", err)
	code, cause := "", ""
	var he *Error
	if errors.As(err, &he) {
		code, cause = he.Code, he.cause
		if he.Err != nil {
			typ = fmt.Sprintf("%T", he.Err)
		}
	}
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		code = "deadline_exceeded"
	case errors.Is(err, context.Canceled) && code == "":
		code = "canceled"
	}
	if code == "" {
		code = "none"
	}
	text = fmt.Sprintf("type=%s code=%s diag=%s", typ, code, diag)
	if cause != "" {
		text += " cause=" + cause
	}
	return text, diag
}

// logDetail is the full error of a failure as the log line carrying its
// diagnostic id shows it: a built-in kind's whole error text (secrets and
// the webhook URL's credentials redacted); for a Go handler only that its
// text is its own.
func logDetail(err error) string {
	var he *Error
	if errors.As(err, &he) && he.cause != "" {
		var ue *url.Error
		if errors.As(he.Err, &ue) {
			return redact.Text(fmt.Sprintf("%s %q: %s", ue.Op, RedactTarget(KindWebhook, ue.URL), he.cause))
		}
		return he.cause
	}
	if errors.As(err, &he) && he.Code == "deadline_exceeded" {
		return "the attempt's deadline passed"
	}
	return "(a Go handler's error text is not logged: it may hold row values; log it in the handler)"
}

// kindError is the failure of a built-in kind, whose error text the
// projector may store and log: err's text (for a *url.Error, the error
// under it, without the URL) with secrets redacted and the target's
// credentials hidden.
func kindError(code string, permanent bool, target string, err error) error {
	e := &Error{Code: code, Permanent: permanent, Err: err}
	if err == nil {
		return e
	}
	msg := err.Error()
	var ue *url.Error
	if errors.As(err, &ue) && ue.Err != nil {
		msg = ue.Err.Error()
	}
	if target != "" {
		msg = strings.ReplaceAll(msg, target, RedactTarget(KindWebhook, target))
	}
	e.cause = strings.Join(strings.Fields(redact.Text(msg)), " ")
	return e
}

func newDiagID() string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// NewID is a fresh handler id, a random (version 4) UUID: what handlers
// add uses when it is given no --id.
func NewID() string { return newUUID() }

// newUUID is a random (version 4) UUID.
func newUUID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return formatUUID(b)
}

// DeliveryID is the deterministic id of the delivery of (handler, source,
// commit_lsn, seq, generation): the idempotency key a handler sees. It is a
// version 8 (custom) UUID from sha256 of the identity.
func DeliveryID(handlerID, source, commitLSN string, seq, generation int) string {
	sum := sha256.Sum256([]byte(fmt.Sprintf("epitaph-delivery\x00%s\x00%s\x00%s\x00%d\x00%d", handlerID, source, commitLSN, seq, generation)))
	var b [16]byte
	copy(b[:], sum[:16])
	b[6] = b[6]&0x0f | 0x80
	b[8] = b[8]&0x3f | 0x80
	return formatUUID(b)
}

func formatUUID(b [16]byte) string {
	h := hex.EncodeToString(b[:])
	return h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:]
}
