package statuspage

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"

	"github.com/epitaph-dev/epitaph/internal/httptoken"
	"github.com/epitaph-dev/epitaph/quarantine"
)

// ActionPattern is where ActionHandler is mounted (POST
// quarantine/<id>/replay, quarantine/<id>/discard with a reason).
const ActionPattern = "POST /quarantine/{id}/{action}"

// Actions are what the page's buttons do to one quarantine entry.
type Actions interface {
	// Replay applies the entry again, as `projector quarantine replay ID`.
	Replay(ctx context.Context, id int64) (quarantine.ReplayResult, error)
	// Discard gives it up with a reason, as `projector quarantine discard
	// ID --reason R`.
	Discard(ctx context.Context, id int64, reason string) error
}

// actionDB is the target pool: transactions for replay, statements for
// discard.
type actionDB interface {
	quarantine.Querier
	quarantine.Beginner
}

// QuarantineActions are the actions of `projector quarantine replay` and
// `discard`, through db with apply (projection.ReplayFunc): the same code,
// so an entry replayed from the page is applied exactly once as from the
// command line.
func QuarantineActions(db actionDB, apply quarantine.ApplyFunc, opts ...ActionsOption) Actions {
	a := quarantineActions{db: db, apply: apply}
	for _, o := range opts {
		o(&a)
	}
	return a
}

// ActionsOption configures QuarantineActions.
type ActionsOption func(*quarantineActions)

// HoldMode says whether the projector runs in hold mode: replay then keeps
// every entry of a source row behind an earlier open one
// (quarantine.Selection.Hold).
func HoldMode(on bool) ActionsOption { return func(a *quarantineActions) { a.hold = on } }

type quarantineActions struct {
	db    actionDB
	apply quarantine.ApplyFunc
	hold  bool
}

func (a quarantineActions) Replay(ctx context.Context, id int64) (quarantine.ReplayResult, error) {
	return quarantine.Replay(ctx, a.db, quarantine.Selection{ID: id, Hold: a.hold}, a.apply)
}

func (a quarantineActions) Discard(ctx context.Context, id int64, reason string) error {
	return quarantine.Discard(ctx, a.db, id, reason)
}

// actionRequest is the body of a discard (JSON).
type actionRequest struct {
	Reason string `json:"reason"`
}

// actionResponse is what an action answers (JSON).
type actionResponse struct {
	ID       int64   `json:"id"`
	Action   string  `json:"action"`
	Status   string  `json:"status,omitempty"`
	Replayed []int64 `json:"replayed,omitempty"`
	Failed   []int64 `json:"failed,omitempty"`
	Held     []int64 `json:"held,omitempty"`
	Error    string  `json:"error,omitempty"`
}

// maxActionBody bounds a request body (a reason).
const maxActionBody = 16 << 10

// ActionHandler serves the page's buttons at ActionPattern: replay and
// discard (JSON body {"reason": "..."}) of one quarantine entry. A request
// without "Authorization: Bearer <token>" matching tok gets 401 (a nil tok:
// always, the actions are off), whatever else it holds; the token is never
// accepted from a cookie or the URL, so another site cannot make a
// browser act (no CSRF). Answers are JSON: 200 done, 400 bad request, 404
// no such entry, 409 already resolved, 422 the entry still fails, 503 the
// target cannot be reached.
func ActionHandler(a Actions, tok *httptoken.Token, log *slog.Logger) http.Handler {
	if log == nil {
		log = slog.Default()
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !tok.Check(r) {
			w.Header().Set("WWW-Authenticate", `Bearer realm="epitaph"`)
			msg := "a bearer token is required (Authorization header)"
			if tok == nil {
				msg = "actions are off: start the projector with --http-token-file"
			}
			answer(w, http.StatusUnauthorized, actionResponse{Error: msg})
			return
		}
		id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
		action := r.PathValue("action")
		res := actionResponse{ID: id, Action: action}
		if err != nil || id <= 0 {
			res.Error = fmt.Sprintf("quarantine entry id %q: want a positive number", r.PathValue("id"))
			answer(w, http.StatusBadRequest, res)
			return
		}
		var code int
		switch action {
		case "replay":
			code, res = replay(r.Context(), a, res)
		case "discard":
			code, res = discard(r, a, res)
		default:
			res.Error = fmt.Sprintf("unknown action %q (want replay or discard)", action)
			code = http.StatusNotFound
		}
		if code >= 500 {
			log.Warn("status page: quarantine action", "action", action, "id", id, "err", res.Error)
		} else {
			log.Info("status page: quarantine action", "action", action, "id", id, "status", code)
		}
		answer(w, code, res)
	})
}

func replay(ctx context.Context, a Actions, res actionResponse) (int, actionResponse) {
	out, err := a.Replay(ctx, res.ID)
	res.Replayed, res.Failed, res.Held = out.Replayed, out.Failed, out.Held
	switch {
	case err != nil:
		return actionError(err, res)
	case len(out.Failed) > 0:
		res.Status, res.Error = string(quarantine.StatusOpen), "the entry still fails: see its error on the page"
		return http.StatusUnprocessableEntity, res
	case len(out.Held) > 0:
		res.Status, res.Error = string(quarantine.StatusOpen), "held behind an earlier open entry for the same row"
		return http.StatusConflict, res
	}
	res.Status = string(quarantine.StatusReplayed)
	return http.StatusOK, res
}

func discard(r *http.Request, a Actions, res actionResponse) (int, actionResponse) {
	var req actionRequest
	if err := json.NewDecoder(io.LimitReader(r.Body, maxActionBody)).Decode(&req); err != nil {
		res.Error = "discard needs a JSON body {\"reason\": \"...\"}"
		return http.StatusBadRequest, res
	}
	if strings.TrimSpace(req.Reason) == "" {
		res.Error = "discard needs a reason (kept in the audit record)"
		return http.StatusBadRequest, res
	}
	if err := a.Discard(r.Context(), res.ID, req.Reason); err != nil {
		return actionError(err, res)
	}
	res.Status = string(quarantine.StatusDiscarded)
	return http.StatusOK, res
}

// actionError maps an action's error to an answer; a failure to reach the
// target says so by class, without the error's text.
func actionError(err error, res actionResponse) (int, actionResponse) {
	switch {
	case errors.Is(err, quarantine.ErrNotFound):
		res.Error = fmt.Sprintf("quarantine entry %d not found", res.ID)
		return http.StatusNotFound, res
	case errors.Is(err, quarantine.ErrNotOpen):
		res.Error = fmt.Sprintf("quarantine entry %d is already resolved", res.ID)
		return http.StatusConflict, res
	}
	res.Error = "unavailable: " + unavailableReason(err)
	return http.StatusServiceUnavailable, res
}

func answer(w http.ResponseWriter, code int, v actionResponse) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}
