package console

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/internal/pgdial"
	"github.com/epitaph-dev/epitaph/progress"
	"github.com/epitaph-dev/epitaph/projection/erasure"
	"github.com/epitaph-dev/epitaph/quarantine"
	"github.com/epitaph-dev/epitaph/restore"
)

// maxBody bounds an action's JSON body (a selection of ids, a reason).
const maxBody = 1 << 20

// MaxSelection bounds the deliveries one action touches.
const MaxSelection = 10000

// write wraps an action: the Bearer token, a same-origin request, a JSON
// body; the answer is JSON.
func (c *console) write(act func(*http.Request, []byte) (int, any)) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !c.cfg.Token.Check(r) {
			w.Header().Set("WWW-Authenticate", `Bearer realm="epitaph"`)
			msg := "a bearer token is required (Authorization: Bearer <the --http-token-file token>)"
			if c.cfg.Token == nil {
				msg = "writes are off: start the projector with --http-token-file"
			}
			writeJSON(w, http.StatusUnauthorized, map[string]string{"error": msg})
			return
		}
		if why := crossSite(r); why != "" {
			writeJSON(w, http.StatusForbidden, map[string]string{"error": why})
			return
		}
		if ct := r.Header.Get("Content-Type"); !strings.HasPrefix(ct, "application/json") {
			writeJSON(w, http.StatusUnsupportedMediaType, map[string]string{"error": "want Content-Type: application/json"})
			return
		}
		body, err := io.ReadAll(io.LimitReader(r.Body, maxBody+1))
		if err != nil || len(body) > maxBody {
			writeJSON(w, http.StatusBadRequest, map[string]string{"error": "the body cannot be read or is too large"})
			return
		}
		code, res := act(r, body)
		c.cfg.Logger.Info("console: action", "path", r.URL.Path, "status", code, "actor", Actor)
		writeJSON(w, code, res)
	})
}

// crossSite says why a request started by another site is refused: a
// browser names the site in Sec-Fetch-Site and Origin; tools send neither.
func crossSite(r *http.Request) string {
	switch r.Header.Get("Sec-Fetch-Site") {
	case "", "same-origin", "none":
	default:
		return "refused: the request comes from another site (Sec-Fetch-Site)"
	}
	if o := r.Header.Get("Origin"); o != "" {
		u, err := url.Parse(o)
		if err != nil || u.Host != r.Host {
			return "refused: the request comes from another origin (Origin)"
		}
	}
	return ""
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}

func errorAnswer(code int, format string, args ...any) (int, any) {
	return code, map[string]string{"error": fmt.Sprintf(format, args...)}
}

// RestoreRequest is the body of POST /console/api/restore: the whole
// transaction, or one row of it (Table with Key).
type RestoreRequest struct {
	CorrelationID string          `json:"correlation_id"`
	Table         string          `json:"table,omitempty"`
	Key           json.RawMessage `json:"key,omitempty"`
	OnConflict    string          `json:"on_conflict,omitempty"`
	DryRun        bool            `json:"dry_run"`
}

// RestoreAnswer is restore.Result with where its record is.
type RestoreAnswer struct {
	*restore.Result
	RecordURL string `json:"record_url,omitempty"`
}

func (c *console) restore(r *http.Request, body []byte) (int, any) {
	var req RestoreRequest
	if err := json.Unmarshal(body, &req); err != nil || req.CorrelationID == "" {
		return errorAnswer(http.StatusBadRequest, `want {"correlation_id": "...", "dry_run": true} (and "table", "key" for one row)`)
	}
	if c.cfg.SourceURL == "" {
		return errorAnswer(http.StatusServiceUnavailable, "restores are off: the projector has no source database (--source-url)")
	}
	ctx := r.Context()
	src, err := pgdial.Connect(ctx, c.cfg.SourceURL, c.cfg.SourceTCPTimeout)
	if err != nil {
		return errorAnswer(http.StatusServiceUnavailable, "the source database cannot be reached: %s", quarantine.Sanitize(err))
	}
	defer func() { _ = src.Close(context.WithoutCancel(ctx)) }()
	res, err := restore.Run(ctx, c.cfg.DB, src, restore.Config{Source: c.cfg.Source, CorrelationID: req.CorrelationID,
		Table: req.Table, Key: req.Key, OnConflict: req.OnConflict, DryRun: req.DryRun, Actor: Actor})
	var ce *restore.ConflictError
	var cannot *restore.CannotError
	ans := RestoreAnswer{Result: res}
	if res != nil && res.ID > 0 {
		ans.RecordURL = fmt.Sprintf("%srestores/%d", Prefix, res.ID)
	}
	switch {
	case err == nil:
		return http.StatusOK, ans
	case errors.As(err, &ce):
		return http.StatusConflict, map[string]any{"error": err.Error(), "conflicts": ce.Rows, "record_url": ans.RecordURL}
	case errors.As(err, &cannot):
		return errorAnswer(http.StatusUnprocessableEntity, "%s", err.Error())
	case res == nil && strings.HasPrefix(err.Error(), "restore: "):
		return errorAnswer(http.StatusBadRequest, "%s", err.Error())
	}
	// The error may quote the row's values (a server error, a trigger's
	// message): logged sanitized, as the answer is.
	c.cfg.Logger.Warn("console: restore failed", "correlation_id", req.CorrelationID, "err", quarantine.Sanitize(err))
	return http.StatusServiceUnavailable, map[string]any{"error": "the restore failed: " + quarantine.Sanitize(err), "record_url": ans.RecordURL}
}

// EraseRequest is the body of POST /console/api/erase.
type EraseRequest struct {
	Table        string          `json:"table"`
	Key          json.RawMessage `json:"key"`
	Reason       string          `json:"reason"`
	WithChildren bool            `json:"with_children"`
}

func (c *console) erase(r *http.Request, body []byte) (int, any) {
	var req EraseRequest
	if err := json.Unmarshal(body, &req); err != nil {
		return errorAnswer(http.StatusBadRequest, `want {"table": "schema.table", "key": {...}, "reason": "..."}`)
	}
	if strings.TrimSpace(req.Reason) == "" {
		return errorAnswer(http.StatusBadRequest, "an erasure needs a reason (kept on its receipt)")
	}
	if len(req.Key) == 0 {
		return errorAnswer(http.StatusBadRequest, "an erasure from the console names one row: its key")
	}
	rec, err := erasure.Erase(r.Context(), c.cfg.DB, erasure.EraseOptions{Table: req.Table, Key: req.Key,
		WithChildren: req.WithChildren, Reason: req.Reason, Actor: Actor})
	switch {
	case err == nil:
		return http.StatusOK, rec
	case errors.Is(err, erasure.ErrBadSelector):
		return errorAnswer(http.StatusBadRequest, "%s", err.Error())
	case errors.Is(err, erasure.ErrHeld):
		return errorAnswer(http.StatusConflict, "%s", err.Error())
	}
	c.cfg.Logger.Warn("console: erase failed", "table", req.Table, "err", quarantine.Sanitize(err))
	return errorAnswer(http.StatusServiceUnavailable, "the erasure failed: %s", quarantine.Sanitize(err))
}

// DeliveriesRequest is the body of POST /console/api/deliveries: retry or
// discard the deliveries IDs, or (All) every one matching Filter.
type DeliveriesRequest struct {
	Action string   `json:"action"`
	IDs    []string `json:"ids"`
	All    bool     `json:"all"`
	Filter struct {
		HandlerID string `json:"handler_id"`
		State     string `json:"state"`
		Table     string `json:"table"`
	} `json:"filter"`
}

// DeliveriesAnswer counts what was done; Failed names what was not, why.
type DeliveriesAnswer struct {
	Action string            `json:"action"`
	Done   int               `json:"done"`
	Failed map[string]string `json:"failed"`
}

func (c *console) deliveries(r *http.Request, body []byte) (int, any) {
	var req DeliveriesRequest
	if err := json.Unmarshal(body, &req); err != nil {
		return errorAnswer(http.StatusBadRequest, `want {"action": "retry"|"discard", "ids": [...]} or {"action": ..., "all": true, "filter": {...}}`)
	}
	act := handler.Retry
	switch req.Action {
	case "retry":
	case "discard":
		act = handler.Discard
	default:
		return errorAnswer(http.StatusBadRequest, "action %q: want retry or discard", req.Action)
	}
	ids := req.IDs
	if req.All {
		if len(ids) > 0 {
			return errorAnswer(http.StatusBadRequest, "give ids or all with a filter, not both")
		}
		f := handler.Filter{HandlerID: req.Filter.HandlerID, State: req.Filter.State, Limit: MaxSelection}
		if f.State == "" {
			return errorAnswer(http.StatusBadRequest, "all: the filter needs a state (dead, pending or stopped)")
		}
		if s, t, ok := strings.Cut(req.Filter.Table, "."); ok {
			f.Schema, f.Table = s, t
		} else if req.Filter.Table != "" {
			return errorAnswer(http.StatusBadRequest, "filter table %q: want schema.table", req.Filter.Table)
		}
		list, err := handler.ListDeliveries(r.Context(), c.cfg.DB, f)
		if err != nil {
			return errorAnswer(http.StatusBadRequest, "%s", quarantine.Sanitize(err))
		}
		for _, d := range list {
			ids = append(ids, d.ID)
		}
	}
	if len(ids) == 0 {
		return errorAnswer(http.StatusBadRequest, "no deliveries selected")
	}
	if len(ids) > MaxSelection {
		return errorAnswer(http.StatusBadRequest, "%d deliveries: at most %d an action", len(ids), MaxSelection)
	}
	ans := DeliveriesAnswer{Action: req.Action, Failed: map[string]string{}}
	for _, id := range ids {
		if err := act(r.Context(), c.cfg.DB, id); err != nil {
			ans.Failed[id] = quarantine.Sanitize(err)
			continue
		}
		ans.Done++
	}
	code := http.StatusOK
	if ans.Done == 0 {
		code = http.StatusConflict
	}
	return code, ans
}

// HoldRequest is the body of POST /console/api/holds: a legal hold on one
// row (Key) or on the rows matching Match, with its reason.
type HoldRequest struct {
	Table  string          `json:"table"`
	Key    json.RawMessage `json:"key,omitempty"`
	Match  json.RawMessage `json:"match,omitempty"`
	Reason string          `json:"reason"`
}

func (c *console) addHold(r *http.Request, body []byte) (int, any) {
	var req HoldRequest
	if err := json.Unmarshal(body, &req); err != nil {
		return errorAnswer(http.StatusBadRequest, `want {"table": "schema.table", "key": {...}, "reason": "..."} (the key as JSON)`)
	}
	if strings.TrimSpace(req.Reason) == "" {
		return errorAnswer(http.StatusBadRequest, "a legal hold needs a reason")
	}
	h, err := erasure.AddLegalHold(r.Context(), c.cfg.DB, erasure.LegalHoldOptions{
		Table: req.Table, Key: req.Key, Match: req.Match, Reason: req.Reason, Actor: Actor})
	switch {
	case err == nil:
		return http.StatusOK, h
	case errors.Is(err, erasure.ErrBadSelector):
		return errorAnswer(http.StatusBadRequest, "%s", err.Error())
	}
	return errorAnswer(http.StatusServiceUnavailable, "adding the hold failed: %s", quarantine.Sanitize(err))
}

// HoldRemoveRequest is the body of POST /console/api/holds/remove: the
// hold's id and why it is lifted.
type HoldRemoveRequest struct {
	ID     int64  `json:"id"`
	Reason string `json:"reason"`
}

// removeHold lifts a legal hold. The hold's row goes (erasure keeps no
// history of holds), so the removal is recorded in the log with what the
// hold was, who added it and why, the reason it is lifted and the actor.
func (c *console) removeHold(r *http.Request, body []byte) (int, any) {
	var req HoldRemoveRequest
	if err := json.Unmarshal(body, &req); err != nil || req.ID <= 0 {
		return errorAnswer(http.StatusBadRequest, `want {"id": <the hold's id>, "reason": "..."}`)
	}
	if strings.TrimSpace(req.Reason) == "" {
		return errorAnswer(http.StatusBadRequest, "removing a legal hold needs a reason (kept in the log)")
	}
	ctx := r.Context()
	hs, err := erasure.ListLegalHolds(ctx, c.cfg.DB)
	if err != nil {
		return errorAnswer(http.StatusServiceUnavailable, "reading the holds failed: %s", quarantine.Sanitize(err))
	}
	var held *erasure.LegalHold
	for i := range hs {
		if hs[i].ID == req.ID {
			held = &hs[i]
		}
	}
	ok := false
	if held != nil {
		ok, err = erasure.RemoveLegalHold(ctx, c.cfg.DB, req.ID)
		if err != nil {
			return errorAnswer(http.StatusServiceUnavailable, "removing the hold failed: %s", quarantine.Sanitize(err))
		}
	}
	if !ok {
		return errorAnswer(http.StatusNotFound, "no legal hold %d", req.ID)
	}
	c.cfg.Logger.Info("console: legal hold removed", "id", held.ID, "table", held.Table,
		"key", string(held.Key), "match", string(held.Match), "hold_reason", held.Reason, "added_by", held.CreatedBy,
		"reason", req.Reason, "actor", Actor)
	return http.StatusOK, map[string]any{"removed": held.ID, "table": held.Table, "reason": req.Reason, "actor": Actor}
}

// QuarantineRequest is the body of POST /console/api/quarantine: replay
// or discard (with a reason) the entries IDs.
type QuarantineRequest struct {
	Action string  `json:"action"`
	IDs    []int64 `json:"ids"`
	Reason string  `json:"reason"`
}

func (c *console) quarantine(r *http.Request, body []byte) (int, any) {
	var req QuarantineRequest
	if err := json.Unmarshal(body, &req); err != nil || len(req.IDs) == 0 {
		return errorAnswer(http.StatusBadRequest, `want {"action": "replay"|"discard", "ids": [...], "reason": "..."}`)
	}
	if c.cfg.Quarantine == nil {
		return errorAnswer(http.StatusServiceUnavailable, "quarantine actions are not available in this process")
	}
	if len(req.IDs) > MaxSelection {
		return errorAnswer(http.StatusBadRequest, "%d entries: at most %d an action", len(req.IDs), MaxSelection)
	}
	for _, id := range req.IDs {
		if id <= 0 {
			return errorAnswer(http.StatusBadRequest, "entry id %d: want a positive number", id)
		}
	}
	ans := DeliveriesAnswer{Action: req.Action, Failed: map[string]string{}}
	switch req.Action {
	case "replay":
		for _, id := range req.IDs {
			res, err := c.cfg.Quarantine.Replay(r.Context(), id)
			switch {
			case err != nil:
				ans.Failed[fmt.Sprint(id)] = quarantine.Sanitize(err)
			case len(res.Failed) > 0:
				ans.Failed[fmt.Sprint(id)] = "the entry still fails"
			case len(res.Held) > 0:
				ans.Failed[fmt.Sprint(id)] = "held behind an earlier open entry for the same row"
			default:
				ans.Done++
			}
		}
	case "discard":
		if strings.TrimSpace(req.Reason) == "" {
			return errorAnswer(http.StatusBadRequest, "a discard needs a reason (kept in the audit record)")
		}
		for _, id := range req.IDs {
			if err := c.cfg.Quarantine.Discard(r.Context(), id, req.Reason+" (by "+Actor+")"); err != nil {
				ans.Failed[fmt.Sprint(id)] = quarantine.Sanitize(err)
				continue
			}
			ans.Done++
		}
	default:
		return errorAnswer(http.StatusBadRequest, "action %q: want replay or discard", req.Action)
	}
	code := http.StatusOK
	if ans.Done == 0 {
		code = http.StatusConflict
	}
	return code, ans
}

// PruneRequest is the body of POST /console/api/workers/prune: forget the
// workers silent for longer than OlderThan (a Go duration, default 1m,
// at least 10s: a live worker heartbeats well within its lease).
type PruneRequest struct {
	OlderThan string `json:"older_than"`
}

func (c *console) pruneWorkers(r *http.Request, body []byte) (int, any) {
	var req PruneRequest
	if err := json.Unmarshal(body, &req); err != nil {
		return errorAnswer(http.StatusBadRequest, `want {"older_than": "1m"}`)
	}
	age := time.Minute
	if req.OlderThan != "" {
		d, err := time.ParseDuration(req.OlderThan)
		if err != nil || d < 10*time.Second {
			return errorAnswer(http.StatusBadRequest, "older_than %q: want a duration of at least 10s", req.OlderThan)
		}
		age = d
	}
	l, err := progress.NewLeaser(c.cfg.DB, Actor, time.Minute)
	if err != nil {
		return errorAnswer(http.StatusInternalServerError, "%s", err.Error())
	}
	n, err := l.PruneWorkers(r.Context(), age)
	if err != nil {
		return errorAnswer(http.StatusServiceUnavailable, "removing workers failed: %s", quarantine.Sanitize(err))
	}
	return http.StatusOK, map[string]any{"removed": n, "older_than": age.String()}
}
