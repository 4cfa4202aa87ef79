package statuspage_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"image/png"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/capture"
	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/observe"
	"github.com/epitaph-dev/epitaph/internal/statuspage"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/internal/workload"
	"github.com/epitaph-dev/epitaph/projection"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/status"
)

const source = "main"

// chromium returns the path of Debian's chromium, failing the test (never
// skipping) when it is not installed.
func chromium(t *testing.T) string {
	t.Helper()
	for _, name := range []string{"chromium", "chromium-browser"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	t.Fatal("chromium is not installed: the status page is tested in a real headless browser; run `apt-get install -y chromium`")
	return ""
}

// browse runs headless chromium on url with extra flags and returns its
// standard output. A browser that dies by a signal of its own (chromium
// has segfaulted in CI with nothing wrong with the page) is run again, at
// most three times in all, each crash logged; any other failure, a
// non-zero exit or the deadline, fails the test at once.
func browse(t *testing.T, bin, target string, extra ...string) string {
	t.Helper()
	for attempt := 1; ; attempt++ {
		out, crash, err := browseOnce(t, bin, target, extra...)
		if crash == "" || attempt == 3 {
			require.NoError(t, err, "chromium %s", strings.Join(extra, " "))
			return out
		}
		t.Logf("chromium crashed (attempt %d, running it again): %s", attempt, crash)
	}
}

// browseOnce runs chromium once. crash is set (with the signal and the
// tail of its standard error) when the browser was killed by a signal
// that the test's deadline did not send.
func browseOnce(t *testing.T, bin, target string, extra ...string) (out, crash string, err error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 90*time.Second)
	defer cancel()
	args := []string{"--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
		"--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
		"--user-data-dir=" + t.TempDir(), "--window-size=1280,900"}
	args = append(append(args, extra...), target)
	cmd := exec.CommandContext(ctx, bin, args...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	b, err := cmd.Output()
	if err == nil {
		return string(b), "", nil
	}
	var exit *exec.ExitError
	if errors.As(err, &exit) && ctx.Err() == nil {
		if ws, ok := exit.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			crash = fmt.Sprintf("%v: %s", ws.Signal(), tail(stderr.String(), 2000))
		}
	}
	return string(b), crash, fmt.Errorf("%w: %s", err, tail(stderr.String(), 2000))
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

func quietLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// failureLogger keeps a component's log and prints it if the test fails.
func failureLogger(t *testing.T, name string) *slog.Logger {
	var (
		mu  sync.Mutex
		buf bytes.Buffer
	)
	t.Cleanup(func() {
		if t.Failed() {
			mu.Lock()
			defer mu.Unlock()
			t.Logf("---- log of %s (last 8000 bytes) ----\n%s", name, tail(buf.String(), 8000))
		}
	})
	return slog.New(slog.NewTextHandler(writerFunc(func(p []byte) (int, error) {
		mu.Lock()
		defer mu.Unlock()
		return buf.Write(p)
	}), &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }

// A running system: a real capture of the shop workload (its own /status
// server), two projector workers sharing the 8 partitions of the stream,
// one event that goes to quarantine, snapshot jobs for the deleted orders.
// Headless chromium loads the page: it shows the live version, both
// owners, the lags, the quarantine count, the snapshot jobs and the
// capture's slot lag; the script refreshes the page in place; a
// screenshot is taken.
func TestPageInBrowser(t *testing.T) {
	t.Parallel()
	bin := chromium(t)
	ctx := t.Context()

	// Source with the shop workload, captured for real.
	srcURL := testenv.NewDatabase(t)
	require.NoError(t, workload.Setup(ctx, srcURL))
	_, err := workload.Seed(ctx, srcURL, workload.SeedConfig{Customers: 8, OrdersPerCustomer: 6})
	require.NoError(t, err)
	u, err := url.Parse(srcURL)
	require.NoError(t, err)
	n := testenv.NewNATS(t)
	capSvc, err := capture.New(capture.Config{
		SourceURL: srcURL, NATSURL: n.URL, DataDir: t.TempDir(), SourceName: source, Tables: workload.Tables, Partitions: 8,
		SlotName: strings.TrimPrefix(u.Path, "/"), PublicationName: "statuspage", HeartbeatInterval: -1,
		BrokerSyncInterval: -1, MetricsAddr: "127.0.0.1:0",
	}, capture.WithLogger(failureLogger(t, "capture")), capture.WithRegistry(prometheus.NewRegistry()))
	require.NoError(t, err)
	require.NoError(t, capSvc.Start(ctx))
	t.Cleanup(func() { require.NoError(t, capSvc.Stop(context.Background())) })
	// One event no projector can read, which goes to quarantine. The
	// capture is the stream's only writer (each publish expects its own
	// previous message last), so it goes in first, while the stream is
	// still empty: with heartbeats off the capture has published nothing
	// before the first delete.
	_, js := n.Connect(t)
	stream, err := js.Stream(ctx, event.StreamName(source))
	require.NoError(t, err)
	info, err := stream.Info(ctx)
	require.NoError(t, err)
	require.Zero(t, info.State.LastSeq, "the capture published before any delete")
	m := nats.NewMsg(event.CommitSubject(source, 3))
	m.Data = []byte("this is not an event")
	m.Header.Set(event.HeaderMsgID, "statuspage-garbage")
	_, err = js.PublishMsg(ctx, m)
	require.NoError(t, err)

	res, err := workload.Run(ctx, srcURL, workload.Plan{Seed: 7, Transactions: 12, MaxOrdersPerTx: 3})
	require.NoError(t, err)
	require.Positive(t, res.Deleted)

	// Two projector workers; the first serves the page.
	target := testenv.NewDatabase(t)
	cfg := func(worker string) projection.Config {
		return projection.Config{TargetURL: target, NATSURL: n.URL, SourceName: source, WorkerID: worker,
			LeaseTTL: 3 * time.Second, BalanceInterval: 300 * time.Millisecond, FetchWait: 100 * time.Millisecond,
			StatusInterval: 500 * time.Millisecond, SnapshotRoots: []string{"public.orders"}}
	}
	var workers []*projection.Service
	for _, id := range []string{"page-w1", "page-w2"} {
		s, err := projection.New(cfg(id), projection.WithLogger(quietLogger()), projection.WithRegistry(prometheus.NewRegistry()))
		require.NoError(t, err)
		require.NoError(t, s.Start(ctx))
		t.Cleanup(func() { require.NoError(t, s.Stop(context.Background())) })
		workers = append(workers, s)
	}
	svc := workers[0]
	srv := observe.New(observe.Config{Addr: "127.0.0.1:0", Registry: svc.Registry(), Logger: quietLogger(),
		Status: func(ctx context.Context) (any, error) { return svc.Status(ctx) }, Healthy: svc.Healthy})
	srv.Handle("GET /{$}", statuspage.Handler(svc.Status,
		statuspage.WithCaptureStatusURL("http://"+capSvc.MetricsAddr()+"/status"),
		statuspage.WithSnapshotStats(svc.Pool(), time.Second), statuspage.WithLogger(quietLogger())))
	require.NoError(t, srv.Start(ctx))
	t.Cleanup(func() { require.NoError(t, srv.Stop(context.Background())) })
	pageURL := "http://" + srv.Addr() + "/"

	st, owners := waitSettled(t, svc, capSvc, target, res.Deleted)
	require.Equal(t, 8, st.Partitions)
	require.Positive(t, st.StreamLast)

	// What the archive is known to miss: a slot recreated upstream (the
	// row the apply records for a gap event) and a truncate.
	tconn, err := pgx.Connect(ctx, target)
	require.NoError(t, err)
	t.Cleanup(func() { tconn.Close(context.WithoutCancel(ctx)) })
	_, err = tconn.Exec(ctx, fmt.Sprintf(`INSERT INTO %[1]s (kind, from_lsn, to_lsn) VALUES ('lost_upstream', '0/16B3748', '0/2000000');
		INSERT INTO %[1]s (kind, schema_name, table_name, partition, from_lsn, to_lsn) VALUES ('truncate', 'public', 'sessions', 3, '0/2100000', '0/2100000')`,
		pgx.Identifier{st.Versions[0].Schema, "gaps"}.Sanitize()))
	require.NoError(t, err)

	// The DOM as the browser rendered it, after the script refreshed the
	// page in place at least once (virtual time runs its 2s timer).
	dom := browse(t, bin, pageURL, "--virtual-time-budget=6000", "--dump-dom")
	require.Contains(t, dom, `data-fragment="body"`, "page did not render:\n%s", tail(dom, 3000))
	require.Regexp(t, `<div id="page" data-refreshed="[1-9]`, dom, "the script did not refresh the page in place")
	require.Contains(t, dom, `data-testid="version-state">live<`)
	require.Contains(t, dom, `data-testid="version-quarantine">1<`)
	require.Contains(t, dom, `data-testid="quarantine-unresolved">1<`)
	require.Contains(t, dom, "malformed 1")
	last := regexp.MustCompile(`data-testid="stream-last">(\d+)<`).FindStringSubmatch(dom)
	require.NotNil(t, last, "the stream's last sequence")
	lastSeq, err := strconv.ParseUint(last[1], 10, 64)
	require.NoError(t, err)
	require.GreaterOrEqual(t, lastSeq, st.StreamLast, "the stream's last sequence (heartbeats keep adding)")
	owned := regexp.MustCompile(`data-testid="owner">(page-w[12])<`).FindAllStringSubmatch(dom, -1)
	require.Len(t, owned, 8, "one owner per partition")
	seen := map[string]int{}
	for _, o := range owned {
		seen[o[1]]++
	}
	require.Equal(t, owners, seen, "the owners the status reports")
	require.Len(t, regexp.MustCompile(`data-testid="lag">0<`).FindAllString(dom, -1), 8, "every partition caught up")
	require.Regexp(t, `data-testid="capture-lag">\d+(\.\d)? (B|KiB|MiB)<`, dom, "the capture's slot lag")
	require.Contains(t, dom, `<span class="badge streaming">streaming</span>`)
	m2 := regexp.MustCompile(`data-testid="snapshots-complete">(\d+)<`).FindStringSubmatch(dom)
	require.NotNil(t, m2, "snapshot jobs")
	require.NotEqual(t, "0", m2[1])
	require.Contains(t, dom, `data-testid="snapshots-pending">0<`)
	require.Contains(t, dom, `data-testid="snapshots-failed">0<`)
	require.Contains(t, dom, "page-w1")
	require.Contains(t, dom, `<p id="stale" class="stale" hidden=""></p>`, "no refresh failed")
	// Readiness and gaps: not ready (the quarantine and the gap), complete
	// only up to where the gap starts, both rows listed.
	require.Contains(t, dom, `data-testid="version-gaps"><span class="none">1</span><`)
	// (With heartbeats off a partition no transaction went to has not
	// started: it may be named first.)
	require.Regexp(t, `data-testid="version-ready" title="[^"]*1 quarantined events open; 1 unacknowledged gaps">not ready<`, dom)
	require.Regexp(t, `archive v1 is not ready: [^<]*1 quarantined events open; 1 unacknowledged gaps<`, dom)
	require.Contains(t, dom, `data-testid="gap-row" data-kind="lost_upstream"`)
	require.Contains(t, dom, `<span class="badge danger">lost_upstream</span>`)
	require.Contains(t, dom, `data-testid="gap-row" data-kind="truncate"`)
	require.Contains(t, dom, "public.sessions")
	// Complete up to nowhere: the quarantined event came first in its
	// partition, and with heartbeats off some partitions have no watermark.
	require.Regexp(t, `data-testid="version-complete">(–|0/0)<`, dom, "not complete past the quarantine or the gap")

	// Acknowledged, the gap says so and no longer counts as open.
	vg, err := status.ListGaps(ctx, svc.Pool(), archive.Projection)
	require.NoError(t, err)
	require.Len(t, vg, 1)
	var gapID int64
	for _, g := range vg[0].Gaps {
		if g.Kind == event.GapLostUpstream {
			gapID = g.ID
		}
	}
	_, err = status.AckGap(ctx, svc.Pool(), archive.Projection, 0, gapID, "known: slot recreated in the test")
	require.NoError(t, err)
	dom = browse(t, bin, pageURL, "--dump-dom")
	require.Contains(t, dom, `data-testid="version-gaps">0<`)
	require.Regexp(t, `data-testid="gap-ack">\d{4}-\d\d-\d\d \d\d:\d\d UTC: known: slot recreated in the test<`, dom)
	require.Regexp(t, `data-testid="version-ready" title="[^"]*1 quarantined events open">not ready<`, dom)

	// Without scripts the page still loads and shows the data.
	noJS := browse(t, bin, pageURL, "--disable-javascript", "--dump-dom")
	require.Contains(t, noJS, `data-testid="version-state">live<`)
	require.Contains(t, noJS, `http-equiv="refresh"`)
	require.Contains(t, noJS, `<div id="page"><div data-fragment="body"`, "no script ran")

	screenshot(t, bin, pageURL, "statuspage.png")

	// The workers stop; the capture goes on. Read as `projector status`
	// does (straight from the target and the stream), the page shows the
	// partitions without owners and the lag building up behind them.
	for _, w := range workers {
		require.NoError(t, w.Stop(context.Background()))
	}
	more, err := workload.Run(ctx, srcURL, workload.Plan{Seed: 8, Transactions: 10, MaxOrdersPerTx: 2})
	require.NoError(t, err)
	require.Positive(t, more.Deleted)
	pool, err := pgxpool.New(ctx, target)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	collect := func(ctx context.Context) (*status.Status, error) {
		return status.CollectStatus(ctx, pool, js, source, time.Now())
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		st, err = collect(ctx)
		if err == nil && st.Versions[0].LagEvents >= uint64(more.Deleted) {
			break
		}
		require.True(t, time.Now().Before(deadline), "lag never built up: err=%v status=%+v", err, st)
		time.Sleep(200 * time.Millisecond)
	}
	cli := httptest.NewServer(statuspage.Handler(collect, statuspage.WithCaptureStatusURL("http://"+capSvc.MetricsAddr()+"/status"),
		statuspage.WithSnapshotStats(pool, time.Second), statuspage.WithLogger(quietLogger())))
	t.Cleanup(cli.Close)
	dom = browse(t, bin, cli.URL+"/", "--dump-dom")
	require.Contains(t, dom, `data-testid="version-health">unavailable<`)
	require.Len(t, regexp.MustCompile(`data-testid="owner"><span class="none">no owner</span>`).FindAllString(dom, -1), 8)
	lags := regexp.MustCompile(`data-testid="lag">(\d+)<`).FindAllStringSubmatch(dom, -1)
	require.Len(t, lags, 8)
	var total uint64
	for _, l := range lags {
		n, err := strconv.ParseUint(l[1], 10, 64)
		require.NoError(t, err)
		total += n
	}
	require.GreaterOrEqual(t, total, uint64(more.Deleted), "lag of every partition, summed")
	require.Contains(t, dom, `style="width:100%"`, "the longest lag bar")
	screenshot(t, bin, cli.URL+"/", "statuspage-lagging.png")
}

// waitSettled waits for the system to settle: every partition owned by one
// of the two workers, caught up, the bad event in quarantine, the
// snapshots built. It returns the status that showed it and the
// partitions each worker owned then.
func waitSettled(t *testing.T, svc *projection.Service, capSvc *capture.Service, target string, deleted int64) (*status.Status, map[string]int) {
	t.Helper()
	ctx := t.Context()
	owners := map[string]int{}
	deadline := time.Now().Add(90 * time.Second)
	for {
		st, err := svc.Status(ctx)
		settled := err == nil && len(st.Versions) == 1 && st.Versions[0].State == "live" &&
			len(st.Versions[0].Partitions) == 8 && st.Versions[0].LagEvents == 0 && st.Versions[0].QuarantineOpen == 1
		if settled {
			clear(owners)
			for _, p := range st.Versions[0].Partitions {
				if p.Leased {
					owners[p.Owner]++
				}
			}
			settled = owners["page-w1"] > 0 && owners["page-w2"] > 0 && owners["page-w1"]+owners["page-w2"] == 8 &&
				archived(t, target) == deleted && snapshotsDone(t, target, st.Versions[0].Schema)
		}
		if settled {
			return st, owners
		}
		if cs := capSvc.CurrentStatus(); cs.Error != "" {
			t.Fatalf("capture stopped: %s", cs.Error)
		}
		if time.Now().After(deadline) {
			t.Fatalf("system did not settle: err=%v status=%+v\ncapture: %+v", err, st, capSvc.CurrentStatus())
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// screenshot takes a 1280x900 screenshot of the page, checks it is not
// blank and logs where it is (copied to $EPITAPH_STATUSPAGE_SCREENSHOT_DIR
// when set).
func screenshot(t *testing.T, bin, target, name string) {
	t.Helper()
	shot := filepath.Join(t.TempDir(), name)
	browse(t, bin, target, "--screenshot="+shot, "--hide-scrollbars")
	f, err := os.Open(shot)
	require.NoError(t, err)
	defer f.Close()
	img, err := png.Decode(f)
	require.NoError(t, err)
	b := img.Bounds()
	require.Equal(t, 1280, b.Dx())
	require.Equal(t, 900, b.Dy())
	// Not a blank page: many distinct colours (text, badges, bars).
	colours := map[uint32]bool{}
	for y := b.Min.Y; y < b.Max.Y; y += 3 {
		for x := b.Min.X; x < b.Max.X; x += 3 {
			r, g, bl, _ := img.At(x, y).RGBA()
			colours[r>>8<<16|g>>8<<8|bl>>8] = true
		}
	}
	require.Greater(t, len(colours), 50, "screenshot looks blank")
	t.Logf("screenshot: %s (%d distinct colours)", shot, len(colours))
	if dir := os.Getenv("EPITAPH_STATUSPAGE_SCREENSHOT_DIR"); dir != "" {
		data, err := os.ReadFile(shot)
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(filepath.Join(dir, name), data, 0o644))
	}
}

// archived counts the archived rows.
func archived(t *testing.T, target string) int64 {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), target)
	require.NoError(t, err)
	defer conn.Close(context.WithoutCancel(t.Context()))
	var n int64
	if err := conn.QueryRow(t.Context(), `SELECT count(*) FROM archive.rows`).Scan(&n); err != nil {
		return -1
	}
	return n
}

// snapshotsDone reports whether the version has snapshot jobs and none is
// pending.
func snapshotsDone(t *testing.T, target, schema string) bool {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), target)
	require.NoError(t, err)
	defer conn.Close(context.WithoutCancel(t.Context()))
	var pending, total int
	err = conn.QueryRow(t.Context(), fmt.Sprintf(`SELECT count(*) FILTER (WHERE status = 'pending'), count(*) FROM %s`,
		pgx.Identifier{schema, "snapshots"}.Sanitize())).Scan(&pending, &total)
	return err == nil && total > 0 && pending == 0
}

// When a refresh fails (here a proxy in front answers 502), the page keeps
// the last good copy and says the refresh failed.
func TestPageKeepsLastCopyWhenRefreshFails(t *testing.T) {
	t.Parallel()
	bin := chromium(t)
	st := sampleStatus()
	page := statuspage.Handler(func(context.Context) (*status.Status, error) { return st, nil })
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Get("fragment") != "" {
			http.Error(w, "bad gateway", http.StatusBadGateway)
			return
		}
		page.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	dom := browse(t, bin, srv.URL+"/", "--virtual-time-budget=5000", "--dump-dom")
	require.Contains(t, dom, `<p id="stale" class="stale">Refresh failed (HTTP 502): showing the copy from before.</p>`)
	require.Contains(t, dom, `data-testid="lag">40<`, "the last good copy is still shown")
	require.Contains(t, dom, `<div id="page"><div data-fragment="body"`, "nothing was swapped in")
}

// browse runs a browser that crashed by a signal again, and only that: a
// stand-in that kills itself with SIGSEGV on its first run prints on its
// second, and one that exits 1 fails at once (checked by its run count).
func TestBrowseRunsACrashedBrowserAgain(t *testing.T) {
	dir := t.TempDir()
	runs := filepath.Join(dir, "runs")
	script := filepath.Join(dir, "browser")
	require.NoError(t, os.WriteFile(script, []byte(`#!/bin/sh
echo run >> "`+runs+`"
if [ "$(wc -l < "`+runs+`")" -eq 1 ]; then kill -SEGV $$; fi
echo "<html>rendered</html>"
`), 0o755))
	// Parallel only once the stand-in is written and closed: a test forking
	// meanwhile would inherit its open descriptor, and the exec would fail
	// with "text file busy".
	t.Parallel()
	require.Equal(t, "<html>rendered</html>\n", browse(t, script, "http://127.0.0.1:1/"))
	b, err := os.ReadFile(runs)
	require.NoError(t, err)
	require.Equal(t, 2, strings.Count(string(b), "run"), "one crash, one run again")

	_, crash, err := browseOnce(t, "/bin/false", "http://127.0.0.1:1/")
	require.Error(t, err)
	require.Empty(t, crash, "an exit status is not a crash")
}
