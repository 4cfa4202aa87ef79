// Command sbom writes a CycloneDX 1.5 JSON software bill of materials of Go
// binaries, from the module information the Go toolchain embeds in every
// binary (what `go version -m` prints): the main module, every module
// linked in, with its version, its go.sum hash and a package URL, and the
// Go toolchain. `make dist` writes one per release archive.
//
//	go run ./internal/sbom -name epitaph -version v1.2.0 bin/capture bin/projector > sbom.cdx.json
//
// With -notices FILE it also writes the licence texts of those modules and
// of the Go toolchain, read from the module cache (`go mod download`) and
// GOROOT, for the archive to carry beside the binaries: every licence of
// what is linked in, or an error naming the module without one.
//
// No syft or goreleaser: the build information is exactly what was linked,
// it needs nothing beyond the standard library, and it is read the same
// from a binary of any GOOS/GOARCH.
package main

import (
	"bytes"
	"debug/buildinfo"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/debug"
	"sort"
	"strings"
	"time"
)

func main() {
	if err := run(os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "sbom:", err)
		os.Exit(1)
	}
}

func run(args []string, out io.Writer) error {
	fs := flag.NewFlagSet("sbom", flag.ContinueOnError)
	name := fs.String("name", "epitaph", "name of the described software")
	version := fs.String("version", "", "its version (the release tag)")
	stamp := fs.String("time", "", "metadata timestamp, RFC 3339 (default now; a release passes its commit time so the file is reproducible)")
	notices := fs.String("notices", "", "also write the linked modules' and the Go toolchain's licence texts to this file")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() == 0 {
		return errors.New("name at least one Go binary")
	}
	ts := time.Now().UTC()
	if *stamp != "" {
		t, err := time.Parse(time.RFC3339, *stamp)
		if err != nil {
			return fmt.Errorf("-time: %w", err)
		}
		ts = t.UTC()
	}
	var infos []*debug.BuildInfo
	for _, path := range fs.Args() {
		bi, err := buildinfo.ReadFile(path)
		if err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
		infos = append(infos, bi)
	}
	doc := bom(*name, *version, ts, infos)
	if *notices != "" {
		text, err := noticesOf(doc)
		if err != nil {
			return err
		}
		if err := os.WriteFile(*notices, text, 0o644); err != nil {
			return err
		}
	}
	enc := json.NewEncoder(out)
	enc.SetIndent("", "  ")
	return enc.Encode(doc)
}

// noticesOf is the licence texts of doc's libraries (from the module
// cache) and of the Go toolchain whose standard library is linked in.
func noticesOf(doc document) ([]byte, error) {
	var b bytes.Buffer
	b.WriteString("Licences of the third-party software linked into these binaries\n")
	var args []string
	for _, c := range doc.Components {
		if c.Type == "library" {
			args = append(args, c.Name+"@"+c.Version)
		}
	}
	dirs := map[string]string{}
	if len(args) > 0 {
		cmd := exec.Command("go", append([]string{"mod", "download", "-json"}, args...)...)
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil && len(out) == 0 {
			return nil, fmt.Errorf("go mod download: %v: %s", err, strings.TrimSpace(stderr.String()))
		}
		dec := json.NewDecoder(bytes.NewReader(out))
		for {
			var m struct{ Path, Version, Dir, Error string }
			if err := dec.Decode(&m); errors.Is(err, io.EOF) {
				break
			} else if err != nil {
				return nil, fmt.Errorf("go mod download: %w", err)
			}
			if m.Error != "" {
				return nil, fmt.Errorf("%s@%s: %s", m.Path, m.Version, m.Error)
			}
			dirs[m.Path+"@"+m.Version] = m.Dir
		}
	}
	for _, c := range doc.Components {
		var dir, what string
		switch c.Type {
		case "library":
			dir, what = dirs[c.Name+"@"+c.Version], c.Name+" "+c.Version
		case "platform":
			goroot, err := exec.Command("go", "env", "GOROOT").Output()
			if err != nil {
				return nil, fmt.Errorf("go env GOROOT: %w", err)
			}
			dir, what = strings.TrimSpace(string(goroot)), "Go "+c.Version+" (its standard library)"
		default:
			continue
		}
		if dir == "" {
			return nil, fmt.Errorf("%s: not in the module cache", what)
		}
		texts, err := licenceFiles(dir)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", what, err)
		}
		fmt.Fprintf(&b, "\n%s\n%s\n", strings.Repeat("=", 78), what)
		for _, t := range texts {
			fmt.Fprintf(&b, "\n--- %s ---\n\n%s\n", t.name, strings.TrimRight(string(t.text), "\n"))
		}
	}
	return b.Bytes(), nil
}

type licenceText struct {
	name string
	text []byte
}

// licenceFiles reads the licence and notice files at the top of a
// module's directory (LICENSE, LICENCE, COPYING, NOTICE, with any
// suffix), and fails when there is none.
func licenceFiles(dir string) ([]licenceText, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var out []licenceText
	for _, e := range entries {
		up := strings.ToUpper(e.Name())
		if !e.Type().IsRegular() || !(strings.HasPrefix(up, "LICENSE") || strings.HasPrefix(up, "LICENCE") ||
			strings.HasPrefix(up, "COPYING") || strings.HasPrefix(up, "NOTICE")) {
			continue
		}
		text, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			return nil, err
		}
		out = append(out, licenceText{name: e.Name(), text: text})
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("no licence file in %s", dir)
	}
	return out, nil
}

// The CycloneDX 1.5 fields this writes.
type document struct {
	BOMFormat   string      `json:"bomFormat"`
	SpecVersion string      `json:"specVersion"`
	Version     int         `json:"version"`
	Metadata    metadata    `json:"metadata"`
	Components  []component `json:"components"`
}

type metadata struct {
	Timestamp string    `json:"timestamp"`
	Component component `json:"component"`
}

type component struct {
	Type       string     `json:"type"`
	BOMRef     string     `json:"bom-ref,omitempty"`
	Name       string     `json:"name"`
	Version    string     `json:"version,omitempty"`
	PURL       string     `json:"purl,omitempty"`
	Properties []property `json:"properties,omitempty"`
}

type property struct {
	Name  string `json:"name"`
	Value string `json:"value"`
}

// bom is the document of the binaries infos: the modules of all of them,
// each once (a replaced module as its replacement), sorted by path.
func bom(name, version string, ts time.Time, infos []*debug.BuildInfo) document {
	doc := document{BOMFormat: "CycloneDX", SpecVersion: "1.5", Version: 1,
		Metadata: metadata{Timestamp: ts.Format(time.RFC3339),
			Component: component{Type: "application", BOMRef: name, Name: name, Version: version}}}
	seen := map[string]component{}
	for _, bi := range infos {
		if bi.Main.Path != "" {
			doc.Metadata.Component.PURL = purl(bi.Main.Path, version)
		}
		toolchain := component{Type: "platform", Name: "go", Version: bi.GoVersion, PURL: "pkg:golang/std@" + bi.GoVersion}
		toolchain.BOMRef = toolchain.PURL
		seen[toolchain.PURL] = toolchain
		for _, s := range bi.Settings {
			if s.Key == "GOOS" || s.Key == "GOARCH" || s.Key == "CGO_ENABLED" {
				doc.Metadata.Component.Properties = appendOnce(doc.Metadata.Component.Properties, property{Name: "go:" + s.Key, Value: s.Value})
			}
		}
		for _, m := range bi.Deps {
			if m.Replace != nil {
				m = m.Replace
			}
			c := component{Type: "library", Name: m.Path, Version: m.Version, PURL: purl(m.Path, m.Version)}
			if m.Sum != "" {
				c.Properties = []property{{Name: "go:module:sum", Value: m.Sum}}
			}
			c.BOMRef = c.PURL
			seen[c.PURL] = c
		}
	}
	for _, c := range seen {
		doc.Components = append(doc.Components, c)
	}
	sort.Slice(doc.Components, func(i, j int) bool { return doc.Components[i].PURL < doc.Components[j].PURL })
	return doc
}

func appendOnce(ps []property, p property) []property {
	for _, q := range ps {
		if q == p {
			return ps
		}
	}
	return append(ps, p)
}

// purl is the package URL of a Go module (purl spec, type golang): the
// path's segments as namespace and name, lower-cased, and the version.
func purl(path, version string) string {
	p := "pkg:golang/" + strings.ToLower(path)
	if version != "" && version != "(devel)" {
		p += "@" + version
	}
	return p
}
