package main

import (
	"log/slog"
	"os"
	"regexp"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/cmd/internal/clidoc"
)

// Every projector command the operator and upgrade guides show exists
// with that shape: the subcommand, each flag (with its value) and the
// positional arguments.
func TestOperatorGuidesShowRealCommands(t *testing.T) {
	t.Parallel()
	for _, guide := range []string{"../../docs/operator.md", "../../docs/upgrade.md"} {
		md, err := os.ReadFile(guide)
		require.NoError(t, err)
		lines := clidoc.Commands(string(md), "projector")
		require.GreaterOrEqual(t, len(lines), 10, "%s shows projector commands", guide)
		for _, args := range lines {
			err := clidoc.CheckCommandLine(newRoot(&Env{Logger: slog.New(slog.DiscardHandler)}), args)
			assert.NoError(t, err, "%s", guide)
		}
	}
	// The checker can fail, and reads lines as a shell does (code blocks,
	// then inline spans; other programs left out).
	for _, bad := range [][]string{
		{"projector", "quarantine", "replay", "42", "--everything"},
		{"projector", "promote", "archive"},
		{"projector", "rebuild", "archive", "--from-time"},
		{"projector", "status", "extra"},
	} {
		require.Error(t, clidoc.CheckCommandLine(newRoot(&Env{Logger: slog.New(slog.DiscardHandler)}), bad), "%v", bad)
	}
	require.Equal(t, [][]string{{"projector", "status", "--check"}, {"projector", "gaps", "ack", "3", "--reason", "a b"}},
		clidoc.Commands("x `projector gaps ack 3\n --reason \"a b\"` y\n```sh\nprojector status --check || echo no # c\ncapture --standby\n```\n", "projector"))
}

// The operator guide says what to do for every alert of
// deploy/prometheus/alerts.yaml, and names no alert that does not exist.
func TestOperatorGuideCoversEveryAlert(t *testing.T) {
	t.Parallel()
	rules, err := os.ReadFile("../../deploy/prometheus/alerts.yaml")
	require.NoError(t, err)
	guide, err := os.ReadFile("../../docs/operator.md")
	require.NoError(t, err)
	alerts := map[string]bool{}
	for _, m := range regexp.MustCompile(`(?m)^\s*- alert: (\w+)`).FindAllStringSubmatch(string(rules), -1) {
		alerts[m[1]] = true
		assert.Contains(t, string(guide), "`"+m[1]+"`", "the guide says nothing of %s", m[1])
	}
	require.GreaterOrEqual(t, len(alerts), 20)
	for _, m := range regexp.MustCompile("`(Epitaph[A-Za-z]+)`").FindAllStringSubmatch(string(guide), -1) {
		assert.True(t, alerts[m[1]], "the guide names %s, which is not an alert", m[1])
	}
}
