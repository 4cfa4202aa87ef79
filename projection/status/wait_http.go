package status

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"time"

	"github.com/epitaph-dev/epitaph/event"
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
func WaitHandler(db progress.DB, projection string) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
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
