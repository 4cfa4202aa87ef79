package main

import (
	"fmt"
	"io"

	"github.com/spf13/cobra"

	"github.com/epitaph-dev/epitaph/capture"
	"github.com/epitaph-dev/epitaph/cmd/internal/cli"
	"github.com/epitaph-dev/epitaph/internal/broker"
)

// newCredsCommand is `capture creds`: the credentials of one target's
// projectors on the embedded broker.
func newCredsCommand(stdout io.Writer) *cobra.Command {
	var dataDir, source, target, out string
	var revoke bool
	cmd := &cobra.Command{
		Use:   "creds --target NAME [--out FILE] [--revoke]",
		Short: "write the embedded broker's credentials for the projectors of one target",
		Long: `creds writes a NATS credentials file for the projectors of one target
database: the user projector_<NAME>, with the projector's permissions on the
source's stream, and subscribing only to its own inboxes
(_INBOX.projector_<NAME>.>). It is signed with the account key the capture's
embedded broker keeps in <data-dir>/nats, so the running broker accepts it at
once (no restart). Give it to that target's projectors (--nats-creds).

Each target with its own credentials: a stolen credential of one target
cannot read another's replies, nor find (and so delete or re-create) its
consumers, whose names carry a random part recorded only in the target's
database; and one target's file can be replaced alone. Run it again to bring a
file to the current permissions (its key is kept); the capture also does that
for the files in <data-dir>/nats at every start.

The file is written 0600; its content is never printed. The capture must have
run once with the embedded broker (it makes the keys).

With --revoke it revokes the file instead (the one --out names, by default
the target's in <data-dir>/nats): its key is listed in <data-dir>/nats and the
file removed. A running capture's embedded broker reads that list every two
seconds: within seconds it closes the connections made with that key and
refuses new ones, with no restart; a capture started later refuses it from its
start. Run creds again for new credentials (a new key).`,
		Example: `  capture creds --target crm --data-dir /var/lib/epitaph
  projector run --nats-creds /var/lib/epitaph/nats/projector_crm.creds ...
  capture creds --target crm --data-dir /var/lib/epitaph --revoke`,
		Args: cli.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if target == "" {
				return cli.Usage("--target is required: the name of the target (letters, digits, '-' or '_')")
			}
			if err := broker.ValidateTarget(target); err != nil {
				return cli.Usage("--target: %w", err)
			}
			dir := capture.EmbeddedCredsDir(dataDir)
			path := out
			if path == "" {
				path = broker.TargetCreds(dir, target)
			}
			if revoke {
				if !cmd.Flags().Changed("revoke") {
					return cli.Usage("--revoke is given on the command line only")
				}
				if err := broker.RevokeTargetCreds(dir, path); err != nil {
					return err
				}
				fmt.Fprintf(stdout, "revoked %s: a running capture's embedded broker refuses it within seconds (closing its connections); otherwise from the capture's next start on\n", path)
				return nil
			}
			if err := broker.WriteTargetCreds(dir, source, target, path); err != nil {
				return err
			}
			fmt.Fprintf(stdout, "wrote %s: NATS user %s (source %s); give it to the target's projectors with --nats-creds\n",
				path, broker.TargetUser(target), source)
			return nil
		},
	}
	f := cli.Local(cmd)
	f.String(&dataDir, "data-dir", "EPITAPH_DATA_DIR", "./epitaph-data", "the capture's data directory (its embedded broker's keys are in <data-dir>/nats)", cli.KeepEmpty())
	f.String(&source, "source-name", "EPITAPH_SOURCE_NAME", capture.DefaultSourceName, "source name (stream EPITAPH_<NAME>)", cli.KeepEmpty())
	f.String(&target, "target", "", "", "name of the target: the user is projector_<NAME>")
	f.String(&out, "out", "", "", "credentials file to write, or revoke (default: <data-dir>/nats/projector_<NAME>.creds)")
	f.Bool(&revoke, "revoke", "", false, "revoke the credentials file instead (a running embedded broker refuses it within seconds)")
	return cmd
}
