package cli

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/spf13/cobra"
	"github.com/stretchr/testify/require"
)

// The configuration file sets what neither the command line nor the
// environment sets: flag over variable over file over default, each value
// through the flag's own parser and constraints, a bad one named by its
// key, a key that is no flag refused, a password never in the message.
func TestConfigFilePrecedence(t *testing.T) {
	dir := t.TempDir()
	files := 0
	file := func(body string) string {
		files++
		p := filepath.Join(dir, fmt.Sprintf("c%d.yaml", files))
		require.NoError(t, os.WriteFile(p, []byte(body), 0o600))
		return p
	}
	good := file(`
name: from-file
n: 5
d: 3m
share: 0.25
on: true
mode: b
optional: [x, y]
`)
	for _, tc := range []struct {
		name string
		env  map[string]string
		args []string
		want settings
		err  string
	}{
		{name: "file by flag", args: []string{"--config", good},
			want: settings{name: "from-file", optional: "x,y", n: 5, d: 3 * time.Minute, share: 0.25, on: true, mode: "b"}},
		{name: "file by variable", env: map[string]string{"EPITAPH_CONFIG": good},
			want: settings{name: "from-file", optional: "x,y", n: 5, d: 3 * time.Minute, share: 0.25, on: true, mode: "b"}},
		{name: "variable over file, flag over both", env: map[string]string{"EPITAPH_CONFIG": good, "T_N": "6", "T_MODE": "a", "T_NAME": ""},
			args: []string{"--n", "7"},
			want: settings{name: "", optional: "x,y", n: 7, d: 3 * time.Minute, share: 0.25, on: true, mode: "a"}},
		{name: "no file", want: settings{name: "def", optional: "fallback", n: 8, d: time.Second, share: 0.5, mode: "a"}},
		{name: "bad value", args: []string{"--config", file("n: 0\nd: 10\nname: postgres://u:hunter2@h/db\n")},
			err: `.yaml: d="10": not a duration (such as 15s, 2m or 1h30m); n="0": must be at least 1`},
		{name: "unknown key", args: []string{"--config", file("nn: 3\n")}, err: `.yaml: nn: not a flag of t`},
		{name: "nested", args: []string{"--config", file("n:\n  a: 1\n")}, err: `n: want a value or a list`},
		{name: "not yaml", args: []string{"--config", file("n: [1\n")}, err: `not YAML`},
		{name: "missing", args: []string{"--config", filepath.Join(dir, "none.yaml")}, err: `none.yaml: open`},
		// A bad variable is reported before the file is read.
		{name: "bad variable", env: map[string]string{"EPITAPH_CONFIG": good, "T_N": "x"}, err: `T_N="x": not an integer`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var s settings
			cmd := testCommand(&s)
			ConfigFlag(cmd)
			cmd.PersistentPreRunE = func(cmd *cobra.Command, _ []string) error {
				return ApplyEnv(cmd, func(k string) (string, bool) { v, ok := tc.env[k]; return v, ok })
			}
			Prepare(cmd, &bytes.Buffer{}, &bytes.Buffer{})
			cmd.SetArgs(tc.args)
			err := cmd.Execute()
			if tc.err != "" {
				require.ErrorContains(t, err, tc.err)
				require.Equal(t, ExitUsage, Code(err))
				require.NotContains(t, err.Error(), "hunter2")
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, s)
		})
	}
}

// A configuration file that holds a password and that everyone may read
// is refused, naming the keys, never the password; one that only its
// group may read, or that holds no password, is read.
func TestConfigFileWithAPasswordMustNotBeWorldReadable(t *testing.T) {
	dir := t.TempDir()
	write := func(name, body string, mode os.FileMode) string {
		p := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(p, []byte(body), 0o600))
		require.NoError(t, os.Chmod(p, mode))
		return p
	}
	for _, tc := range []struct {
		name, body string
		mode       os.FileMode
		err        string
	}{
		{"url password, world-readable", "name: postgres://u:hunter2@h/db\n", 0o644, `holds a password (name) and everyone may read it (mode 0644)`},
		{"keyword password, world-readable", "optional: host=h password=hunter2\n", 0o604, `holds a password (optional)`},
		{"url password, group-readable", "name: postgres://u:hunter2@h/db\n", 0o640, ""},
		{"no password, world-readable", "name: postgres://u@h/db\noptional: host=h user=u\n", 0o644, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var s settings
			cmd := testCommand(&s)
			ConfigFlag(cmd)
			cmd.PersistentPreRunE = func(cmd *cobra.Command, _ []string) error {
				return ApplyEnv(cmd, func(string) (string, bool) { return "", false })
			}
			Prepare(cmd, &bytes.Buffer{}, &bytes.Buffer{})
			cmd.SetArgs([]string{"--config", write(tc.name+".yaml", tc.body, tc.mode)})
			err := cmd.Execute()
			if tc.err == "" {
				require.NoError(t, err)
				return
			}
			require.ErrorContains(t, err, tc.err)
			require.Equal(t, ExitUsage, Code(err))
			require.NotContains(t, err.Error(), "hunter2")
		})
	}
}
