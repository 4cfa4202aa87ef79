// Command sbom writes a CycloneDX 1.5 JSON software bill of materials of Go
// binaries, from the module information the Go toolchain embeds in every
// binary (what `go version -m` prints): the main module, every module
// linked in, with its version, its go.sum hash and a package URL, and the
// Go toolchain. `make dist` writes one per release archive.
//
//	go run ./internal/sbom -name epitaph -version v1.2.0 bin/capture bin/projector > sbom.cdx.json
//
// No syft or goreleaser: the build information is exactly what was linked,
// it needs nothing beyond the standard library, and it is read the same
// from a binary of any GOOS/GOARCH.
package main

import (
	"debug/buildinfo"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
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
	enc := json.NewEncoder(out)
	enc.SetIndent("", "  ")
	return enc.Encode(bom(*name, *version, ts, infos))
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
