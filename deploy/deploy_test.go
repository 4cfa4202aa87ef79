// Package deploy_test checks the deployment files in deploy/: they parse,
// they agree with each other (compose services, scrape targets, mounts,
// Kubernetes selectors, the rule copy for the Prometheus Operator), the alert
// rules pass promtool's unit tests, and every metric they name is one the
// code exports.
package deploy_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"gopkg.in/yaml.v3"

	"github.com/epitaph-dev/epitaph/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

// exportedMetric is one metric of the contract in COMMON.md: its name and
// its own labels (Prometheus adds job and instance when scraping).
type exportedMetric struct {
	name   string
	labels []string
}

// exportedMetrics is the list of metrics the capture and the projector
// register. The alerts and the dashboard may only use these. It is the
// COMMON.md contract for now; it is meant to be replaced by a scrape of a
// running system.
var exportedMetrics = []exportedMetric{
	{"epitaph_capture_replication_lag_bytes", nil},
	{"epitaph_capture_replication_lag_seconds", nil},
	{"epitaph_capture_slot_retained_wal_bytes", nil},
	{"epitaph_capture_slot_safe_wal_bytes", nil},
	{"epitaph_capture_slot_time_to_invalidation_seconds", nil},
	{"epitaph_capture_events_published_total", []string{"schema", "table", "op"}},
	{"epitaph_capture_publish_errors_total", nil},
	{"epitaph_capture_transactions_total", nil},
	{"epitaph_capture_confirmed_lsn", nil},
	{"epitaph_capture_tables_without_full_identity", nil},
	{"epitaph_capture_heartbeat_age_seconds", nil},
	{"epitaph_capture_active", nil},
	{"epitaph_capture_connected", []string{"to"}},
	{"epitaph_capture_large_rows_total", nil},
	{"epitaph_capture_stream_limits_restored_total", []string{"limit"}},
	{"epitaph_capture_confirm_lag_seconds", nil},
	{"epitaph_capture_broker_sync_interval_seconds", nil},

	{"epitaph_projector_lag_events", []string{"projection", "version", "partition"}},
	{"epitaph_projector_lag_seconds", []string{"projection", "version", "partition"}},
	{"epitaph_projector_oldest_pending_age_seconds", []string{"projection", "version"}},
	{"epitaph_projector_partition_oldest_pending_age_seconds", []string{"projection", "version", "partition"}},
	{"epitaph_projector_applied_events_total", []string{"projection", "version"}},
	{"epitaph_projector_quarantined_events_total", []string{"projection", "version", "category"}},
	{"epitaph_projector_quarantine_unresolved", []string{"projection", "version"}},
	{"epitaph_projector_quarantine_oldest_age_seconds", []string{"projection", "version"}},
	{"epitaph_projector_snapshot_jobs", []string{"projection", "version", "status"}},
	{"epitaph_projector_snapshot_oldest_pending_age_seconds", []string{"projection", "version"}},
	{"epitaph_projector_version_state", []string{"projection", "version", "state"}},
	{"epitaph_projector_partitions_owned", []string{"projection", "version"}},
	{"epitaph_projector_partitions_unowned", []string{"projection", "version"}},
	{"epitaph_projector_worker_heartbeat_age_seconds", []string{"worker"}},
	{"epitaph_projector_transient_errors_total", []string{"kind"}},
	{"epitaph_projector_gaps", []string{"version", "kind", "acknowledged"}},
	{"epitaph_projector_rows_expired_total", []string{"table"}},
	{"epitaph_projector_expired_oldest_seconds", nil},
	{"epitaph_projector_cleanup_errors_total", nil},
	{"epitaph_projector_cleanup_batch_size", nil},
	{"epitaph_projector_fenced_rows_total", []string{"projection", "version"}},
	{"epitaph_projector_deliveries", []string{"handler", "state"}},
	{"epitaph_projector_delivery_oldest_pending_age_seconds", []string{"handler"}},
	{"epitaph_projector_delivery_attempts_total", []string{"handler", "result"}},
	{"epitaph_projector_delivery_dead_letters_total", []string{"handler"}},
	{"epitaph_projector_delivery_reclaims_total", nil},
	{"epitaph_projector_delivery_stale_settles_total", nil},
	{"epitaph_projector_delivery_duplicates_total", []string{"handler"}},
	{"epitaph_delivery_revalidations_total", []string{"handler", "outcome"}},
	{"epitaph_delivery_revalidation_set_checks_total", []string{"path"}},
}

// scrapeLabels are added to every series by Prometheus (job, instance) or by
// the Prometheus Operator's ServiceMonitor.
var scrapeLabels = []string{"job", "instance", "namespace", "pod", "service", "endpoint", "container"}

// promBuiltins are series Prometheus makes itself that rules may use.
var promBuiltins = map[string][]string{"up": nil}

func metricLabels(name string) ([]string, bool) {
	for _, m := range exportedMetrics {
		if m.name == name {
			return m.labels, true
		}
	}
	l, ok := promBuiltins[name]
	return l, ok
}

var (
	epitaphMetricRe = regexp.MustCompile(`\bepitaph_[a-z0-9_]+\b`)
	// A selector with matchers: name{a="x", b=~"y"}.
	selectorRe = regexp.MustCompile(`\b([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}`)
	matcherRe  = regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)`)
	// Label lists of aggregations and vector matching.
	groupingRe = regexp.MustCompile(`\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)`)
)

// checkPromQL reports the problems of expr against the metric contract:
// unknown epitaph_ metrics, matchers on labels the metric does not have,
// grouping by labels no metric of the expression has.
func checkPromQL(expr string) []string {
	var problems []string
	allowed := map[string]bool{}
	for _, l := range scrapeLabels {
		allowed[l] = true
	}
	for _, name := range epitaphMetricRe.FindAllString(expr, -1) {
		labels, ok := metricLabels(name)
		if !ok {
			problems = append(problems, "unknown metric "+name)
			continue
		}
		for _, l := range labels {
			allowed[l] = true
		}
	}
	for _, m := range selectorRe.FindAllStringSubmatch(expr, -1) {
		labels, ok := metricLabels(m[1])
		if !ok {
			if strings.HasPrefix(m[1], "epitaph_") {
				continue // reported above
			}
			problems = append(problems, "selector on a metric the code does not export: "+m[1])
			continue
		}
		for _, mm := range matcherRe.FindAllStringSubmatch(m[2], -1) {
			if !slices.Contains(labels, mm[1]) && !slices.Contains(scrapeLabels, mm[1]) {
				problems = append(problems, "metric "+m[1]+" has no label "+mm[1])
			}
		}
	}
	for _, m := range groupingRe.FindAllStringSubmatch(expr, -1) {
		for _, l := range strings.Split(m[2], ",") {
			l = strings.TrimSpace(l)
			if l != "" && !allowed[l] {
				problems = append(problems, m[1]+" ("+l+"): no metric of the expression has that label")
			}
		}
	}
	return problems
}

func TestCheckPromQLCatchesMistakes(t *testing.T) {
	t.Parallel()
	cases := []struct {
		expr string
		bad  bool
	}{
		{`max by (projection, version) (epitaph_projector_oldest_pending_age_seconds) > 600`, false},
		{`up{job="epitaph-capture"} == 0`, false},
		{`epitaph_capture_lag_seconds > 1`, true},                                     // not exported
		{`max by (partition) (epitaph_projector_oldest_pending_age_seconds)`, true},   // label of another metric
		{`epitaph_projector_snapshot_jobs{state="failed"}`, true},                     // status, not state
		{`sum by (kind) (rate(epitaph_projector_transient_errors_total[5m]))`, false}, // kind is its label
		{`node_load1{instance="x"}`, true},                                            // not ours, not Prometheus'
	}
	for _, c := range cases {
		got := checkPromQL(c.expr)
		if c.bad {
			require.NotEmpty(t, got, c.expr)
		} else {
			require.Empty(t, got, c.expr)
		}
	}
}

// TestEveryFileParses parses every YAML (all documents) and JSON file under
// deploy/.
func TestEveryFileParses(t *testing.T) {
	t.Parallel()
	var yamls, jsons int
	err := filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		data, err := os.ReadFile(path)
		require.NoError(t, err)
		switch filepath.Ext(path) {
		case ".yaml", ".yml":
			yamls++
			dec := yaml.NewDecoder(bytes.NewReader(data))
			docs := 0
			for {
				var doc any
				err := dec.Decode(&doc)
				if errors.Is(err, io.EOF) {
					break
				}
				require.NoError(t, err, path)
				require.NotNil(t, doc, "%s: empty document %d", path, docs)
				docs++
			}
			require.Positive(t, docs, path)
		case ".json":
			jsons++
			var doc any
			require.NoError(t, json.Unmarshal(data, &doc), path)
		}
		return nil
	})
	require.NoError(t, err)
	require.GreaterOrEqual(t, yamls, 10, "YAML files found")
	require.GreaterOrEqual(t, jsons, 1, "JSON files found")
}

// readYAML decodes one YAML document into v, rejecting fields v does not
// declare when strict (a misspelt key is an error, not a silent default).
func readYAML(t *testing.T, path string, v any, strict bool) {
	t.Helper()
	data, err := os.ReadFile(path)
	require.NoError(t, err)
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(strict)
	require.NoError(t, dec.Decode(v), path)
}

// readYAMLDocs decodes every document of a multi-document file.
func readYAMLDocs(t *testing.T, path string) []map[string]any {
	t.Helper()
	data, err := os.ReadFile(path)
	require.NoError(t, err)
	dec := yaml.NewDecoder(bytes.NewReader(data))
	var docs []map[string]any
	for {
		var doc map[string]any
		err := dec.Decode(&doc)
		if errors.Is(err, io.EOF) {
			return docs
		}
		require.NoError(t, err, path)
		docs = append(docs, doc)
	}
}

// promtool finds promtool. It is not optional: the rule tests are the proof
// that the alerts fire. Debian's `prometheus` package ships it.
func promtool(t *testing.T) string {
	t.Helper()
	p, err := exec.LookPath("promtool")
	if err != nil {
		t.Fatalf("promtool not found: install it with `apt-get install -y prometheus` (Debian's package ships /usr/bin/promtool)")
	}
	return p
}

func runPromtool(t *testing.T, dir string, args ...string) string {
	t.Helper()
	cmd := exec.Command(promtool(t), args...)
	cmd.Dir = dir
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "promtool %s:\n%s", strings.Join(args, " "), out)
	return string(out)
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// TestExportedMetricsAreInTheCode: each metric of the contract is named in
// the code of the module (outside deploy/ and tests), so a rename there
// fails here instead of silently emptying an alert or a panel. A scrape of
// a running system would also check labels; this catches renames.
func TestExportedMetricsAreInTheCode(t *testing.T) {
	t.Parallel()
	found := map[string]bool{}
	err := filepath.WalkDir("..", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			switch d.Name() {
			case ".git", "deploy", "testdata", "node_modules":
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		src, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, m := range quotedMetricRe.FindAllStringSubmatch(string(src), -1) {
			found[m[1]] = true
		}
		return nil
	})
	require.NoError(t, err)
	for _, m := range exportedMetrics {
		require.True(t, found[m.name], "no Go code registers %s", m.name)
	}
}

var quotedMetricRe = regexp.MustCompile(`"(epitaph_[a-z0-9_]+)"`)
