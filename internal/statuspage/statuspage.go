// Package statuspage serves the projector's human status page: the
// projection versions and their states, every partition with its owner,
// lag and oldest pending age (small CSS bars), the unresolved quarantine,
// the snapshot jobs by status, the workers and, when the projector knows
// where the capture serves its /status, the capture's slot lag.
//
// The page is one self-contained HTML document (inline CSS and a few lines
// of inline script, no external assets) rendered with html/template, so
// every name that comes from a database or a flag is escaped. With
// scripting on, the page fetches a fresh copy of its own body every
// refresh interval (WithRefreshInterval, default 2s) and swaps it in place,
// keeping the last good copy, marked stale, when a fetch fails; with
// scripting off a meta refresh reloads the page instead.
//
// Versions being rebuilt show a progress bar with their rate and ETA
// (computed from the page's own samples over the last half minute, so a
// page that refreshes every 2 s shows a steady rate); open quarantine
// entries are listed by table, key, category and sanitized error, never
// with their message. When the target cannot be read, every section says
// "unavailable" with the class of reason, never a false "nothing".
//
// Without a token (WithActions, --http-token-file) the page answers
// requests for a loopback host only (httptoken.LoopbackHost; 403
// otherwise: DNS rebinding), as the read API and the console do.
//
// The page only reads, except for its replay and discard buttons: those
// are rendered only for a request that carries the bearer token
// (WithActions, --http-token-file) in its Authorization header, which the
// page's script sends once the operator gave it the token; the POST
// endpoints behind them (ActionHandler) answer 401 without it. Each
// request collects the status once; the snapshot job counts, which count
// whole tables, are read at most once per interval (WithSnapshotStats)
// however many people watch the page.
package statuspage

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/epitaph-dev/epitaph/internal/httptoken"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/snapshot"
	"github.com/epitaph-dev/epitaph/projection/status"
	"github.com/epitaph-dev/epitaph/projection/version"
	"github.com/epitaph-dev/epitaph/quarantine"
)

// Defaults of the options.
const (
	DefaultRefreshInterval       = 2 * time.Second
	DefaultSnapshotStatsInterval = 10 * time.Second
	DefaultCaptureTimeout        = time.Second
	DefaultEntriesLimit          = 50
)

// The rate of a rebuild is measured over the page's samples of the last
// rateWindow, from one at least rateMinAge old; samples are kept
// rateEvery apart.
const (
	rateWindow = 30 * time.Second
	rateMinAge = 2 * time.Second
	rateEvery  = time.Second
)

// fragmentParam asks for the page's body only (what the refresh script
// swaps in).
const fragmentParam = "fragment"

// Option configures the handler.
type Option func(*options)

type options struct {
	captureURL   string
	client       *http.Client
	captureTO    time.Duration
	snapshots    snapshot.Querier
	snapInterval time.Duration
	refresh      time.Duration
	now          func() time.Time
	log          *slog.Logger
	entries      quarantine.Querier
	entriesLimit int
	actions      Actions
	token        *httptoken.Token
	// handlers: the row handlers' delivery counts (handlers.go).
	handlers         handlerDB
	handlersInterval time.Duration
}

// WithCaptureStatusURL is the capture's /status URL (for example
// http://capture:9187/status). Without it the page says the capture's slot
// lag is unknown.
func WithCaptureStatusURL(url string) Option { return func(o *options) { o.captureURL = url } }

// WithHTTPClient is the client that reads the capture's /status; default a
// client with a DefaultCaptureTimeout timeout.
func WithHTTPClient(c *http.Client) Option { return func(o *options) { o.client = c } }

// WithSnapshotStats reads the snapshot job counts of the active archive
// versions through db (the projector's target pool), at most once per
// interval (0: DefaultSnapshotStatsInterval). Without it the page says the
// snapshot jobs are not shown.
func WithSnapshotStats(db snapshot.Querier, interval time.Duration) Option {
	return func(o *options) { o.snapshots, o.snapInterval = db, interval }
}

// WithQuarantineEntries lists the open quarantine entries, at most limit
// of them (0: DefaultEntriesLimit), read through db (the target pool) on
// every load. Without it the page says the entries are not shown.
func WithQuarantineEntries(db quarantine.Querier, limit int) Option {
	return func(o *options) { o.entries, o.entriesLimit = db, limit }
}

// WithActions renders replay and discard buttons on the quarantine
// entries for requests that carry tok (Authorization: Bearer); a and tok
// are those given to ActionHandler. A nil tok renders no button.
func WithActions(a Actions, tok *httptoken.Token) Option {
	return func(o *options) { o.actions, o.token = a, tok }
}

// WithRefreshInterval is how often the page refreshes itself; default
// DefaultRefreshInterval.
func WithRefreshInterval(d time.Duration) Option { return func(o *options) { o.refresh = d } }

// WithClock is the clock of the snapshot statistics cache; default time.Now.
func WithClock(now func() time.Time) Option { return func(o *options) { o.now = now } }

// WithLogger logs failures to collect the page's data; default slog.Default().
func WithLogger(l *slog.Logger) Option { return func(o *options) { o.log = l } }

// StatusFunc returns the projector's status document (projection.Service.Status).
type StatusFunc func(ctx context.Context) (*status.Status, error)

// Handler serves the status page as HTML for GET requests on any path it
// is mounted on (mount it on "GET /{$}"). "?fragment=1" serves the body
// alone, for the in-place refresh. A status that cannot be collected gives
// a 503 page saying why (the refresh keeps trying).
func Handler(src StatusFunc, opts ...Option) http.Handler {
	o := options{refresh: DefaultRefreshInterval, captureTO: DefaultCaptureTimeout, now: time.Now, log: slog.Default()}
	for _, opt := range opts {
		opt(&o)
	}
	if o.refresh <= 0 {
		o.refresh = DefaultRefreshInterval
	}
	if o.snapInterval <= 0 {
		o.snapInterval = DefaultSnapshotStatsInterval
	}
	if o.client == nil {
		o.client = &http.Client{Timeout: o.captureTO}
	}
	if o.entriesLimit <= 0 {
		o.entriesLimit = DefaultEntriesLimit
	}
	return &handler{src: src, o: o}
}

type handler struct {
	src StatusFunc
	o   options

	mu      sync.Mutex // guards the snapshot statistics cache
	snapAt  time.Time
	snap    []snapshotRow
	snapErr string

	rmu     sync.Mutex // guards samples
	samples []*status.Status

	// the row handlers' counts, cached like the snapshot counts (under mu),
	// read through hStats (made at the first read)
	hStats       *handlerStatsReader
	hAt          time.Time
	hRows        []handlerRow
	hNote        string
	hUnavailable bool
}

func (h *handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		w.Header().Set("Allow", "GET, HEAD")
		http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
		return
	}
	// Without a token the page, like the read API and the console, answers
	// requests for a loopback host only: it names tables and quarantined
	// rows' keys, which another name resolving to loopback (DNS
	// rebinding) would let that name's pages read.
	if h.o.token == nil && !httptoken.LoopbackHost(r) {
		http.Error(w, httptoken.LoopbackOnly, http.StatusForbidden)
		return
	}
	ctx := r.Context()
	var (
		wg      sync.WaitGroup
		capView captureView
	)
	wg.Add(1)
	go func() { // the capture answers while the status is collected
		defer wg.Done()
		capView = h.capture(ctx)
	}()
	st, err := h.src(ctx)
	wg.Wait()

	p := &page{Refresh: h.o.refresh, RefreshMillis: h.o.refresh.Milliseconds(), RefreshSeconds: max(1, int(math.Ceil(h.o.refresh.Seconds()))),
		Capture: capView, ActionsOn: h.o.actions != nil && h.o.token != nil}
	code := http.StatusOK
	if err != nil {
		code = http.StatusServiceUnavailable
		p.Unavailable = unavailableReason(err)
		h.o.log.Warn("status page: collect status", "err", quarantine.Sanitize(err))
	} else {
		h.rates(st)
		p.fill(st)
		p.Snapshots, p.SnapshotsNote = h.snapshotStats(ctx, st)
		p.CanAct = p.ActionsOn && h.o.token.Check(r)
		h.quarantineEntries(ctx, p, st.At)
		p.Handlers, p.HandlersNote, p.HandlersUnavailable = h.handlerStats(ctx)
	}
	hdr := w.Header()
	hdr.Set("Content-Type", "text/html; charset=utf-8")
	hdr.Set("Cache-Control", "no-store")
	hdr.Set("X-Content-Type-Options", "nosniff")
	hdr.Set("Vary", "Authorization") // the buttons are for token holders only
	// Nothing is loaded from anywhere: inline style and script only, and
	// fetches of the page itself.
	hdr.Set("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
	name := "page"
	if r.URL.Query().Get(fragmentParam) != "" {
		name = "body"
	}
	w.WriteHeader(code)
	if r.Method == http.MethodHead {
		return
	}
	if err := pageTemplate.ExecuteTemplate(w, name, p); err != nil {
		h.o.log.Warn("status page: render", "err", err)
	}
}

// captureStatus is the part of the capture's /status document
// (capture.Status) the page shows. It is decoded by field name so the
// projector does not link the capture.
type captureStatus struct {
	Source       string  `json:"source"`
	Slot         string  `json:"slot"`
	Active       bool    `json:"active"`
	ConfirmedLSN string  `json:"confirmed_lsn"`
	LagBytes     int64   `json:"lag_bytes"`
	LagSeconds   float64 `json:"lag_seconds"`
	SlotStats    struct {
		CurrentLSN     string    `json:"current_lsn"`
		WALStatus      string    `json:"wal_status"`
		RetainedBytes  int64     `json:"retained_wal_bytes"`
		LagBytes       int64     `json:"lag_bytes"`
		SafeBytes      int64     `json:"safe_wal_bytes"`
		TimeToInvalidS float64   `json:"time_to_invalidation_seconds"`
		At             time.Time `json:"at"`
	} `json:"slot_stats"`
	HeartbeatAgeSec float64 `json:"heartbeat_age_seconds"`
	Error           string  `json:"error"`
}

// maxCaptureStatus bounds the capture document read (it lists tables).
const maxCaptureStatus = 4 << 20

func (h *handler) capture(ctx context.Context) captureView {
	if h.o.captureURL == "" {
		return captureView{Note: "unknown: the projector was not told where the capture serves /status (EPITAPH_CAPTURE_STATUS_URL)"}
	}
	cs, err := h.fetchCapture(ctx)
	if err != nil {
		return captureView{Note: "unknown: " + err.Error()}
	}
	return newCaptureView(cs)
}

func (h *handler) fetchCapture(ctx context.Context) (*captureStatus, error) {
	ctx, cancel := context.WithTimeout(ctx, h.o.captureTO)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, h.o.captureURL, nil)
	if err != nil {
		return nil, fmt.Errorf("capture status URL: %w", err)
	}
	req.Header.Set("Accept", "application/json")
	resp, err := h.o.client.Do(req)
	if err != nil {
		// net/http strips a password from the URL in this error.
		return nil, fmt.Errorf("read capture status: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("read capture status: HTTP %d", resp.StatusCode)
	}
	var cs captureStatus
	if err := json.NewDecoder(io.LimitReader(resp.Body, maxCaptureStatus)).Decode(&cs); err != nil {
		return nil, fmt.Errorf("decode capture status: %w", err)
	}
	return &cs, nil
}

// snapshotStats returns the snapshot job counts of the active archive
// versions, read at most once per interval.
func (h *handler) snapshotStats(ctx context.Context, st *status.Status) ([]snapshotRow, string) {
	if h.o.snapshots == nil {
		return nil, "not shown: this page was not given the target database"
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	now := h.o.now()
	if !h.snapAt.IsZero() && now.Sub(h.snapAt) < h.o.snapInterval {
		return h.snap, h.snapErr
	}
	var rows []snapshotRow
	note := ""
	for _, v := range st.Versions {
		if v.Projection != archive.Projection || v.State == version.StateRetired || v.Schema == "" {
			continue
		}
		s, err := snapshot.GetStats(ctx, h.o.snapshots, v.Schema)
		if pe := (*pgconn.PgError)(nil); errors.As(err, &pe) && pe.Code == "42P01" {
			continue // a version made before snapshots existed
		}
		if err != nil {
			if ctx.Err() != nil {
				return h.snap, h.snapErr // the viewer left; keep the cache
			}
			note = "unknown: " + err.Error()
			h.o.log.Warn("status page: snapshot stats", "schema", v.Schema, "err", err)
			rows = nil
			break
		}
		rows = append(rows, newSnapshotRow(v, s))
	}
	if note == "" && len(rows) == 0 {
		// Nothing counted (no table yet: cheap to ask again); not cached,
		// so a new version's jobs show at once.
		return nil, "no version has a snapshots table"
	}
	h.snap, h.snapErr, h.snapAt = rows, note, now
	return rows, note
}

// rates fills each version's rate and ETA from the page's own sample of
// the status at least rateMinAge old (the oldest within rateWindow), and
// keeps st as a sample. Without such a sample the source's rates stay.
func (h *handler) rates(st *status.Status) {
	h.rmu.Lock()
	defer h.rmu.Unlock()
	keep := h.samples[:0]
	for _, s := range h.samples {
		if age := st.At.Sub(s.At); age <= rateWindow && age >= 0 {
			keep = append(keep, s)
		}
	}
	h.samples = keep
	if len(keep) > 0 && st.At.Sub(keep[0].At) >= rateMinAge {
		st.FillRates(keep[0])
		for _, v := range st.Versions {
			if lc := v.Lifecycle; lc != nil && lc.EventsPerSecond <= 0 && lc.ETASeconds > 0 {
				lc.ETASeconds = -1 // no progress over the window: no estimate, not an old one
			}
		}
	}
	if len(keep) == 0 || st.At.Sub(keep[len(keep)-1].At) >= rateEvery {
		h.samples = append(h.samples, st)
	}
}

// quarantineEntries lists the open entries into p, or says why not.
func (h *handler) quarantineEntries(ctx context.Context, p *page, now time.Time) {
	if h.o.entries == nil {
		p.EntriesNote = "not shown: this page was not given the target database"
		return
	}
	recs, err := quarantine.List(ctx, h.o.entries, quarantine.Filter{Status: quarantine.StatusOpen, Limit: h.o.entriesLimit + 1})
	if pe := (*pgconn.PgError)(nil); errors.As(err, &pe) && pe.Code == "42P01" {
		p.EntriesNote, p.EntriesUnavailable = "unavailable: the target has no quarantine table (run projector migrate up)", true
		return
	}
	if err != nil {
		p.EntriesNote, p.EntriesUnavailable = "unavailable: "+unavailableReason(err), true
		h.o.log.Warn("status page: list quarantine", "err", quarantine.Sanitize(err))
		return
	}
	if len(recs) > h.o.entriesLimit {
		recs, p.EntriesMore = recs[:h.o.entriesLimit], true
	}
	for _, r := range recs {
		p.Entries = append(p.Entries, newEntryView(r, now))
	}
}

// unavailableReason is the class of reason the target could not be read,
// for people: never the error's text, which can name hosts, users and
// values.
func unavailableReason(err error) string {
	var pe *pgconn.PgError
	switch {
	case errors.Is(err, context.DeadlineExceeded) || pgconn.Timeout(err):
		return "the target database did not answer in time"
	case errors.Is(err, context.Canceled):
		return "the request was cancelled"
	case errors.As(err, &pe):
		switch {
		case pe.Code == "28P01" || pe.Code == "28000":
			return fmt.Sprintf("the target database refused the credentials (SQLSTATE %s)", pe.Code)
		case pe.Code == "42P01" || pe.Code == "3F000":
			return fmt.Sprintf("the target database has no Epitaph schema: run projector migrate up (SQLSTATE %s)", pe.Code)
		case strings.HasPrefix(pe.Code, "57") || strings.HasPrefix(pe.Code, "08"):
			return fmt.Sprintf("the target database is shutting down or unavailable (SQLSTATE %s)", pe.Code)
		case pe.Code == "42501":
			return "the target database refused access to the Epitaph tables (SQLSTATE 42501)"
		}
		return fmt.Sprintf("the target database answered with an error (SQLSTATE %s)", pe.Code)
	case errors.Is(err, syscall.ECONNREFUSED):
		return "the target database refuses connections (connection refused)"
	case isConnectError(err):
		return "the target database cannot be reached"
	}
	return "the target database cannot be read"
}

func isConnectError(err error) bool {
	var ce *pgconn.ConnectError
	var ne net.Error
	return errors.As(err, &ce) || errors.As(err, &ne) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF)
}
