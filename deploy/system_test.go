package deploy_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	neturl "net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
	"gopkg.in/yaml.v3"

	capturepkg "github.com/epitaph-dev/epitaph/capture"
	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/bench"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/internal/workload"
)

// absentUntilProvoked are contract metrics a healthy system does not show
// until something happens that this test does not provoke (a labelled
// counter has no series before its first increment).
var absentUntilProvoked = map[string]string{
	"epitaph_projector_transient_errors_total":              "only after a transient failure (target or NATS down)",
	"epitaph_projector_rows_expired_total":                  "only after retention cleanup deleted expired rows",
	"epitaph_projector_fenced_rows_total":                   "only after an erasure fenced a row being applied",
	"epitaph_projector_deliveries":                          "only while row handlers exist",
	"epitaph_projector_delivery_oldest_pending_age_seconds": "only while row handlers exist",
	"epitaph_projector_delivery_attempts_total":             "only after a row handler ran",
	"epitaph_projector_delivery_dead_letters_total":         "only after a delivery went dead",
	"epitaph_projector_delivery_duplicates_total":           "only after a cursor batch sent a delivery queued as a row too (never, normally)",
	"epitaph_delivery_revalidations_total":                  "only after a delivery was revalidated",
	"epitaph_delivery_revalidation_set_checks_total":        "only after a delivery was revalidated",
}

// TestAlertRulesOnARunningSystem runs the real capture and projector
// binaries against a real Postgres and JetStream, and the real Prometheus
// (Debian's package, the one that ships promtool) with deploy/prometheus's
// config and alert rules scraping them. It checks:
//   - the scrape has every metric of the contract, with exactly its labels;
//   - a healthy system raises no alert, and one quarantined event raises
//     EpitaphQuarantineGrowing with the projector's real label values;
//   - SIGKILL of the capture raises EpitaphCaptureNotStreaming and
//     EpitaphCaptureInstanceDown, of the projector EpitaphProjectorDown.
func TestAlertRulesOnARunningSystem(t *testing.T) {
	t.Parallel()
	promBin, err := exec.LookPath("prometheus")
	if err != nil {
		t.Fatalf("prometheus not found: install it with `apt-get install -y prometheus` (the same Debian package ships promtool)")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()

	bctx, bcancel := context.WithTimeout(ctx, 5*time.Minute)
	bins, err := bench.Build(bctx, t.TempDir(), "capture", "projector")
	bcancel()
	require.NoError(t, err)

	// A private Postgres with the compose file's settings, so the slot has
	// the max_slot_wal_keep_size the slot alerts and panels need.
	pg := testenv.NewPostgres(t)
	require.NoError(t, pg.SetConfig(composePostgresSettings(t)...))
	require.NoError(t, pg.Restart())
	url := pg.NewDatabase(t) // source and target, the default setup
	js := testenv.NewNATS(t)
	testenv.Exec(t, url, `
CREATE TABLE public.things (id integer PRIMARY KEY, name text NOT NULL);
ALTER TABLE public.things REPLICA IDENTITY FULL;
INSERT INTO public.things SELECT i, 'thing ' || i FROM generate_series(1, 50) i;`)

	captureAddr, err := bench.LocalAddr()
	require.NoError(t, err)
	projectorAddr, err := bench.LocalAddr()
	require.NoError(t, err)
	logs := t.TempDir()
	captureEnv := []string{
		"EPITAPH_SOURCE_URL=" + url,
		"EPITAPH_NATS_URL=" + js.URL,
		"EPITAPH_DATA_DIR=" + t.TempDir(),
		"EPITAPH_SOURCE_NAME=main",
		"EPITAPH_TABLES=public.things",
		"EPITAPH_PARTITIONS=4",
		"EPITAPH_SLOT=epitaph_deploy",
		"EPITAPH_PUBLICATION=epitaph_deploy",
		"EPITAPH_HEARTBEAT_INTERVAL=1s",
		"EPITAPH_METRICS_ADDR=" + captureAddr,
	}
	capture := startProc(t, "capture", bins["capture"], logs, captureEnv)
	nc, err := nats.Connect(js.URL)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	jsc, err := jetstream.New(nc)
	require.NoError(t, err)
	// The capture makes its stream before its replication slot, and only
	// deletes after the slot exists are in the WAL it reads: wait for both.
	require.NoError(t, workload.WaitFor(ctx, time.Minute, 100*time.Millisecond, func(ctx context.Context) (bool, error) {
		if _, err := jsc.Stream(ctx, event.StreamName("main")); err != nil {
			return false, nil
		}
		n, err := bench.Count(ctx, url, `SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'epitaph_deploy'`)
		return n == 1, err
	}), "the capture creates its stream and slot\n%s", capture.LogTail(4000))
	projector := startProc(t, "projector", bins["projector"], logs, []string{
		"EPITAPH_TARGET_URL=" + url,
		"EPITAPH_NATS_URL=" + js.URL,
		"EPITAPH_SOURCE_NAME=main",
		"EPITAPH_WORKER_ID=deploy-1",
		"EPITAPH_LEASE_TTL=3s",
		"EPITAPH_SNAPSHOT_ROOTS=public.things",
		"EPITAPH_METRICS_ADDR=" + projectorAddr,
	}, "run")

	// Real deletes flow through to the archive.
	testenv.Exec(t, url, `DELETE FROM public.things WHERE id <= 20`)
	require.NoError(t, workload.WaitFor(ctx, 2*time.Minute, 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		n, err := bench.Count(ctx, url, `SELECT count(*) FROM archive.rows WHERE table_name = 'things'`)
		return n == 20, err
	}), "20 deleted rows archived\ncapture:\n%s\nprojector:\n%s", capture.LogTail(3000), projector.LogTail(3000))

	// One event nobody can decode: the projector quarantines it and moves on.
	// The capture is the stream's only writer (it publishes with the
	// expected last message id, and resumes from the position header of the
	// last message), so the bad event goes in while it is stopped, carrying
	// the position of the message before it.
	// (Scrape it first: a labelled counter starts empty in a new process.)
	scraped := scrapeLabelNames(t, ctx, captureAddr)
	require.NoError(t, capture.Stop(30*time.Second), capture.LogTail(3000))
	stream, err := jsc.Stream(ctx, event.StreamName("main"))
	require.NoError(t, err)
	last, err := stream.GetLastMsgForSubject(ctx, event.StreamSubjects("main"))
	require.NoError(t, err)
	_, err = jsc.PublishMsg(ctx, &nats.Msg{
		Subject: event.DeleteSubject("main", 0, "public", "things"),
		Data:    []byte(`{"v":1,"op":"delete", this is not JSON`),
		Header: nats.Header{
			nats.MsgIdHdr:             []string{"deploy-test/not-json"},
			capturepkg.HeaderPosition: []string{last.Header.Get(capturepkg.HeaderPosition)},
		},
	})
	require.NoError(t, err)
	capture = startProc(t, "capture", bins["capture"], logs, captureEnv)
	require.NoError(t, workload.WaitFor(ctx, time.Minute, 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		m, err := bench.Scrape(ctx, captureAddr)
		return err == nil && m["epitaph_capture_active"] == 1, nil
	}), "the capture streams again\n%s", capture.LogTail(3000))
	require.NoError(t, workload.WaitFor(ctx, time.Minute, 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		m, err := bench.Scrape(ctx, projectorAddr)
		_, lag := m["epitaph_projector_lag_events"] // refreshed every few seconds
		return lag && m["epitaph_projector_quarantined_events_total"] >= 1 && m["epitaph_projector_quarantine_unresolved"] >= 1, err
	}), "the bad event is quarantined\n%s", projector.LogTail(3000))

	// The scrape has every metric of the contract, with its labels.
	for _, addr := range []string{captureAddr, projectorAddr} {
		for name, labels := range scrapeLabelNames(t, ctx, addr) {
			if _, seen := scraped[name]; !seen || len(labels) > 0 {
				scraped[name] = labels
			}
		}
	}
	for _, m := range exportedMetrics {
		labels, ok := scraped[m.name]
		if reason, excused := absentUntilProvoked[m.name]; excused && !ok {
			t.Logf("%s not exported yet: %s", m.name, reason)
			continue
		}
		require.True(t, ok, "the running system does not export %s", m.name)
		want := append([]string{}, m.labels...)
		sort.Strings(want)
		require.Equal(t, want, labels, "labels of %s", m.name)
	}
	var extra []string
	for name := range scraped {
		if _, ok := metricLabels(name); !ok && strings.HasPrefix(name, "epitaph_") {
			extra = append(extra, name)
		}
	}
	sort.Strings(extra)
	t.Logf("exported beyond the contract (not used by alerts or dashboard): %v", extra)

	prom := startPrometheus(t, promBin, captureAddr, projectorAddr)

	require.NoError(t, workload.WaitFor(ctx, time.Minute, 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		var resp struct {
			Data struct {
				ActiveTargets []struct {
					Health string            `json:"health"`
					Labels map[string]string `json:"labels"`
				} `json:"activeTargets"`
			} `json:"data"`
		}
		if err := promGet(ctx, prom, "/api/v1/targets", &resp); err != nil {
			return false, err
		}
		up := 0
		for _, tg := range resp.Data.ActiveTargets {
			if tg.Health == "up" {
				up++
			}
		}
		return up == 2, nil
	}), "Prometheus scrapes the capture and the projector")

	// Healthy, but one event quarantined: exactly that alert, carrying the
	// projection and version the projector exports.
	var alerts []promAlert
	err = workload.WaitFor(ctx, time.Minute, 500*time.Millisecond, func(ctx context.Context) (bool, error) {
		alerts, err = activeAlerts(ctx, prom)
		return err == nil && slices.Equal(alertNames(alerts), []string{"EpitaphQuarantineGrowing"}), err
	})
	require.NoError(t, err, "active alerts: %v", alerts)
	require.Equal(t, "warning", alerts[0].Labels["severity"])
	require.NotEmpty(t, alerts[0].Labels["projection"])
	require.NotEmpty(t, alerts[0].Labels["version"])
	require.Contains(t, alerts[0].Annotations["summary"], alerts[0].Labels["projection"]+" v"+alerts[0].Labels["version"]+" is quarantining events")

	checkDashboardQueries(t, ctx, prom)

	// The capture dies.
	capture.Kill()
	err = workload.WaitFor(ctx, time.Minute, 500*time.Millisecond, func(ctx context.Context) (bool, error) {
		alerts, err = activeAlerts(ctx, prom)
		names := alertNames(alerts)
		return err == nil && slices.Contains(names, "EpitaphCaptureNotStreaming") && slices.Contains(names, "EpitaphCaptureInstanceDown"), err
	})
	require.NoError(t, err, "active alerts after killing the capture: %v", alerts)

	// Then the only projector.
	projector.Kill()
	err = workload.WaitFor(ctx, time.Minute, 500*time.Millisecond, func(ctx context.Context) (bool, error) {
		alerts, err = activeAlerts(ctx, prom)
		return err == nil && slices.Contains(alertNames(alerts), "EpitaphProjectorDown"), err
	})
	require.NoError(t, err, "active alerts after killing the projector: %v", alerts)
}

func startProc(t *testing.T, name, bin, logs string, env []string, args ...string) *bench.Proc {
	t.Helper()
	p, err := bench.StartProc(name, bin, env, logs, args...)
	require.NoError(t, err)
	t.Cleanup(func() {
		_ = p.Stop(10 * time.Second)
		if t.Failed() {
			t.Logf("---- log of %s ----\n%s", name, p.LogTail(6000))
		}
	})
	return p
}

// startPrometheus runs Prometheus with deploy/prometheus/prometheus.yml,
// changed only where a test must: the targets (loopback ports), the
// intervals (1s instead of 15s), the path of the rule file, and without the
// self-scrape job.
func startPrometheus(t *testing.T, bin, captureAddr, projectorAddr string) string {
	t.Helper()
	var cfg map[string]any
	readYAML(t, "prometheus/prometheus.yml", &cfg, false)
	rules, err := filepath.Abs("prometheus/alerts.yaml")
	require.NoError(t, err)
	cfg["global"] = map[string]any{"scrape_interval": "1s", "evaluation_interval": "1s"}
	require.Equal(t, []any{"alerts.yaml"}, cfg["rule_files"])
	cfg["rule_files"] = []string{rules}
	targets := map[string]string{"epitaph-capture": captureAddr, "epitaph-projector": projectorAddr}
	var jobs []any
	for _, j := range cfg["scrape_configs"].([]any) {
		job := j.(map[string]any)
		addr, ok := targets[job["job_name"].(string)]
		if !ok {
			continue
		}
		job["static_configs"] = []any{map[string]any{"targets": []string{addr}}}
		jobs = append(jobs, job)
	}
	require.Len(t, jobs, 2, "prometheus.yml scrapes epitaph-capture and epitaph-projector")
	cfg["scrape_configs"] = jobs
	out, err := yaml.Marshal(cfg)
	require.NoError(t, err)
	dir := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(dir, "prometheus.yml"), out, 0o644))

	addr, err := bench.LocalAddr()
	require.NoError(t, err)
	startProc(t, "prometheus", bin, dir, nil,
		"--config.file="+filepath.Join(dir, "prometheus.yml"),
		"--storage.tsdb.path="+filepath.Join(dir, "data"),
		"--web.listen-address="+addr,
	)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	require.NoError(t, workload.WaitFor(ctx, time.Minute, 100*time.Millisecond, func(ctx context.Context) (bool, error) {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/-/ready", nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return false, nil
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK, nil
	}), "Prometheus ready")
	return addr
}

func promGet(ctx context.Context, addr, path string, v any) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+path, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", path, resp.Status)
	}
	return json.NewDecoder(resp.Body).Decode(v)
}

type promAlert struct {
	Labels      map[string]string `json:"labels"`
	Annotations map[string]string `json:"annotations"`
	State       string            `json:"state"`
}

func (a promAlert) String() string { return a.Labels["alertname"] + "(" + a.State + ")" }

// activeAlerts are the pending and firing alerts.
func activeAlerts(ctx context.Context, prom string) ([]promAlert, error) {
	var resp struct {
		Data struct {
			Alerts []promAlert `json:"alerts"`
		} `json:"data"`
	}
	err := promGet(ctx, prom, "/api/v1/alerts", &resp)
	return resp.Data.Alerts, err
}

func alertNames(alerts []promAlert) []string {
	var names []string
	for _, a := range alerts {
		if !slices.Contains(names, a.Labels["alertname"]) {
			names = append(names, a.Labels["alertname"])
		}
	}
	sort.Strings(names)
	return names
}

var sampleLabelRe = regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)="`)

// scrapeLabelNames reads a /metrics endpoint and returns each metric's
// label names (sorted; the union over its series).
func scrapeLabelNames(t *testing.T, ctx context.Context, addr string) map[string][]string {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/metrics", nil)
	require.NoError(t, err)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	sets := map[string]map[string]bool{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		name, rest := line, ""
		if i := strings.IndexAny(line, "{ "); i >= 0 {
			name, rest = line[:i], line[i:]
		}
		if sets[name] == nil {
			sets[name] = map[string]bool{}
		}
		if strings.HasPrefix(rest, "{") {
			for _, m := range sampleLabelRe.FindAllStringSubmatch(rest[:strings.LastIndexByte(rest, '}')+1], -1) {
				sets[name][m[1]] = true
			}
		}
	}
	require.NoError(t, sc.Err())
	out := map[string][]string{}
	for name, set := range sets {
		labels := []string{}
		for l := range set {
			labels = append(labels, l)
		}
		sort.Strings(labels)
		out[name] = labels
	}
	return out
}

// emptyOnAHealthySystem are dashboard queries that rightly return nothing
// on the system of TestAlertRulesOnARunningSystem.
var emptyOnAHealthySystem = map[string]string{
	"Transient errors":                   "no transient failure happened (the counter has no series yet)",
	"Expired rows deleted":               "nothing expired (the counter has no series yet)",
	"Rows kept out by erasure fences":    "nothing was erased (the counter has no series yet)",
	"Deliveries by handler and state":    "no row handler is configured",
	"Oldest pending delivery":            "no row handler is configured",
	"Delivery attempts and dead letters": "no row handler is configured (the reclaim counters alone do show)",
	"Revalidation outcomes":              "no row handler is configured, so nothing is revalidated",
}

// checkDashboardQueries runs every query of the dashboard, as Grafana would
// with "All" selected, against the running system's Prometheus: each must
// succeed and show data, unless listed in emptyOnAHealthySystem.
func checkDashboardQueries(t *testing.T, ctx context.Context, prom string) {
	t.Helper()
	d := loadDashboard(t)
	type query struct{ panel, expr string }
	var queries []query
	for _, p := range allPanels(d.Panels) {
		for _, tg := range p.Targets {
			queries = append(queries, query{p.Title, concreteQuery(t, tg.Expr)})
		}
	}
	require.NotEmpty(t, queries)
	var empty []string
	// Rates need two scrapes inside their window: retry for a while.
	err := workload.WaitFor(ctx, 30*time.Second, time.Second, func(ctx context.Context) (bool, error) {
		empty = empty[:0]
		for _, q := range queries {
			var resp struct {
				Status string `json:"status"`
				Data   struct {
					Result []json.RawMessage `json:"result"`
				} `json:"data"`
			}
			if err := promGet(ctx, prom, "/api/v1/query?query="+neturl.QueryEscape(q.expr), &resp); err != nil {
				return false, fmt.Errorf("%s: %s: %w", q.panel, q.expr, err)
			}
			if resp.Status != "success" {
				return false, fmt.Errorf("%s: %s: status %s", q.panel, q.expr, resp.Status)
			}
			if _, excused := emptyOnAHealthySystem[q.panel]; len(resp.Data.Result) == 0 && !excused {
				empty = append(empty, q.panel+": "+q.expr)
			}
		}
		return len(empty) == 0, nil
	})
	require.NoError(t, err, "dashboard queries without data on a running system:\n%s", strings.Join(empty, "\n"))
}
