package main

import (
	"bytes"
	"debug/buildinfo"
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// The SBOM of a real Go binary (the capture, built for the test: a test
// binary records no module dependencies) lists every module it links with
// its version, go.sum hash and package URL, and the toolchain; the
// metadata carries the given version and time; a file that is not a Go
// binary is refused.
func TestSBOMOfABinary(t *testing.T) {
	exe := filepath.Join(t.TempDir(), "capture")
	build := exec.Command("go", "build", "-o", exe, "github.com/epitaph-dev/epitaph/cmd/capture")
	build.Stderr = os.Stderr
	require.NoError(t, build.Run())
	var out bytes.Buffer
	require.NoError(t, run([]string{"-version", "v9.9.9", "-time", "2026-01-02T03:04:05Z", exe, exe}, &out))
	var doc document
	require.NoError(t, json.Unmarshal(out.Bytes(), &doc))
	require.Equal(t, "CycloneDX", doc.BOMFormat)
	require.Equal(t, "1.5", doc.SpecVersion)
	require.Equal(t, "2026-01-02T03:04:05Z", doc.Metadata.Timestamp)
	require.Equal(t, "v9.9.9", doc.Metadata.Component.Version)
	require.Contains(t, doc.Metadata.Component.Properties, property{Name: "go:GOOS", Value: runtime.GOOS})

	bi, err := buildinfo.ReadFile(exe)
	require.NoError(t, err)
	require.NotEmpty(t, bi.Deps, "the capture links pgx and nats at least")
	byPURL := map[string]component{}
	for _, c := range doc.Components {
		_, dup := byPURL[c.PURL]
		require.False(t, dup, "each module once: %s", c.PURL)
		byPURL[c.PURL] = c
	}
	require.Len(t, byPURL, len(bi.Deps)+1, "every module, and the toolchain")
	for _, m := range bi.Deps {
		if m.Replace != nil {
			m = m.Replace
		}
		c, ok := byPURL[purl(m.Path, m.Version)]
		require.True(t, ok, m.Path)
		require.Equal(t, m.Version, c.Version)
		require.Equal(t, []property{{Name: "go:module:sum", Value: m.Sum}}, c.Properties, m.Path)
	}
	require.Equal(t, runtime.Version(), byPURL["pkg:golang/std@"+runtime.Version()].Version)

	notGo := filepath.Join(t.TempDir(), "x")
	require.NoError(t, os.WriteFile(notGo, []byte("#!/bin/sh\n"), 0o755))
	require.Error(t, run([]string{notGo}, &out))
	require.Error(t, run(nil, &out), "no binary named")
}

func TestPURL(t *testing.T) {
	for _, c := range []struct{ path, version, want string }{
		{"github.com/jackc/pgx/v5", "v5.7.1", "pkg:golang/github.com/jackc/pgx/v5@v5.7.1"},
		{"github.com/BurntSushi/toml", "v1.4.0", "pkg:golang/github.com/burntsushi/toml@v1.4.0"},
		{"github.com/epitaph-dev/epitaph", "(devel)", "pkg:golang/github.com/epitaph-dev/epitaph"},
	} {
		require.Equal(t, c.want, purl(c.path, c.version))
	}
}

// -notices writes, for every module a real binary links and for the Go
// toolchain, its name and version and its licence texts from the module
// cache; a module directory without a licence file is an error.
func TestNoticesCarryEveryLinkedModulesLicence(t *testing.T) {
	exe := filepath.Join(t.TempDir(), "projector")
	build := exec.Command("go", "build", "-o", exe, "github.com/epitaph-dev/epitaph/cmd/projector")
	build.Stderr = os.Stderr
	require.NoError(t, build.Run())
	notices := filepath.Join(t.TempDir(), "THIRD_PARTY_NOTICES")
	require.NoError(t, run([]string{"-notices", notices, exe}, io.Discard))
	raw, err := os.ReadFile(notices)
	require.NoError(t, err)
	sections := strings.Split(string(raw), "\n"+strings.Repeat("=", 78)+"\n")[1:]
	byName := map[string]string{}
	for _, s := range sections {
		head, body, _ := strings.Cut(s, "\n")
		byName[head] = body
	}
	bi, err := buildinfo.ReadFile(exe)
	require.NoError(t, err)
	require.Len(t, byName, len(bi.Deps)+1, "every module, and the toolchain")
	for _, m := range append(bi.Deps, &debug.Module{Path: "Go", Version: runtime.Version() + " (its standard library)"}) {
		if m.Replace != nil {
			m = m.Replace
		}
		body, ok := byName[m.Path+" "+m.Version]
		require.True(t, ok, "%s %s", m.Path, m.Version)
		require.Regexp(t, `(?s)^\n--- (?i:licen[cs]e|copying|notice)[^\n]* ---\n\n.{200,}`, body, m.Path)
	}
	require.Contains(t, byName["github.com/jackc/pgx/v5 "+versionOf(bi, "github.com/jackc/pgx/v5")], "MIT")

	_, err = licenceFiles(t.TempDir())
	require.ErrorContains(t, err, "no licence file")
}

func versionOf(bi *buildinfo.BuildInfo, path string) string {
	for _, m := range bi.Deps {
		if m.Path == path {
			return m.Version
		}
	}
	return ""
}
