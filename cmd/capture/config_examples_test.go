package main

import (
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/cmd/internal/cli"
)

// TestShippedCaptureConfigExamplesLoad: every configuration file the guide
// shows for the capture (a yaml block naming /etc/epitaph/capture.yaml),
// every `key: value` the guide tells to put "in the config file", and
// every one its section on the file shows, loads into the capture's own
// command: each key a flag of it, each value one its flag takes.
func TestShippedCaptureConfigExamplesLoad(t *testing.T) {
	files, err := filepath.Glob("../../docs/*.md")
	require.NoError(t, err)
	files = append(files, "../../README.md", "../../deploy/README.md")
	block := regexp.MustCompile("(?s)```ya?ml\n(# /etc/epitaph/capture\\.yaml\n.*?)```")
	inline := regexp.MustCompile("`([a-z][a-z0-9-]*: [^`]+)` in the config file")
	span := regexp.MustCompile("`([a-z][a-z0-9-]*: [^`]+)`")
	var examples []string
	for _, f := range files {
		b, err := os.ReadFile(f)
		require.NoError(t, err)
		for _, m := range block.FindAllStringSubmatch(string(b), -1) {
			examples = append(examples, m[1])
		}
		for _, m := range inline.FindAllStringSubmatch(string(b), -1) {
			examples = append(examples, m[1]+"\n")
		}
		// The section on the file: each `key: value` it shows.
		text := string(b)
		if i := strings.Index(text, "\n### Capture configuration\n"); i >= 0 {
			text = text[i+1:]
			if j := strings.Index(text[4:], "\n#"); j >= 0 {
				text = text[:j+4]
			}
			for _, m := range span.FindAllStringSubmatch(text, -1) {
				if m[1] != "key: value" {
					examples = append(examples, m[1]+"\n")
				}
			}
		}
	}
	require.NotEmpty(t, examples, "no capture configuration example found in the guide")
	for i, ex := range examples {
		path := filepath.Join(t.TempDir(), "capture.yaml")
		require.NoError(t, os.WriteFile(path, []byte(ex), 0o600))
		root := newCommand(func(string) (string, bool) { return "", false }, io.Discard, io.Discard)
		require.NoError(t, root.ParseFlags([]string{"--config", path}))
		err := cli.ApplyEnv(root, func(string) (string, bool) { return "", false })
		require.NoError(t, err, "example %d:\n%s", i, ex)
		for _, line := range strings.Split(ex, "\n") {
			if k, _, ok := strings.Cut(line, ":"); ok && !strings.HasPrefix(k, "#") {
				require.NotNil(t, root.Flags().Lookup(k), "example %d: %s is no flag of the capture", i, k)
			}
		}
	}
}
