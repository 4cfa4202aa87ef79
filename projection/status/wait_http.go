package status

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/pgdial"
	"github.com/epitaph-dev/epitaph/progress"
	"github.com/epitaph-dev/epitaph/quarantine"
)

// MaxWaitTimeout caps the timeout of a /wait request.
const MaxWaitTimeout = 5 * time.Minute

// WaitHandler serves GET /wait?lsn=<source LSN>&timeout=<duration>
// (default 30s, at most MaxWaitTimeout), with the answers of `projector
// wait` (WaitComplete): 200 once the live version of projection is
// complete up to lsn, 409 at once when it cannot be (an open quarantined
// event or an unacknowledged blocking gap before lsn; "blockers" names
// them), 504 when the timeout passes first ("error" says where the archive
// is), 400 on bad parameters, 503 when the target cannot be read. The body
// is {"lsn": asked, "complete_up_to": how far the live version is complete,
// "reflects": its lowest watermark, "done"}.
//
// With a WaitLimiter (WithWaitLimit), at most its number of waits run at
// once and a request past it is answered 503 with Retry-After at once;
// db should then be a small pool of the waits' own (NewWaitPool), so that
// waits, which anyone who can reach the port may send, never take
// connections from the apply.
func WaitHandler(db progress.DB, projection string, opts ...WaitOption) http.Handler {
	var o waitOptions
	for _, opt := range opts {
		opt(&o)
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		release, ok := o.limit.TryAcquire()
		if !ok {
			o.limit.Refuse(w)
			return
		}
		defer release()
		lsn, err := event.ParseLSN(r.URL.Query().Get("lsn"))
		if err != nil || lsn == 0 {
			http.Error(w, "lsn: want a source LSN such as 0/16B3748", http.StatusBadRequest)
			return
		}
		timeout := 30 * time.Second
		if s := r.URL.Query().Get("timeout"); s != "" {
			if timeout, err = time.ParseDuration(s); err != nil || timeout <= 0 {
				http.Error(w, "timeout: want a positive duration such as 10s", http.StatusBadRequest)
				return
			}
		}
		ctx, cancel := context.WithTimeout(r.Context(), min(timeout, MaxWaitTimeout))
		defer cancel()
		st, err := WaitComplete(ctx, db, projection, lsn, 0)
		body := map[string]any{"lsn": lsn.String(), "done": err == nil, "complete_up_to": nil, "reflects": nil}
		if st != nil {
			if st.CompleteUpToLSN != "" {
				body["complete_up_to"] = st.CompleteUpToLSN
			}
			if st.SourceLSN != "" {
				body["reflects"] = st.SourceLSN
			}
		}
		w.Header().Set("Content-Type", "application/json")
		var ie *IncompleteError
		var te *TimeoutError
		switch {
		case err == nil:
		case errors.As(err, &ie):
			names := make([]string, len(ie.Blockers))
			for i, b := range ie.Blockers {
				names[i] = b.String()
			}
			body["error"], body["blockers"] = err.Error(), names
			w.WriteHeader(http.StatusConflict)
		case errors.As(err, &te):
			body["error"] = err.Error()
			w.WriteHeader(http.StatusGatewayTimeout)
		default:
			body["error"] = quarantine.Sanitize(err)
			w.WriteHeader(http.StatusServiceUnavailable)
		}
		_ = json.NewEncoder(w).Encode(body)
	})
}

// WaitOption configures WaitHandler.
type WaitOption func(*waitOptions)

type waitOptions struct{ limit *WaitLimiter }

// WithWaitLimit bounds the waits WaitHandler runs at once.
func WithWaitLimit(l *WaitLimiter) WaitOption { return func(o *waitOptions) { o.limit = l } }

// WaitLimiter bounds how many waits (GET /wait, the read API's wait_lsn)
// run at once; a nil *WaitLimiter bounds nothing.
type WaitLimiter struct{ sem chan struct{} }

// NewWaitLimiter allows n waits at once.
func NewWaitLimiter(n int) *WaitLimiter { return &WaitLimiter{sem: make(chan struct{}, max(n, 1))} }

// TryAcquire takes a place, or says there is none: the caller answers
// Refuse. release gives the place back.
func (l *WaitLimiter) TryAcquire() (release func(), ok bool) {
	if l == nil {
		return func() {}, true
	}
	select {
	case l.sem <- struct{}{}:
		return func() { <-l.sem }, true
	default:
		return nil, false
	}
}

// Refuse answers a wait past the limit: 503 with Retry-After.
func (l *WaitLimiter) Refuse(w http.ResponseWriter) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Retry-After", "1")
	w.WriteHeader(http.StatusServiceUnavailable)
	_ = json.NewEncoder(w).Encode(map[string]any{"error": fmt.Sprintf("too many waits at once (at most %d): retry later", cap(l.sem))})
}

// WaitPoolConns is the connections of the waits' own pool (NewWaitPool).
const WaitPoolConns = 4

// NewWaitPool opens the small pool the waits poll the target on, apart
// from the apply's, dialled with tcpTimeout as the apply's (pgdial.Set).
func NewWaitPool(ctx context.Context, url string, tcpTimeout time.Duration) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, err
	}
	pgdial.Set(&cfg.ConnConfig.Config, tcpTimeout)
	cfg.MaxConns, cfg.MinConns = WaitPoolConns, 0
	return pgxpool.NewWithConfig(ctx, cfg)
}
