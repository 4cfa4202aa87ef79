package cli

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"

	"github.com/spf13/cobra"
	"github.com/stretchr/testify/require"
)

// TestConfigFileIsReadWholeOrRefused: a configuration file whose settings
// would not all be read is refused, as a key that is no flag is: a
// second YAML document (after a `---` line) was silently dropped, and of
// a key given twice only the last counted.
func TestConfigFileIsReadWholeOrRefused(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct{ name, body, err string }{
		{"second document", "name: first\n---\nn: 3\n", "second document"},
		{"key twice", "n: 3\nname: x\nn: 4\n", "n: given twice"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := filepath.Join(dir, tc.name+".yaml")
			require.NoError(t, os.WriteFile(p, []byte(tc.body), 0o600))
			var s settings
			cmd := testCommand(&s)
			ConfigFlag(cmd)
			cmd.PersistentPreRunE = func(cmd *cobra.Command, _ []string) error {
				return ApplyEnv(cmd, func(string) (string, bool) { return "", false })
			}
			Prepare(cmd, &bytes.Buffer{}, &bytes.Buffer{})
			cmd.SetArgs([]string{"--config", p})
			err := cmd.Execute()
			require.Error(t, err, "read as n=%d name=%q", s.n, s.name)
			require.ErrorContains(t, err, tc.err)
			require.Equal(t, ExitUsage, Code(err))
		})
	}
	// A leading document marker is one document, as before.
	p := filepath.Join(dir, "marked.yaml")
	require.NoError(t, os.WriteFile(p, []byte("---\nn: 3\n"), 0o600))
	values, err := configValues(p)
	require.NoError(t, err)
	require.Equal(t, map[string]string{"n": "3"}, values)
}
