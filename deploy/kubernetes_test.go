package deploy_test

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// k8sObject is one manifest document, with typed access to what the checks
// read.
type k8sObject struct {
	file string
	doc  map[string]any
}

func (o k8sObject) kind() string { return str(o.doc["kind"]) }
func (o k8sObject) name() string { return str(dig(o.doc, "metadata", "name")) }
func (o k8sObject) String() string {
	return o.file + ": " + o.kind() + "/" + o.name()
}

func dig(v any, path ...string) any {
	for _, p := range path {
		m, ok := v.(map[string]any)
		if !ok {
			return nil
		}
		v = m[p]
	}
	return v
}

func str(v any) string {
	s, _ := v.(string)
	return s
}

func list(v any) []any {
	l, _ := v.([]any)
	return l
}

func strMap(v any) map[string]string {
	out := map[string]string{}
	m, _ := v.(map[string]any)
	for k, val := range m {
		out[k] = str(val)
	}
	return out
}

// selects reports whether a selector's labels are all among labels.
func selects(selector, labels map[string]string) bool {
	if len(selector) == 0 {
		return false
	}
	for k, v := range selector {
		if labels[k] != v {
			return false
		}
	}
	return true
}

type kustomization struct {
	APIVersion string           `yaml:"apiVersion"`
	Kind       string           `yaml:"kind"`
	Namespace  string           `yaml:"namespace"`
	Resources  []string         `yaml:"resources"`
	Images     []kustomizeImage `yaml:"images"`
}

type kustomizeImage struct {
	Name   string `yaml:"name"`
	NewTag string `yaml:"newTag"`
}

func loadKubernetes(t *testing.T) (kustomization, []k8sObject) {
	t.Helper()
	var k kustomization
	readYAML(t, "kubernetes/kustomization.yaml", &k, true)
	files, err := filepath.Glob("kubernetes/*.yaml")
	require.NoError(t, err)
	var objs []k8sObject
	for _, f := range files {
		base := filepath.Base(f)
		if base == "kustomization.yaml" {
			continue
		}
		require.Contains(t, k.Resources, base, "%s is not listed in kustomization.yaml", base)
		for _, doc := range readYAMLDocs(t, f) {
			objs = append(objs, k8sObject{file: base, doc: doc})
		}
	}
	for _, r := range k.Resources {
		require.FileExists(t, filepath.Join("kubernetes", r))
	}
	return k, objs
}

var k8sAPIVersions = map[string]string{
	"Namespace":           "v1",
	"ConfigMap":           "v1",
	"Service":             "v1",
	"Deployment":          "apps/v1",
	"PodDisruptionBudget": "policy/v1",
	"NetworkPolicy":       "networking.k8s.io/v1",
	"ServiceMonitor":      "monitoring.coreos.com/v1",
	"PrometheusRule":      "monitoring.coreos.com/v1",
}

func byKind(objs []k8sObject, kind string) []k8sObject {
	var out []k8sObject
	for _, o := range objs {
		if o.kind() == kind {
			out = append(out, o)
		}
	}
	return out
}

func byName(t *testing.T, objs []k8sObject, kind, name string) k8sObject {
	t.Helper()
	for _, o := range byKind(objs, kind) {
		if o.name() == name {
			return o
		}
	}
	t.Fatalf("no %s/%s in deploy/kubernetes", kind, name)
	return k8sObject{}
}

func containers(o k8sObject) []map[string]any {
	var out []map[string]any
	for _, key := range []string{"initContainers", "containers"} {
		for _, c := range list(dig(o.doc, "spec", "template", "spec", key)) {
			out = append(out, c.(map[string]any))
		}
	}
	return out
}

func containerEnv(c map[string]any) map[string]map[string]any {
	env := map[string]map[string]any{}
	for _, e := range list(c["env"]) {
		m := e.(map[string]any)
		env[str(m["name"])] = m
	}
	return env
}

// TestKubernetesManifests checks the manifests hang together: kinds and API
// versions, selectors that select, ports and probes that point at declared
// container ports, images and commands the Dockerfile provides, no secret
// inline, and the capture's standby and the projector's worker identity.
func TestKubernetesManifests(t *testing.T) {
	t.Parallel()
	k, objs := loadKubernetes(t)
	require.Equal(t, "epitaph", k.Namespace)
	binaries := dockerfileBinaries(t)
	configMaps := checkObjects(t, objs)

	// ConfigMap key -> binaries that get it through envFrom.
	configReaders := map[string][]string{}
	deployments := byKind(objs, "Deployment")
	require.Len(t, deployments, 2)
	podLabels := map[string]map[string]string{}
	containerPorts := map[string]map[string]int{}
	for _, d := range deployments {
		podLabels[d.name()], containerPorts[d.name()] = checkDeployment(t, k, d, binaries, configMaps, configReaders)
	}

	// Every shared setting is read by at least one program that gets it.
	for _, cm := range configMaps {
		for key := range cm {
			readers := configReaders[key]
			require.NotEmpty(t, readers, "config key %s reaches no container", key)
			read := slices.ContainsFunc(readers, func(b string) bool { return binaryEnv(t, b)[key] })
			require.True(t, read, "config key %s is read by none of %v", key, readers)
		}
	}

	checkCaptureAndProjector(t, objs)
	services := checkServices(t, objs, podLabels, containerPorts)

	for _, pdb := range byKind(objs, "PodDisruptionBudget") {
		sel := strMap(dig(pdb.doc, "spec", "selector", "matchLabels"))
		found := false
		for _, labels := range podLabels {
			found = found || selects(sel, labels)
		}
		require.True(t, found, "%s selects no pods", pdb)
	}
	checkServiceMonitor(t, objs, services)
}

// checkObjects checks what every object must have and returns the
// ConfigMaps' data by name.
func checkObjects(t *testing.T, objs []k8sObject) map[string]map[string]string {
	t.Helper()
	configMaps := map[string]map[string]string{}
	for _, o := range objs {
		want, ok := k8sAPIVersions[o.kind()]
		require.True(t, ok, "%s: unexpected kind", o)
		require.Equal(t, want, o.doc["apiVersion"], "%s", o)
		require.NotEmpty(t, o.name(), "%s: metadata.name", o)
		if o.kind() != "Namespace" {
			require.Nil(t, dig(o.doc, "metadata", "namespace"), "%s: the namespace comes from kustomization.yaml", o)
		}
		require.Equal(t, "epitaph", strMap(dig(o.doc, "metadata", "labels"))["app.kubernetes.io/part-of"], "%s: part-of label", o)
		if o.kind() == "ConfigMap" {
			configMaps[o.name()] = strMap(o.doc["data"])
		}
	}
	for _, cm := range configMaps {
		for key, value := range cm {
			require.True(t, strings.HasPrefix(key, "EPITAPH_"), "config key %s", key)
			require.NotContains(t, value, "@", "%s: credentials belong in the Secret", key)
		}
	}
	return configMaps
}

// checkDeployment checks a Deployment and its containers, adds the config
// keys its containers get to configReaders, and returns its pods' labels
// and its containers' ports by name.
func checkDeployment(t *testing.T, k kustomization, d k8sObject, binaries []string, configMaps map[string]map[string]string,
	configReaders map[string][]string) (map[string]string, map[string]int) {
	t.Helper()
	sel := strMap(dig(d.doc, "spec", "selector", "matchLabels"))
	labels := strMap(dig(d.doc, "spec", "template", "metadata", "labels"))
	require.True(t, selects(sel, labels), "%s: selector does not select its own pods", d)
	require.Equal(t, true, dig(d.doc, "spec", "template", "spec", "securityContext", "runAsNonRoot"), "%s", d)

	volumes := map[string]bool{}
	for _, v := range list(dig(d.doc, "spec", "template", "spec", "volumes")) {
		volumes[str(dig(v, "name"))] = false
	}
	ports := map[string]int{}
	for _, c := range containers(d) {
		for _, m := range list(c["volumeMounts"]) {
			name := str(dig(m, "name"))
			_, ok := volumes[name]
			require.True(t, ok, "%s: mount of undeclared volume %s", d, name)
			volumes[name] = true
		}
		cmd := checkContainer(t, k, d, c, binaries)
		for _, p := range list(c["ports"]) {
			pm := p.(map[string]any)
			ports[str(pm["name"])] = pm["containerPort"].(int)
		}
		for _, ef := range list(c["envFrom"]) {
			ref := str(dig(ef, "configMapRef", "name"))
			require.Contains(t, configMaps, ref, "%s: envFrom an unknown ConfigMap", d)
			for key := range configMaps[ref] {
				configReaders[key] = append(configReaders[key], cmd)
			}
		}
		if str(c["name"]) != "migrate" {
			checkProbes(t, d, c, ports)
		}
	}
	for v, used := range volumes {
		require.True(t, used, "%s: volume %s is not mounted", d, v)
	}
	return labels, ports
}

// checkContainer checks a container's image, command, privileges and
// environment, and returns the binary it runs.
func checkContainer(t *testing.T, k kustomization, d k8sObject, c map[string]any, binaries []string) string {
	t.Helper()
	image := str(c["image"])
	require.True(t, slices.ContainsFunc(k.Images, func(i kustomizeImage) bool {
		return strings.HasPrefix(image, i.Name+":")
	}), "%s: image %s is not set by kustomization images", d, image)
	cmd := list(c["command"])
	require.NotEmpty(t, cmd, "%s: command", d)
	require.Contains(t, binaries, str(cmd[0]), "%s: runs a binary the image lacks", d)
	require.Equal(t, false, dig(c, "securityContext", "allowPrivilegeEscalation"), "%s", d)
	for name, e := range containerEnv(c) {
		requireReadsEnv(t, str(cmd[0]), name, d.String())
		// URLs that may hold credentials come from the Secret; the NATS URL
		// and the capture's status URL (an in-cluster HTTP address) do not.
		if strings.HasSuffix(name, "_URL") && name != "EPITAPH_NATS_URL" && name != "EPITAPH_CAPTURE_STATUS_URL" {
			require.Nil(t, e["value"], "%s: %s must come from a Secret, not inline", d, name)
			require.Equal(t, "epitaph-db", str(dig(e, "valueFrom", "secretKeyRef", "name")), "%s: %s", d, name)
		}
		require.NotContains(t, str(e["value"]), "@", "%s: %s looks like a credential", d, name)
	}
	return str(cmd[0])
}

// checkProbes: the metrics port is where the process listens, and the
// probes use it.
func checkProbes(t *testing.T, d k8sObject, c map[string]any, ports map[string]int) {
	t.Helper()
	addr := str(dig(containerEnv(c)["EPITAPH_METRICS_ADDR"], "value"))
	_, port, err := net.SplitHostPort(addr)
	require.NoError(t, err, "%s: EPITAPH_METRICS_ADDR", d)
	require.Equal(t, port, strconv.Itoa(ports["metrics"]), "%s: the metrics port is where the process listens", d)
	// Liveness never depends on the database or NATS (an outage must
	// not get pods killed); readiness does.
	for probe, path := range map[string]string{"startupProbe": "/livez", "livenessProbe": "/livez", "readinessProbe": "/readyz"} {
		require.Equal(t, path, str(dig(c, probe, "httpGet", "path")), "%s: %s", d, probe)
		require.Equal(t, "metrics", str(dig(c, probe, "httpGet", "port")), "%s: %s port", d, probe)
	}
}

func checkCaptureAndProjector(t *testing.T, objs []k8sObject) {
	t.Helper()
	capture := byName(t, objs, "Deployment", "epitaph-capture")
	require.Equal(t, 2, dig(capture.doc, "spec", "replicas"), "one active capture and one standby")
	require.Equal(t, 0, dig(capture.doc, "spec", "strategy", "rollingUpdate", "maxSurge"), "never a third capture during a rollout")
	cc := containers(capture)
	require.Len(t, cc, 1)
	require.Equal(t, "true", str(dig(containerEnv(cc[0])["EPITAPH_STANDBY"], "value")))
	require.Equal(t, "source-url", str(dig(containerEnv(cc[0])["EPITAPH_SOURCE_URL"], "valueFrom", "secretKeyRef", "key")))

	projector := byName(t, objs, "Deployment", "epitaph-projector")
	var sawMigrate, sawRun bool
	for _, c := range containers(projector) {
		cmd := list(c["command"])
		switch {
		case len(cmd) == 2 && cmd[1] == "migrate":
			sawMigrate = true
		case len(cmd) == 2 && cmd[1] == "run":
			sawRun = true
			require.Equal(t, "metadata.name", str(dig(containerEnv(c)["EPITAPH_WORKER_ID"], "valueFrom", "fieldRef", "fieldPath")),
				"each pod is its own worker")
			require.Equal(t, "target-url", str(dig(containerEnv(c)["EPITAPH_TARGET_URL"], "valueFrom", "secretKeyRef", "key")))
		}
	}
	require.True(t, sawMigrate, "projector pods migrate the target first")
	require.True(t, sawRun)
}

// checkServices: Services select pods and name their ports; the Service
// names are the job names the alert rules use.
func checkServices(t *testing.T, objs []k8sObject, podLabels map[string]map[string]string, containerPorts map[string]map[string]int) []k8sObject {
	t.Helper()
	services := byKind(objs, "Service")
	serviceNames := map[string]bool{}
	for _, s := range services {
		serviceNames[s.name()] = true
		sel := strMap(dig(s.doc, "spec", "selector"))
		var target string
		for name, labels := range podLabels {
			if selects(sel, labels) {
				target = name
			}
		}
		require.NotEmpty(t, target, "%s selects no Deployment's pods", s)
		for _, p := range list(dig(s.doc, "spec", "ports")) {
			tp := str(dig(p, "targetPort"))
			require.Contains(t, containerPorts[target], tp, "%s: targetPort %s is not a container port of %s", s, tp, target)
		}
	}
	require.True(t, serviceNames["epitaph-capture"] && serviceNames["epitaph-projector"], "Service names are the alert rules' job names")
	require.Equal(t, true, dig(byName(t, objs, "Service", "epitaph-capture").doc, "spec", "publishNotReadyAddresses"),
		"the standby capture is scraped even when not ready")
	return services
}

// checkServiceMonitor: the ServiceMonitor scrapes both Services on a port
// they declare.
func checkServiceMonitor(t *testing.T, objs, services []k8sObject) {
	t.Helper()
	monitors := byKind(objs, "ServiceMonitor")
	require.Len(t, monitors, 1)
	sel := strMap(dig(monitors[0].doc, "spec", "selector", "matchLabels"))
	selected := 0
	for _, s := range services {
		if !selects(sel, strMap(dig(s.doc, "metadata", "labels"))) {
			continue
		}
		selected++
		var names []string
		for _, p := range list(dig(s.doc, "spec", "ports")) {
			names = append(names, str(dig(p, "name")))
		}
		for _, ep := range list(dig(monitors[0].doc, "spec", "endpoints")) {
			require.Contains(t, names, str(dig(ep, "port")), "ServiceMonitor endpoint port on %s", s)
			require.Equal(t, "/metrics", str(dig(ep, "path")))
		}
	}
	require.Equal(t, len(services), selected, "the ServiceMonitor scrapes every Service")
}

// TestPrometheusRuleMatchesAlerts keeps the Prometheus Operator's copy of the
// rules identical to deploy/prometheus/alerts.yaml (which promtool tests).
func TestPrometheusRuleMatchesAlerts(t *testing.T) {
	t.Parallel()
	_, objs := loadKubernetes(t)
	rules := byKind(objs, "PrometheusRule")
	require.Len(t, rules, 1)
	alerts := readYAMLDocs(t, "prometheus/alerts.yaml")
	require.Len(t, alerts, 1)
	require.Equal(t, alerts[0]["groups"], dig(rules[0].doc, "spec", "groups"),
		"kubernetes/prometheusrule.yaml differs from prometheus/alerts.yaml: copy the groups over")
}

// TestSecretIsDocumented: the manifests reference a Secret they do not
// contain; the operator must be told how to make it, with the right keys.
func TestSecretIsDocumented(t *testing.T) {
	t.Parallel()
	_, objs := loadKubernetes(t)
	keys := map[string]bool{}
	for _, d := range byKind(objs, "Deployment") {
		for _, c := range containers(d) {
			for _, e := range containerEnv(c) {
				if ref := dig(e, "valueFrom", "secretKeyRef"); ref != nil {
					require.Equal(t, "epitaph-db", str(dig(ref, "name")))
					keys[str(dig(ref, "key"))] = true
				}
			}
		}
	}
	require.NotEmpty(t, keys)
	readme, err := os.ReadFile("README.md")
	require.NoError(t, err)
	for key := range keys {
		require.Contains(t, string(readme), "--from-literal="+key+"=", "README tells how to create the Secret key %s", key)
	}
	require.Contains(t, string(readme), "create secret generic epitaph-db")
}

// TestKubernetesNATSRolesAndNetworkPolicy: each workload authenticates as
// its NATS role with a password mounted as a file from the Secret
// epitaph-nats (its own key only, read-only), and a NetworkPolicy selects
// every Epitaph pod, admitting only the metrics ports.
func TestKubernetesNATSRolesAndNetworkPolicy(t *testing.T) {
	t.Parallel()
	_, objs := loadKubernetes(t)
	roles := map[string]string{"epitaph-capture": "capture", "epitaph-projector": "projector"}
	for _, d := range byKind(objs, "Deployment") {
		role, ok := roles[d.name()]
		require.True(t, ok, "%s: which NATS role?", d)
		var mounted string
		for _, v := range list(dig(d.doc, "spec", "template", "spec", "volumes")) {
			if str(dig(v, "secret", "secretName")) == "epitaph-nats" {
				items := list(dig(v, "secret", "items"))
				require.Len(t, items, 1, "%s mounts its own password only", d)
				require.Equal(t, role+"-password", str(dig(items[0], "key")), "%s", d)
				mounted = str(dig(v, "name"))
			}
		}
		require.NotEmpty(t, mounted, "%s mounts the Secret epitaph-nats", d)
		for _, c := range list(dig(d.doc, "spec", "template", "spec", "containers")) {
			cm := c.(map[string]any)
			env := containerEnv(cm)
			require.Equal(t, role, str(dig(env["EPITAPH_NATS_USER"], "value")), "%s: NATS user", d)
			file := str(dig(env["EPITAPH_NATS_PASSWORD_FILE"], "value"))
			var dir string
			for _, m := range list(cm["volumeMounts"]) {
				if str(dig(m, "name")) == mounted {
					dir = str(dig(m, "mountPath"))
					require.Equal(t, true, dig(m, "readOnly"), "%s: read-only mount", d)
				}
			}
			require.Equal(t, dir+"/password", file, "%s: the password file is the mounted one", d)
		}
	}

	policies := byKind(objs, "NetworkPolicy")
	require.Len(t, policies, 1)
	p := policies[0]
	sel := map[string]string{}
	for k, v := range dig(p.doc, "spec", "podSelector", "matchLabels").(map[string]any) {
		sel[k] = str(v)
	}
	for _, d := range byKind(objs, "Deployment") {
		labels := map[string]string{}
		for k, v := range dig(d.doc, "spec", "template", "metadata", "labels").(map[string]any) {
			labels[k] = str(v)
		}
		require.True(t, selects(sel, labels), "the NetworkPolicy does not cover %s", d)
	}
	require.ElementsMatch(t, []any{"Ingress", "Egress"}, list(dig(p.doc, "spec", "policyTypes")))
	var ports []string
	for _, rule := range list(dig(p.doc, "spec", "ingress")) {
		for _, port := range list(dig(rule, "ports")) {
			ports = append(ports, fmt.Sprint(dig(port, "port")))
		}
	}
	require.ElementsMatch(t, []string{"9187", "9188"}, ports, "only the metrics ports are reachable")

	readme, err := os.ReadFile("README.md")
	require.NoError(t, err)
	require.Contains(t, string(readme), "create secret generic epitaph-nats")
	for _, key := range []string{"capture-password", "projector-password"} {
		require.Contains(t, string(readme), "--from-file="+key+"=", "README tells how to create the Secret key %s", key)
	}
}

// TestCaptureReplicasShareOneSigningKey: both capture replicas sign with
// the key of the Secret epitaph-signing-key, mounted read-only with a mode
// the capture accepts (root-owned, group read only), and the README tells
// how to make it. A key generated per pod would differ after a failover.
func TestCaptureReplicasShareOneSigningKey(t *testing.T) {
	t.Parallel()
	_, objs := loadKubernetes(t)
	var found bool
	for _, d := range byKind(objs, "Deployment") {
		if d.name() != "epitaph-capture" {
			continue
		}
		found = true
		var vol string
		for _, v := range list(dig(d.doc, "spec", "template", "spec", "volumes")) {
			if str(dig(v, "secret", "secretName")) == "epitaph-signing-key" {
				vol = str(dig(v, "name"))
				require.EqualValues(t, 0o440, dig(v, "secret", "defaultMode"), "group-readable for fsGroup, nothing for others")
				items := list(dig(v, "secret", "items"))
				require.Len(t, items, 1)
				require.Equal(t, "signing.key", str(dig(items[0], "key")))
			}
		}
		require.NotEmpty(t, vol, "the capture mounts the Secret epitaph-signing-key")
		for _, c := range list(dig(d.doc, "spec", "template", "spec", "containers")) {
			cm := c.(map[string]any)
			var dir string
			for _, m := range list(cm["volumeMounts"]) {
				if str(dig(m, "name")) == vol {
					dir = str(dig(m, "mountPath"))
					require.Equal(t, true, dig(m, "readOnly"))
				}
			}
			require.Equal(t, dir+"/signing.key", str(dig(containerEnv(cm)["EPITAPH_SIGNING_KEY"], "value")))
		}
	}
	require.True(t, found)
	readme, err := os.ReadFile("README.md")
	require.NoError(t, err)
	require.Contains(t, string(readme), "create secret generic epitaph-signing-key --from-file=signing.key=")
}

// TestKubernetesCaptureIsTheClusterTestsCapture: the manifests' capture runs
// against a replicated stream as the compose cluster and
// e2e/TestClusterLosesNodesUnderLoad run it: three replicas, confirmations
// not trailing the quorum's acknowledgements.
func TestKubernetesCaptureIsTheClusterTestsCapture(t *testing.T) {
	t.Parallel()
	_, objs := loadKubernetes(t)
	data := strMap(byName(t, objs, "ConfigMap", "epitaph-config").doc["data"])
	require.Equal(t, "3", data["EPITAPH_REPLICAS"])
	require.Equal(t, "-1s", data["EPITAPH_BROKER_SYNC_INTERVAL"])
	compose := loadCompose(t).Services["capture"].Environment
	require.Equal(t, compose["EPITAPH_BROKER_SYNC_INTERVAL"], data["EPITAPH_BROKER_SYNC_INTERVAL"])
}
