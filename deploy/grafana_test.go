package deploy_test

import (
	"encoding/json"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"gopkg.in/yaml.v3"
)

type dashboard struct {
	UID           string `json:"uid"`
	Title         string `json:"title"`
	SchemaVersion int    `json:"schemaVersion"`
	Templating    struct {
		List []struct {
			Name       string `json:"name"`
			Type       string `json:"type"`
			Query      any    `json:"query"`
			Definition string `json:"definition"`
			Current    struct {
				Value any `json:"value"`
			} `json:"current"`
		} `json:"list"`
	} `json:"templating"`
	Panels []dashboardPanel `json:"panels"`
}

type dashboardPanel struct {
	ID          int    `json:"id"`
	Type        string `json:"type"`
	Title       string `json:"title"`
	Description string `json:"description"`
	GridPos     struct {
		H, W, X, Y int
	} `json:"gridPos"`
	Datasource *struct {
		Type string `json:"type"`
		UID  string `json:"uid"`
	} `json:"datasource"`
	Targets []struct {
		Expr       string `json:"expr"`
		RefID      string `json:"refId"`
		Datasource *struct {
			UID string `json:"uid"`
		} `json:"datasource"`
	} `json:"targets"`
	Panels []dashboardPanel `json:"panels"`
}

func loadDashboard(t *testing.T) dashboard {
	t.Helper()
	data, err := os.ReadFile("grafana/epitaph.json")
	require.NoError(t, err)
	var d dashboard
	require.NoError(t, json.Unmarshal(data, &d))
	return d
}

// grafanaVarRe matches the dashboard variables Grafana substitutes in a
// query: $name, ${name} and ${name:format}.
var grafanaVarRe = regexp.MustCompile(`\$\{?(__[a-z_]+|[a-zA-Z_][a-zA-Z0-9_]*)(:[a-z]+)?\}?`)

// concreteQuery substitutes dashboard variables the way Grafana would for
// "All", so the query can be checked as plain PromQL.
func concreteQuery(t *testing.T, expr string) string {
	t.Helper()
	return grafanaVarRe.ReplaceAllStringFunc(expr, func(v string) string {
		name := grafanaVarRe.FindStringSubmatch(v)[1]
		switch name {
		case "__rate_interval", "__interval":
			return "1m"
		case "__range":
			return "1h"
		case "projection", "version":
			return ".*"
		}
		t.Fatalf("query uses unknown variable %s: %s", v, expr)
		return ""
	})
}

func allPanels(ps []dashboardPanel) []dashboardPanel {
	var out []dashboardPanel
	for _, p := range ps {
		out = append(out, p)
		out = append(out, allPanels(p.Panels)...)
	}
	return out
}

// TestDashboard checks the Grafana dashboard: layout, data source, that every
// query is valid PromQL (promtool parses them as recording rules) over
// exported metrics only, and that every exported metric is on it.
func TestDashboard(t *testing.T) {
	t.Parallel()
	d := loadDashboard(t)
	require.Equal(t, "epitaph", d.UID)
	require.NotEmpty(t, d.Title)
	require.GreaterOrEqual(t, d.SchemaVersion, 36)

	vars := map[string]bool{}
	for _, v := range d.Templating.List {
		vars[v.Name] = true
		if v.Type == "query" {
			// label_values(metric{...}, label): metric and label exist.
			m := regexp.MustCompile(`^label_values\((.+),\s*(\w+)\)$`).FindStringSubmatch(v.Definition)
			require.NotNil(t, m, "variable %s: %s", v.Name, v.Definition)
			sel := concreteQuery(t, m[1])
			require.Empty(t, checkPromQL(sel), "variable %s", v.Name)
			labels, ok := metricLabels(seriesNameRe.FindString(sel))
			require.True(t, ok, "variable %s: %s", v.Name, sel)
			require.Contains(t, labels, m[2], "variable %s: label", v.Name)
		}
	}
	require.True(t, vars["datasource"], "a datasource variable, so the dashboard imports anywhere")

	type rule struct {
		Record string `yaml:"record"`
		Expr   string `yaml:"expr"`
	}
	var rules []rule
	used := map[string]bool{}
	ids := map[int]string{}
	titles := map[string]bool{}
	var boxes []dashboardPanel
	for _, p := range allPanels(d.Panels) {
		require.NotContains(t, ids, p.ID, "panel id %d used by %q and %q", p.ID, ids[p.ID], p.Title)
		ids[p.ID] = p.Title
		require.NotEmpty(t, p.Title)
		require.LessOrEqual(t, p.GridPos.X+p.GridPos.W, 24, "%s: wider than the grid", p.Title)
		require.Positive(t, p.GridPos.W, p.Title)
		require.Positive(t, p.GridPos.H, p.Title)
		for _, b := range boxes {
			overlap := p.GridPos.X < b.GridPos.X+b.GridPos.W && b.GridPos.X < p.GridPos.X+p.GridPos.W &&
				p.GridPos.Y < b.GridPos.Y+b.GridPos.H && b.GridPos.Y < p.GridPos.Y+p.GridPos.H
			require.False(t, overlap, "panels %q and %q overlap", p.Title, b.Title)
		}
		boxes = append(boxes, p)
		if p.Type == "row" {
			continue
		}
		require.False(t, titles[p.Title], "two panels titled %q", p.Title)
		titles[p.Title] = true
		require.NotEmpty(t, p.Description, "%s: say what the panel shows", p.Title)
		require.NotNil(t, p.Datasource, p.Title)
		require.Equal(t, "${datasource}", p.Datasource.UID, "%s: data source", p.Title)
		require.NotEmpty(t, p.Targets, "%s: no queries", p.Title)
		for _, tg := range p.Targets {
			require.NotEmpty(t, tg.Expr, "%s %s", p.Title, tg.RefID)
			if tg.Datasource != nil {
				require.Equal(t, "${datasource}", tg.Datasource.UID, "%s %s", p.Title, tg.RefID)
			}
			expr := concreteQuery(t, tg.Expr)
			require.Empty(t, checkPromQL(expr), "%s: %s", p.Title, tg.Expr)
			for _, name := range epitaphMetricRe.FindAllString(expr, -1) {
				used[name] = true
			}
			rules = append(rules, rule{Record: fmt.Sprintf("dashboard:panel_%d:%s", p.ID, strings.ToLower(tg.RefID)), Expr: expr})
		}
	}
	for _, m := range exportedMetrics {
		require.True(t, used[m.name], "metric %s is not on the dashboard", m.name)
	}

	// promtool parses each query as a recording rule: a PromQL syntax error
	// in a panel fails here.
	doc := map[string]any{"groups": []any{map[string]any{"name": "dashboard", "rules": rules}}}
	out, err := yaml.Marshal(doc)
	require.NoError(t, err)
	dir := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(dir, "dashboard_rules.yaml"), out, 0o600))
	res := runPromtool(t, dir, "check", "rules", "dashboard_rules.yaml")
	require.Contains(t, res, fmt.Sprintf("SUCCESS: %d rules found", len(rules)))
}

// TestGrafanaProvisioning checks the compose Grafana finds the data source the
// dashboard defaults to, and loads the dashboard from where compose mounts it.
func TestGrafanaProvisioning(t *testing.T) {
	t.Parallel()
	var ds struct {
		APIVersion  int `yaml:"apiVersion"`
		Datasources []struct {
			Name      string         `yaml:"name"`
			Type      string         `yaml:"type"`
			UID       string         `yaml:"uid"`
			Access    string         `yaml:"access"`
			URL       string         `yaml:"url"`
			IsDefault bool           `yaml:"isDefault"`
			JSONData  map[string]any `yaml:"jsonData"`
		} `yaml:"datasources"`
	}
	readYAML(t, "grafana/provisioning/datasources/prometheus.yaml", &ds, true)
	require.Equal(t, 1, ds.APIVersion)
	require.Len(t, ds.Datasources, 1)
	require.Equal(t, "prometheus", ds.Datasources[0].Type)
	require.Equal(t, "http://prometheus:9090", ds.Datasources[0].URL, "the compose service")

	d := loadDashboard(t)
	for _, v := range d.Templating.List {
		if v.Name == "datasource" {
			require.Equal(t, "prometheus", v.Query)
			require.Equal(t, ds.Datasources[0].UID, v.Current.Value, "the dashboard defaults to the provisioned data source")
		}
	}

	var prov struct {
		APIVersion int `yaml:"apiVersion"`
		Providers  []struct {
			Name            string `yaml:"name"`
			Folder          string `yaml:"folder"`
			Type            string `yaml:"type"`
			DisableDeletion bool   `yaml:"disableDeletion"`
			AllowUIUpdates  bool   `yaml:"allowUiUpdates"`
			Options         struct {
				Path                      string `yaml:"path"`
				FoldersFromFilesStructure bool   `yaml:"foldersFromFilesStructure"`
			} `yaml:"options"`
		} `yaml:"providers"`
	}
	readYAML(t, "grafana/provisioning/dashboards/epitaph.yaml", &prov, true)
	require.Len(t, prov.Providers, 1)
	require.Equal(t, "file", prov.Providers[0].Type)

	c := loadCompose(t)
	g := c.Services["grafana"]
	require.Contains(t, g.Volumes, "./grafana/provisioning:/etc/grafana/provisioning:ro")
	mounted := ""
	for _, v := range g.Volumes {
		if strings.HasPrefix(v, "./grafana/epitaph.json:") {
			mounted = strings.Split(v, ":")[1]
		}
	}
	require.NotEmpty(t, mounted, "compose mounts the dashboard into grafana")
	require.Equal(t, prov.Providers[0].Options.Path, path.Dir(mounted), "the provider reads the directory the dashboard is mounted in")
	require.Equal(t, mounted, g.Environment["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
}
