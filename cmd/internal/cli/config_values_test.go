package cli

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"

	"github.com/spf13/cobra"
	"github.com/stretchr/testify/require"
)

// runConfig runs a command with one text flag --secret (T_SECRET) set from
// a configuration file of body; it returns the value and the error.
func runConfig(t *testing.T, body string) (string, error) {
	t.Helper()
	p := filepath.Join(t.TempDir(), "c.yaml")
	require.NoError(t, os.WriteFile(p, []byte(body), 0o600))
	var v string
	cmd := &cobra.Command{Use: "t", RunE: func(*cobra.Command, []string) error { return nil }}
	Local(cmd).String(&v, "nats-password", "T_SECRET", "", "a password")
	ConfigFlag(cmd)
	cmd.PersistentPreRunE = func(cmd *cobra.Command, _ []string) error {
		return ApplyEnv(cmd, func(string) (string, bool) { return "", false })
	}
	Prepare(cmd, &bytes.Buffer{}, &bytes.Buffer{})
	cmd.SetArgs([]string{"--config", p})
	err := cmd.Execute()
	return v, err
}

// A text flag set from the file gets the text written there: a password,
// token or name that YAML would read as a number is not silently turned
// into another text (0123 into 123, 1e3 into 1000, 0x1F into 31), which
// would authenticate with the wrong secret.
func TestConfigTextValuesKeptAsWritten(t *testing.T) {
	for _, written := range []string{"0123", "1e3", "0x1F", "1.10", "1_000", "0o17", "+5"} {
		got, err := runConfig(t, "nats-password: "+written+"\n")
		if err != nil {
			t.Errorf("nats-password: %s: refused: %v", written, err)
			continue
		}
		if got != written {
			t.Errorf("nats-password: %s in the file: the flag got %q", written, got)
		}
	}
}

// A file that is not YAML of key: value lines (a secret file named by
// mistake, a bare URL) is refused without quoting its content.
func TestConfigErrorDoesNotQuoteTheFile(t *testing.T) {
	for _, body := range []string{"hunter2\n", "s3cr3t-tok\n", "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\n"} {
		_, err := runConfig(t, body)
		require.Error(t, err)
		secret := body[:len(body)-1]
		if len(secret) > 7 {
			secret = secret[:7]
		}
		require.NotContains(t, err.Error(), secret, "the error quotes the file's content")
	}
}
