package cli

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/spf13/cobra"
	"github.com/stretchr/testify/require"
)

// A password written the other ways the connection strings take one (a
// PostgreSQL URL's password parameter, libpq's "password = x" with spaces,
// a list of NATS URLs, a NATS URL without its scheme) is a password all
// the same: a world-readable file holding it is refused.
func TestConfigFileWithAPasswordParameterMustNotBeWorldReadable(t *testing.T) {
	dir := t.TempDir()
	for i, v := range []string{
		"postgres://u@h/db?password=hunter2",
		"postgres://u@h/db?sslmode=disable&password=hunter2",
		"host=h password = hunter2",
		"host=h password= hunter2",
		"nats://a:4222,nats://u:hunter2@b:4222",
		"u:hunter2@nats:4222",
	} {
		if !strings.Contains(v, "nats") {
			cfg, err := pgconn.ParseConfig(v)
			require.NoError(t, err, v)
			require.Equal(t, "hunter2", cfg.Password, "the driver takes the password from %q", v)
		}

		p := filepath.Join(dir, "c"+string(rune('a'+i))+".yaml")
		require.NoError(t, os.WriteFile(p, []byte("name: '"+v+"'\n"), 0o600))
		require.NoError(t, os.Chmod(p, 0o644))
		var s settings
		cmd := testCommand(&s)
		ConfigFlag(cmd)
		cmd.PersistentPreRunE = func(cmd *cobra.Command, _ []string) error {
			return ApplyEnv(cmd, func(string) (string, bool) { return "", false })
		}
		Prepare(cmd, &bytes.Buffer{}, &bytes.Buffer{})
		cmd.SetArgs([]string{"--config", p})
		err := cmd.Execute()
		require.ErrorContains(t, err, `holds a password (name)`, v)
		require.Equal(t, ExitUsage, Code(err))
		require.NotContains(t, err.Error(), "hunter2")
	}
}
