package projection_test

import (
	"os/exec"
	"strings"
	"testing"
)

// layers is the import order of the projector's packages: a package may
// import those of a lower layer only, never one of its own layer or above.
// The read model (archive) and the snapshot hooks are at the bottom, the
// version registry above them, the jobs the runtime runs (status,
// erasure, retention, trust) above that, and the runtime on top. A new
// package under projection/ must be given its layer here.
var layers = map[string]int{
	"projection/archive":   0,
	"projection/snapshot":  0,
	"projection/version":   1,
	"projection/status":    2,
	"projection/erasure":   2,
	"projection/retention": 2,
	"projection/trust":     2,
	"projection":           3,
}

const module = "github.com/epitaph-dev/epitaph/"

// TestImportDirection lists every package under projection/ with its
// imports (go list, non-test files) and fails on an import that points
// sideways or up the layers, or on a package that has no layer.
func TestImportDirection(t *testing.T) {
	out, err := exec.Command("go", "list", "-f", `{{.ImportPath}}{{range .Imports}} {{.}}{{end}}`, module+"projection/...").Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	seen := map[string]bool{}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		f := strings.Fields(line)
		pkg := strings.TrimPrefix(f[0], module)
		if strings.HasPrefix(pkg, "projection/internal/") {
			continue // test support, checked below to be imported by no package
		}
		layer, ok := layers[pkg]
		if !ok {
			t.Errorf("package %s has no layer in layers: give it one", pkg)
			continue
		}
		seen[pkg] = true
		for _, imp := range f[1:] {
			dep, ok := strings.CutPrefix(imp, module)
			if !ok || (dep != "projection" && !strings.HasPrefix(dep, "projection/")) {
				continue
			}
			if strings.HasPrefix(dep, "projection/internal/") {
				t.Errorf("%s imports test support %s", pkg, dep)
				continue
			}
			if l, ok := layers[dep]; !ok || l >= layer {
				t.Errorf("%s (layer %d) imports %s (layer %d): imports must point down the layers", pkg, layer, dep, l)
			}
		}
	}
	for _, pkg := range []string{"projection", "projection/archive", "projection/version", "projection/status", "projection/snapshot"} {
		if !seen[pkg] {
			t.Errorf("go list did not report %s", pkg)
		}
	}
}

// TestReadersImportNoRuntime fails when a reader of the archive (the read
// API, the status page) or the version package imports the runtime: they
// need its read models and registry, not its workers.
func TestReadersImportNoRuntime(t *testing.T) {
	for _, pkg := range []string{"internal/readapi", "internal/statuspage", "projection/version", "projection/status", "projection/archive"} {
		out, err := exec.Command("go", "list", "-deps", module+pkg).Output()
		if err != nil {
			t.Fatalf("go list -deps %s: %v", pkg, err)
		}
		for _, dep := range strings.Fields(string(out)) {
			if dep == module+"projection" {
				t.Errorf("%s depends on the runtime (package projection)", pkg)
			}
		}
	}
}
