package statuspage_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/capture"
	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/statuspage"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/status"
)

func TestMain(m *testing.M) { testenv.MainNoLeaks(m) }

// sampleStatus is a status document as a projector with one live version,
// two partitions (one without an owner, behind) and quarantine would
// collect it. Names carry markup to prove it is escaped.
func sampleStatus() *status.Status {
	at := time.Date(2026, 11, 30, 10, 0, 0, 0, time.UTC)
	exp := at.Add(10 * time.Second)
	adv := at.Add(-3 * time.Second)
	lsn := func(l event.LSN) *event.LSN { return &l }
	str := func(s string) *string { return &s }
	p1 := 1
	return &status.Status{
		Worker: `w1<script>alert(1)</script>`, Source: "main", Stream: "EPITAPH_MAIN", StreamLast: 1234, Partitions: 2, At: at,
		Versions: []status.VersionStatus{{
			Projection: "archive", Version: 1, State: "live", Health: "quarantined", Schema: "archive_v1",
			LagEvents: 40, OldestPendingAgeSeconds: 75, QuarantineOpen: 3,
			NotReadyReasons: []string{"3 quarantined events open", "1 unacknowledged gaps"}, CompleteUpToLSN: "0/16B3748",
			Gaps: []archive.Gap{
				{ID: 7, Kind: event.GapLostUpstream, FromLSN: lsn(0x16B3748), ToLSN: lsn(0x2000000), DetectedAt: at},
				{ID: 8, Kind: event.GapTruncate, Schema: str("public"), Table: str("<sessions>"), Partition: &p1,
					FromLSN: lsn(0x2100000), ToLSN: lsn(0x2100000), DetectedAt: at},
			},
			GapCounts: []status.GapCount{{Kind: event.GapLostUpstream, Count: 1}, {Kind: event.GapTruncate, Count: 1}},
			Partitions: []status.PartitionStatus{
				{Partition: 0, Owner: `w1<script>alert(1)</script>`, Epoch: 2, Leased: true, LeaseExpiresAt: &exp, Cursor: 900,
					SourceLSN: "0/1A2B3C", LastAdvanceAt: &adv},
				{Partition: 1, Owner: "w-gone", Epoch: 5, Cursor: 300, LagEvents: 40, LagSeconds: 75, OldestPendingAgeSeconds: 75,
					Attempts: 3, LastFailureCategory: "transient"},
			},
		}, {Projection: "archive", Version: 0, State: "retired", Health: "retired", Schema: "archive_v0"}},
		Quarantine: []status.QuarantineStatus{{Projection: "archive", Version: 1, Unresolved: 3,
			ByCategory: map[string]int{"malformed": 2, "invalid": 1}, OldestAgeSeconds: 4000}},
		Workers: []status.WorkerStatus{{ID: `w1<script>alert(1)</script>`, HeartbeatAt: at, HeartbeatAgeSeconds: 0.4, Live: true},
			{ID: "w-gone", HeartbeatAt: at.Add(-time.Minute), HeartbeatAgeSeconds: 60, Live: false}},
	}
}

func get(t *testing.T, h http.Handler, target string) (int, http.Header, string) {
	t.Helper()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "http://127.0.0.1:9188"+target, nil))
	b, err := io.ReadAll(rec.Result().Body)
	require.NoError(t, err)
	return rec.Code, rec.Result().Header, string(b)
}

// The page renders every part of the document, escapes what comes from
// outside, loads nothing from elsewhere and refreshes itself (by script,
// or by meta refresh without scripts).
func TestRenderPage(t *testing.T) {
	t.Parallel()
	st := sampleStatus()
	h := statuspage.Handler(func(context.Context) (*status.Status, error) { return st, nil })
	code, hdr, body := get(t, h, "/")
	require.Equal(t, http.StatusOK, code)
	require.Equal(t, "text/html; charset=utf-8", hdr.Get("Content-Type"))
	require.Contains(t, hdr.Get("Content-Security-Policy"), "default-src 'none'")

	require.NotContains(t, body, "<script>alert(1)")
	require.Contains(t, body, "w1&lt;script&gt;alert(1)&lt;/script&gt;")
	for _, want := range []string{
		`data-testid="version-state">live<`, `data-testid="version-health">quarantined<`,
		`data-testid="version-quarantine">3<`, `data-testid="quarantine-unresolved">3<`, "invalid 1, malformed 2",
		`data-testid="lag">40<`, `style="width:100%"`, `<span class="none">no owner</span>`, "(was w-gone)",
		"transient ×3", "1m15s", "1h06m", `data-testid="stream-last">1234<`, "0/1A2B3C", "3s ago",
		"EPITAPH_CAPTURE_STATUS_URL", "snapshot jobs", "not shown", `<span class="badge no">dead</span>`,
		`<noscript><meta http-equiv="refresh" content="2"></noscript>`,
		// Readiness and gaps.
		`data-testid="version-gaps"><span class="none">1</span><`, `data-testid="version-complete">0/16B3748<`,
		`data-testid="version-ready" title="3 quarantined events open; 1 unacknowledged gaps">not ready<`,
		`archive v1 is not ready: 3 quarantined events open; 1 unacknowledged gaps`,
		`data-testid="gap-row" data-kind="lost_upstream" data-gap="7"`, `<span class="badge danger">lost_upstream</span>`,
		"every table", "0/16B3748</td><td>0/2000000", `data-testid="gap-ack"><span class="none">no</span>`,
		`data-testid="gap-row" data-kind="truncate" data-gap="8"`, "public.&lt;sessions&gt;", "informational",
		"projector gaps ack ID --reason TEXT",
	} {
		require.Contains(t, strings.ToLower(body), strings.ToLower(want))
	}
	require.Regexp(t, `var every = +2000 *;`, body)
	// The retired version is listed but has no partition table.
	require.Contains(t, body, `data-version="0"`)
	require.NotContains(t, body, `data-testid="partitions" data-version="0"`)
	// Nothing external: no src= or href= to another origin.
	for _, bad := range []string{"http://", "https://", "src=", "@import", "url("} {
		require.NotContains(t, body, bad)
	}

	// The fragment is the body alone, what the script swaps in.
	code, _, frag := get(t, h, "/?fragment=1")
	require.Equal(t, http.StatusOK, code)
	require.True(t, strings.HasPrefix(frag, `<div data-fragment="body"`), frag[:min(80, len(frag))])
	require.NotContains(t, frag, "<html")
	require.Contains(t, frag, `data-testid="lag">40<`)
}

// A status that cannot be collected is a 503 page that says why, in a
// fragment the refresh can swap in; the page keeps refreshing.
func TestRenderStatusError(t *testing.T) {
	t.Parallel()
	h := statuspage.Handler(func(context.Context) (*status.Status, error) {
		return nil, errors.New("read versions: <connection refused>")
	})
	code, _, body := get(t, h, "/")
	require.Equal(t, http.StatusServiceUnavailable, code)
	require.Contains(t, body, `data-testid="unavailable">Unavailable: the target database cannot be read.`)
	require.NotContains(t, body, "connection refused", "the error text is not shown")
	for _, section := range []string{"versions", "gaps", "quarantine", "snapshots", "workers"} {
		require.Contains(t, body, `data-testid="`+section+`-unavailable">unavailable<`)
	}
	for _, falseNothing := range []string{"No projection version yet", "Nothing in quarantine", "No worker registered", "No gaps"} {
		require.NotContains(t, body, falseNothing)
	}
	require.Contains(t, body, `data-fragment="body"`)
	require.Contains(t, body, "var every")
}

// A lag that could not be measured (the stream unreadable) is "unknown"
// on the page, never 0, and the reason is shown.
func TestRenderUnknownLag(t *testing.T) {
	t.Parallel()
	st := sampleStatus()
	st.StreamError = "NATS nats://127.0.0.1:4222 refused the credentials"
	v := &st.Versions[0]
	v.LagEvents, v.OldestPendingAgeSeconds, v.LagUnknown = 0, 0, st.StreamError
	for i := range v.Partitions {
		p := &v.Partitions[i]
		p.LagEvents, p.LagSeconds, p.OldestPendingAgeSeconds, p.LagUnknown = 0, 0, 0, st.StreamError
	}
	h := statuspage.Handler(func(context.Context) (*status.Status, error) { return st, nil })
	code, _, body := get(t, h, "/")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, `data-testid="stream-error">stream: NATS nats://127.0.0.1:4222 refused the credentials`)
	require.Equal(t, 2, strings.Count(body, `data-testid="lag">unknown<`), "each partition's lag")
	require.NotContains(t, body, `data-testid="lag">0<`)
	require.Contains(t, body, `<td class="num">unknown</td><td class="num">unknown</td>`, "the version's lag and oldest pending")
}

// The capture's own /status document (capture.Status, JSON) is read by
// field name: what the capture serves is what the page shows.
func TestCaptureSection(t *testing.T) {
	t.Parallel()
	cs := capture.Status{Source: "main", Slot: "epitaph", Active: true, ConfirmedLSN: "0/5000060", LagBytes: 3 << 20, LagSeconds: 1.5,
		HeartbeatAgeSec: 4}
	cs.SlotStats.WALStatus = "reserved"
	cs.SlotStats.RetainedBytes = 48 << 20
	cs.SlotStats.SafeBytes = 16 << 20
	cs.SlotStats.TimeToInvalidS = 1800
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		require.NoError(t, json.NewEncoder(w).Encode(cs))
	}))
	t.Cleanup(srv.Close)
	st := sampleStatus()
	src := func(context.Context) (*status.Status, error) { return st, nil }

	_, _, body := get(t, statuspage.Handler(src, statuspage.WithCaptureStatusURL(srv.URL+"/status")), "/")
	for _, want := range []string{
		`data-testid="capture-lag">3.0 MiB<`, `data-testid="capture-lag-seconds">1.5s<`, "48.0 MiB", "16.0 MiB",
		`style="width:75%"`, "30m00s", `<span class="badge streaming">streaming</span>`, "0/5000060",
		`<span class="bar danger"`, // less than an hour left
	} {
		require.Contains(t, body, want)
	}

	// Unlimited WAL: no danger, no estimate.
	cs.SlotStats.SafeBytes, cs.SlotStats.TimeToInvalidS = -1, -1
	_, _, body = get(t, statuspage.Handler(src, statuspage.WithCaptureStatusURL(srv.URL+"/status")), "/")
	require.Contains(t, body, "unlimited")
	require.Contains(t, body, "no limit")
	require.NotContains(t, body, "bar danger")

	// A capture that does not answer: the slot lag is unknown and says why.
	_, _, body = get(t, statuspage.Handler(src, statuspage.WithCaptureStatusURL("http://127.0.0.1:1/status")), "/")
	require.Regexp(t, `data-testid="capture-lag">unknown: read capture status: .*connection refused`, body)
}

// The header shows no figure it does not know: no "last seq 0" while the
// status cannot be read.
func TestRenderUnavailableHeader(t *testing.T) {
	t.Parallel()
	h := statuspage.Handler(func(context.Context) (*status.Status, error) { return nil, context.DeadlineExceeded },
		statuspage.WithLogger(quietLogger()))
	_, _, body := get(t, h, "/")
	require.Contains(t, body, `data-testid="header-unavailable"`)
	require.NotContains(t, body, `data-testid="stream-last"`)
	require.Contains(t, body, "Unavailable: the target database did not answer in time.")
}

// Without --http-token-file the page offers no token field and no button,
// and says how to turn the actions on; the endpoints are off (401).
func TestRenderActionsOff(t *testing.T) {
	t.Parallel()
	st := sampleStatus()
	h := statuspage.Handler(func(context.Context) (*status.Status, error) { return st, nil },
		statuspage.WithActions(statuspage.QuarantineActions(nil, nil), nil))
	_, _, body := get(t, h, "/")
	require.NotContains(t, body, `data-testid="actions-form"`)
	require.NotContains(t, body, `data-action="replay"`)
	rec := httptest.NewRecorder()
	req := httptest.NewRequest(http.MethodPost, "/quarantine/1/replay", strings.NewReader("{}"))
	req.Header.Set("Authorization", "Bearer anything-at-all-0000000")
	mux := http.NewServeMux()
	mux.Handle(statuspage.ActionPattern, statuspage.ActionHandler(statuspage.QuarantineActions(nil, nil), nil, nil))
	mux.ServeHTTP(rec, req)
	require.Equal(t, http.StatusUnauthorized, rec.Code)
	require.Contains(t, rec.Body.String(), "--http-token-file")
}
