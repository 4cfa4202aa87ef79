package deploy_test

import (
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

type ruleFile struct {
	Groups []ruleGroup `yaml:"groups"`
}

type ruleGroup struct {
	Name  string      `yaml:"name"`
	Rules []alertRule `yaml:"rules"`
}

type alertRule struct {
	Alert       string            `yaml:"alert"`
	Expr        string            `yaml:"expr"`
	For         string            `yaml:"for"`
	Labels      map[string]string `yaml:"labels"`
	Annotations map[string]string `yaml:"annotations"`
}

type ruleTestFile struct {
	RuleFiles          []string   `yaml:"rule_files"`
	EvaluationInterval string     `yaml:"evaluation_interval"`
	Tests              []ruleTest `yaml:"tests"`
}

type ruleTest struct {
	Name        string `yaml:"name"`
	Interval    string `yaml:"interval"`
	InputSeries []struct {
		Series string `yaml:"series"`
		Values string `yaml:"values"`
	} `yaml:"input_series"`
	AlertRuleTest []struct {
		EvalTime  string `yaml:"eval_time"`
		Alertname string `yaml:"alertname"`
		ExpAlerts []struct {
			ExpLabels      map[string]string `yaml:"exp_labels"`
			ExpAnnotations map[string]string `yaml:"exp_annotations"`
		} `yaml:"exp_alerts"`
	} `yaml:"alert_rule_test"`
}

func loadAlerts(t *testing.T) []alertRule {
	t.Helper()
	var f ruleFile
	readYAML(t, "prometheus/alerts.yaml", &f, true)
	var rules []alertRule
	for _, g := range f.Groups {
		require.NotEmpty(t, g.Name)
		rules = append(rules, g.Rules...)
	}
	return rules
}

func TestAlertRulesAreWellFormed(t *testing.T) {
	t.Parallel()
	rules := loadAlerts(t)
	require.NotEmpty(t, rules)
	seen := map[string]bool{}
	for _, r := range rules {
		require.NotEmpty(t, r.Alert, "every rule is an alert (no recording rules here): %q", r.Expr)
		require.False(t, seen[r.Alert], "alert %s defined twice", r.Alert)
		seen[r.Alert] = true
		require.True(t, strings.HasPrefix(r.Alert, "Epitaph"), "%s: alert names start with Epitaph", r.Alert)
		require.Contains(t, []string{"critical", "warning", "info"}, r.Labels["severity"], "%s: severity", r.Alert)
		require.NotEmpty(t, r.Annotations["summary"], "%s: summary", r.Alert)
		// The description is the runbook: what it means and what to do.
		require.Greater(t, len(strings.Fields(r.Annotations["description"])), 25, "%s: description too short to be a runbook", r.Alert)
		require.Empty(t, checkPromQL(r.Expr), "%s: %s", r.Alert, r.Expr)
		for _, a := range r.Annotations {
			for _, name := range epitaphMetricRe.FindAllString(a, -1) {
				_, ok := metricLabels(name)
				require.True(t, ok, "%s: annotation names unknown metric %s", r.Alert, name)
			}
		}
	}
	out := runPromtool(t, "prometheus", "check", "rules", "alerts.yaml")
	require.Contains(t, out, "SUCCESS")
}

// TestAlertsCoverTheOperatorsConcerns pins the alerts operators rely on, so
// none is dropped by an edit.
func TestAlertsCoverTheOperatorsConcerns(t *testing.T) {
	t.Parallel()
	names := map[string]alertRule{}
	for _, r := range loadAlerts(t) {
		names[r.Alert] = r
	}
	concerns := map[string][]string{
		"slot WAL danger":         {"EpitaphSlotInvalidationSoon", "EpitaphSlotWALNearLimit", "EpitaphSlotRetainedWALHigh"},
		"capture lag":             {"EpitaphCaptureLagHigh", "EpitaphCaptureLagBytesHigh"},
		"capture down":            {"EpitaphCaptureNotStreaming", "EpitaphCaptureInstanceDown"},
		"projector lag":           {"EpitaphProjectorLagHigh", "EpitaphProjectorLagEventsHigh"},
		"oldest pending age":      {"EpitaphOldestPendingTooOld"},
		"quarantine growth":       {"EpitaphQuarantineGrowing", "EpitaphQuarantineUnresolved"},
		"snapshot jobs failing":   {"EpitaphSnapshotJobsFailing", "EpitaphSnapshotBacklog"},
		"partition without owner": {"EpitaphPartitionUnowned"},
		"worker heartbeat stale":  {"EpitaphWorkerHeartbeatStale"},
		"no projector at all":     {"EpitaphProjectorDown"},
	}
	for concern, alerts := range concerns {
		for _, a := range alerts {
			require.Contains(t, names, a, "alert for %s", concern)
		}
	}
	require.Contains(t, names["EpitaphSlotInvalidationSoon"].Expr, "epitaph_capture_slot_time_to_invalidation_seconds")
	require.Contains(t, names["EpitaphOldestPendingTooOld"].Expr, "epitaph_projector_oldest_pending_age_seconds")
	require.Contains(t, names["EpitaphPartitionUnowned"].Expr, "epitaph_projector_partitions_unowned")
}

var seriesNameRe = regexp.MustCompile(`^([a-zA-Z_:][a-zA-Z0-9_:]*)`)

// TestAlertRuleUnitTests runs promtool's unit tests of the rules and checks
// they test every alert both firing and staying quiet, on series the code
// really exports (a test on a misspelt series would pass vacuously).
func TestAlertRuleUnitTests(t *testing.T) {
	t.Parallel()
	var tf ruleTestFile
	readYAML(t, "prometheus/alerts_test.yaml", &tf, true)
	require.Equal(t, []string{"alerts.yaml"}, tf.RuleFiles)

	alerts := map[string]bool{}
	for _, r := range loadAlerts(t) {
		alerts[r.Alert] = true
	}
	fires, quiet := map[string]bool{}, map[string]bool{}
	for _, tc := range tf.Tests {
		require.NotEmpty(t, tc.Name, "every test case says what it is")
		for _, s := range tc.InputSeries {
			name := seriesNameRe.FindString(s.Series)
			_, ok := metricLabels(name)
			require.True(t, ok, "%s: input series %s is not an exported metric", tc.Name, s.Series)
			require.Empty(t, checkPromQL(s.Series), "%s: %s", tc.Name, s.Series)
		}
		for _, at := range tc.AlertRuleTest {
			require.True(t, alerts[at.Alertname], "%s: tests unknown alert %s", tc.Name, at.Alertname)
			if len(at.ExpAlerts) == 0 {
				quiet[at.Alertname] = true
				continue
			}
			fires[at.Alertname] = true
			for _, e := range at.ExpAlerts {
				require.NotEmpty(t, e.ExpLabels["severity"], "%s: %s expected labels", tc.Name, at.Alertname)
				require.NotEmpty(t, e.ExpAnnotations["summary"], "%s: %s expected summary", tc.Name, at.Alertname)
				require.NotEmpty(t, e.ExpAnnotations["description"], "%s: %s expected description", tc.Name, at.Alertname)
			}
		}
	}
	for _, a := range sortedKeys(alerts) {
		require.True(t, fires[a], "no test case where %s fires", a)
		require.True(t, quiet[a], "no test case where %s stays quiet", a)
	}

	out := runPromtool(t, "prometheus", "test", "rules", "alerts_test.yaml")
	require.Contains(t, out, "SUCCESS")
	require.NotContains(t, out, "FAILED")
}

type promConfig struct {
	RuleFiles     []string `yaml:"rule_files"`
	ScrapeConfigs []struct {
		JobName       string `yaml:"job_name"`
		StaticConfigs []struct {
			Targets []string `yaml:"targets"`
		} `yaml:"static_configs"`
	} `yaml:"scrape_configs"`
}

func loadPromConfig(t *testing.T) (promConfig, map[string][]string) {
	t.Helper()
	var c promConfig
	readYAML(t, "prometheus/prometheus.yml", &c, false)
	targets := map[string][]string{}
	for _, sc := range c.ScrapeConfigs {
		for _, st := range sc.StaticConfigs {
			targets[sc.JobName] = append(targets[sc.JobName], st.Targets...)
		}
	}
	return c, targets
}

var jobMatcherRe = regexp.MustCompile(`job\s*=\s*"([^"]+)"`)

// TestPrometheusConfig checks the compose Prometheus loads the rules and
// scrapes the jobs the rules select on.
func TestPrometheusConfig(t *testing.T) {
	t.Parallel()
	c, targets := loadPromConfig(t)
	require.Contains(t, c.RuleFiles, "alerts.yaml")
	for _, r := range loadAlerts(t) {
		for _, m := range jobMatcherRe.FindAllStringSubmatch(r.Expr, -1) {
			require.NotEmpty(t, targets[m[1]], "%s selects job %q, which prometheus.yml does not scrape", r.Alert, m[1])
		}
	}
	require.NotEmpty(t, targets["epitaph-capture"])
	require.GreaterOrEqual(t, len(targets["epitaph-projector"]), 2)
	out := runPromtool(t, "prometheus", "check", "config", "prometheus.yml")
	require.Contains(t, out, "is valid prometheus config file syntax")
}

// TestReadmeDocumentsEveryAlert: the operations section explains each alert.
func TestReadmeDocumentsEveryAlert(t *testing.T) {
	t.Parallel()
	readme, err := os.ReadFile("README.md")
	require.NoError(t, err)
	for _, r := range loadAlerts(t) {
		require.Contains(t, string(readme), "**"+r.Alert+"**", "README explains %s", r.Alert)
	}
}
