package projection

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"time"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/progress"
)

// MaxWaitTimeout caps the timeout of a /wait request.
const MaxWaitTimeout = 5 * time.Minute

// WaitHandler serves GET /wait?lsn=<source LSN>&timeout=<duration>
// (default 30s, at most MaxWaitTimeout): it answers 200 once the live
// version of projection reflects every source transaction up to lsn (see
// WaitLSN), 504 when the timeout passes first, 400 on bad parameters. The
// body is {"lsn": asked, "reflects": how far the live version is, "done"}.
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
		at, err := WaitLSN(ctx, db, projection, lsn, 0)
		body := map[string]any{"lsn": lsn.String(), "reflects": at.String(), "done": err == nil}
		w.Header().Set("Content-Type", "application/json")
		switch {
		case err == nil:
		case errors.Is(err, context.DeadlineExceeded):
			w.WriteHeader(http.StatusGatewayTimeout)
		default:
			body["error"] = err.Error()
			w.WriteHeader(http.StatusServiceUnavailable)
		}
		_ = json.NewEncoder(w).Encode(body)
	})
}
