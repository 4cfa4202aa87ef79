package main

import (
	"log/slog"
	"strings"
	"testing"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/cmd/internal/cli"
	"github.com/epitaph-dev/epitaph/projection/status"
)

// every runnable command of the tree, by path without "projector ".
func leaves(t *testing.T) map[string]*cobra.Command {
	t.Helper()
	root := newRoot(&Env{Logger: slog.New(slog.DiscardHandler)})
	out := map[string]*cobra.Command{}
	var walk func(c *cobra.Command)
	walk = func(c *cobra.Command) {
		if c != root && !c.Hidden {
			out[strings.TrimPrefix(c.CommandPath(), "projector ")] = c
		}
		for _, sub := range c.Commands() {
			walk(sub)
		}
	}
	walk(root)
	return out
}

// Help exits 0 on every command and shows its positional arguments and
// examples; a command run without its arguments or with extra ones is a
// usage error (exit 2), never silently ignored.
func TestHelpAndArguments(t *testing.T) {
	t.Parallel()
	code, stdout, stderr := projector(t, nil, "--help")
	require.Equal(t, 0, code, stderr)
	require.Contains(t, stdout, "Available Commands:")
	for _, want := range []string{"run", "migrate", "status", "rebuild", "compare", "promote", "rollback", "retire", "wait",
		"quarantine", "snapshots", "gaps", "trust-key", "completion", "version"} {
		require.Regexp(t, `(?m)^  `+want+`\s`, stdout)
	}
	cmds := leaves(t)
	for path := range cmds {
		code, stdout, stderr := projector(t, nil, append(strings.Fields(path), "--help")...)
		require.Equal(t, 0, code, "%s --help: %s", path, stderr)
		require.Contains(t, stdout, "Usage:", path)
	}
	for path, use := range map[string]string{
		"rebuild":           "projector rebuild <projection> [flags]",
		"compare":           "projector compare <projection> <a> <b> [flags]",
		"promote":           "projector promote <projection> <version> [flags]",
		"retire":            "projector retire <projection> <version> [flags]",
		"quarantine show":   "projector quarantine show <id> [flags]",
		"quarantine replay": "projector quarantine replay <id> | --all [flags]",
		"snapshots show":    "projector snapshots show <correlation-id> [flags]",
	} {
		_, stdout, _ := projector(t, nil, append(strings.Fields(path), "--help")...)
		require.Contains(t, stdout, "Usage:\n  "+use, path)
		require.Contains(t, stdout, "Examples:", path)
	}

	for _, args := range [][]string{
		{},                          // a subcommand is required
		{"bogus"},                   // unknown
		{"rebuild"},                 // missing <projection>
		{"rebuild", "archive", "x"}, // extra
		{"compare", "archive", "1"},
		{"compare", "archive", "1", "2", "3"},
		{"rollback", "archive", "extra"},
		{"status", "extra"},
		{"run", "extra"},
		{"migrate", "sideways"},
		{"migrate", "status", "extra"},
		{"quarantine"},
		{"quarantine", "bogus"},
		{"quarantine", "show"},
		{"quarantine", "show", "1", "2"},
		{"quarantine", "show", "x"},
		{"quarantine", "replay", "1", "--all"},
		{"snapshots", "batch", "extra"},
		{"version", "extra"},
		{"completion", "bash", "extra"},
		{"completion", "tcsh"},
		{"compare", "archive", "one", "2"},
		{"status", "--no-such-flag"},
		{"gaps", "extra"},
		{"gaps", "ack"},
		{"gaps", "ack", "1"}, // --reason is required
	} {
		code, _, stderr := projector(t, map[string]string{"EPITAPH_TARGET_URL": "postgres://u@127.0.0.1:1/db"}, args...)
		require.Equal(t, 2, code, "%q: %s", args, stderr)
		require.Equal(t, 1, strings.Count(stderr, "\n"), "%q: one line: %s", args, stderr)
		require.True(t, strings.HasPrefix(stderr, "projector: "), stderr)
	}
}

// wait keeps its documented exit codes: 2 is a timeout, so its usage
// errors exit 1.
func TestWaitUsageExitsOne(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{{"wait"}, {"wait", "--lsn", "nonsense"}, {"wait", "--lsn", "0/1", "extra"}, {"wait", "--bogus"}} {
		code, _, stderr := projector(t, map[string]string{"EPITAPH_TARGET_URL": "postgres://u@127.0.0.1:1/db"}, args...)
		require.Equal(t, 1, code, "%q: %s", args, stderr)
	}
}

// A projection that does not exist is refused at once, naming the one
// that does: wait would otherwise wait out its timeout for a live version
// that never comes, and gaps say "no active version" with exit 0.
func TestUnknownProjectionIsAUsageError(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		args []string
		code int
	}{
		{[]string{"wait", "--lsn", "0/1", "--projection", "archiv"}, 1},
		{[]string{"gaps", "--projection", "archiv"}, 2},
		{[]string{"gaps", "ack", "1", "--reason", "r", "--projection", "archiv"}, 2},
	} {
		code, stdout, stderr := projector(t, map[string]string{"EPITAPH_TARGET_URL": "postgres://u@127.0.0.1:1/db"}, c.args...)
		require.Equal(t, c.code, code, "%q: %s", c.args, stderr)
		require.Contains(t, stderr, `--projection "archiv": no such projection (the only one is "archive")`, c.args)
		require.Empty(t, stdout, c.args)
	}
}

// Every flag that has a variable has the EPITAPH_ one named after it and
// says so in its help; the help never shows values from the environment.
func TestEveryFlagHasItsVariable(t *testing.T) {
	t.Parallel()
	secret := map[string]string{"EPITAPH_TARGET_URL": "postgres://u:hunter2@db/app", "EPITAPH_SOURCE_URL": "postgres://u:hunter2@db/app",
		"EPITAPH_NATS_URL": "nats://u:hunter2@nats:4222"}
	with := 0
	for path, c := range leaves(t) {
		code, stdout, _ := projector(t, secret, append(strings.Fields(path), "--help")...)
		require.Equal(t, 0, code)
		require.NotContains(t, stdout, "hunter2", path)
		c.Flags().VisitAll(func(f *pflag.Flag) {
			env := cli.EnvOf(f)
			if env == "" {
				return
			}
			with++
			require.True(t, strings.HasPrefix(env, "EPITAPH_"), "%s --%s: %s", path, f.Name, env)
			require.Contains(t, stdout, "("+env+")", "%s --%s", path, f.Name)
		})
	}
	require.Greater(t, with, 40)
	// Nor values given on the command line before --help.
	code, stdout, _ := projector(t, nil, "run", "--target-url", "postgres://u:hunter2@db/app", "--help")
	require.Equal(t, 0, code)
	require.NotContains(t, stdout, "hunter2")
	// The settings shared by the commands have one variable each.
	run := leaves(t)["run"]
	for flag, env := range map[string]string{"target-url": "EPITAPH_TARGET_URL", "nats-url": "EPITAPH_NATS_URL",
		"source-name": "EPITAPH_SOURCE_NAME", "log-level": "EPITAPH_LOG_LEVEL", "log-format": "EPITAPH_LOG_FORMAT",
		"worker-id": "EPITAPH_WORKER_ID", "lease-ttl": "EPITAPH_LEASE_TTL", "batch-size": "EPITAPH_BATCH_SIZE"} {
		f := run.Flags().Lookup(flag)
		if f == nil {
			f = run.InheritedFlags().Lookup(flag)
		}
		require.NotNil(t, f, flag)
		require.Equal(t, env, cli.EnvOf(f), flag)
	}
}

func TestVersionAndCompletion(t *testing.T) {
	t.Parallel()
	code, stdout, _ := projector(t, nil, "--version")
	require.Equal(t, 0, code)
	require.Regexp(t, `^projector \S+ \(commit \S+, built \S+, go1\.`, stdout)
	code, stdout, _ = projector(t, nil, "version", "--json")
	require.Equal(t, 0, code)
	require.Contains(t, stdout, `"go_version": "go1.`)
	require.Contains(t, stdout, `"build_time":`)
	for _, shell := range []string{"bash", "zsh", "fish", "powershell"} {
		code, stdout, _ = projector(t, nil, "completion", shell)
		require.Equal(t, 0, code, shell)
		require.Contains(t, stdout, "projector", shell)
	}
	// The shell completes subcommands and enumerated flag values.
	code, stdout, _ = projector(t, nil, "__complete", "quar")
	require.Equal(t, 0, code)
	require.Contains(t, stdout, "quarantine")
	code, stdout, _ = projector(t, nil, "__complete", "quarantine", "list", "--status", "")
	require.Equal(t, 0, code)
	for _, v := range []string{"open", "replayed", "discarded", "all"} {
		require.Contains(t, stdout, v+"\n")
	}
}

func withGaps(v status.VersionStatus, gs ...status.GapCount) status.VersionStatus {
	v.GapCounts = gs
	return v
}

func TestStatusCheckRule(t *testing.T) {
	t.Parallel()
	v := func(state, health string) status.VersionStatus {
		return status.VersionStatus{Projection: "archive", Version: 1, State: state, Health: health}
	}
	for _, tc := range []struct {
		versions []status.VersionStatus
		fail     string
	}{
		{nil, "no live version"},
		{[]status.VersionStatus{v("building", "building")}, "no live version"},
		{[]status.VersionStatus{v("live", "live")}, ""},
		{[]status.VersionStatus{v("live", "live"), v("building", "unavailable")}, ""},
		{[]status.VersionStatus{v("live", "quarantined")}, "archive v1 is quarantined"},
		{[]status.VersionStatus{v("live", "unavailable")}, "archive v1 is unavailable"},
		{[]status.VersionStatus{withGaps(v("live", "live"), status.GapCount{Kind: "lost_upstream", Count: 2},
			status.GapCount{Kind: "removed_from_stream", Count: 1})},
			"archive v1 misses deletes: 3 unacknowledged gaps (lost_upstream, removed_from_stream; projector gaps)"},
		{[]status.VersionStatus{withGaps(v("live", "live"), status.GapCount{Kind: "lost_upstream", Acknowledged: true, Count: 2},
			status.GapCount{Kind: "truncate", Count: 4})}, ""},
		{[]status.VersionStatus{withGaps(v("building", "building"), status.GapCount{Kind: "lost_upstream", Count: 1}), v("live", "live")}, ""},
	} {
		err := statusCheck(&status.Status{Versions: tc.versions})
		if tc.fail == "" {
			require.NoError(t, err)
			continue
		}
		require.ErrorContains(t, err, tc.fail)
		require.Equal(t, 3, cli.Code(err))
	}
}
