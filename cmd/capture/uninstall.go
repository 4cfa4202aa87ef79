package main

import (
	"fmt"
	"io"

	"github.com/spf13/cobra"

	"github.com/epitaph-dev/epitaph/capture"
	"github.com/epitaph-dev/epitaph/cmd/internal/cli"
)

// newUninstallCommand is `capture uninstall`: what the capture left on the
// source, removed; without --yes it only says what it would do.
func newUninstallCommand(stdout io.Writer) *cobra.Command {
	var cfg capture.UninstallConfig
	var yes bool
	cmd := &cobra.Command{
		Use:   "uninstall [--yes]",
		Short: "drop the slot and the publication, put back the replica identities the capture changed",
		Long: `uninstall removes from the source what the capture made there: the DDL
guard of the publication (--install-ddl-guard), the publication, the
replication slot (which otherwise keeps holding WAL), and the replica
identities --set-replica-identity-full changed, put back as they were
(recorded in schema epitaph_capture when they were changed; a table changed
again since is left as it is). Stop the capture first: with --yes a slot
in use is refused (exit 1). The JetStream stream and the data directory are
left, and so is the table epitaph.capture_partition_seqs (the stream's
partition sequences, in schema epitaph): drop it when the stream is deleted
too.

Without --yes it prints the statements it would run (and whether the slot is
in use) and exits 2.`,
		Example: `  capture uninstall --source-url postgres://epitaph@db:5432/app          # the plan
  capture uninstall --source-url postgres://epitaph@db:5432/app --yes    # do it`,
		Args: cli.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if cfg.SourceURL == "" {
				return cli.Usage("a source database URL is required (--source-url, EPITAPH_SOURCE_URL)")
			}
			plan, err := capture.PlanUninstall(cmd.Context(), cfg)
			if err != nil {
				return err
			}
			// Only the command line says yes: not a variable, not a
			// configuration file that would uninstall at every run.
			if !yes || !cmd.Flags().Changed("yes") {
				fmt.Fprintf(stdout, "capture uninstall would run, on the source:\n%s", plan)
				if err := plan.InUse(); err != nil {
					return cli.Usage("nothing done: %v with --yes", err)
				}
				return cli.Usage("nothing done: run again with --yes to do it")
			}
			if err := plan.Apply(cmd.Context()); err != nil {
				return err
			}
			fmt.Fprintf(stdout, "capture uninstall ran, on the source:\n%s", plan)
			return nil
		},
	}
	f := cli.Local(cmd)
	f.String(&cfg.SourceURL, "source-url", "EPITAPH_SOURCE_URL", "", "source database URL (postgres://user:pass@host:port/db)", cli.KeepEmpty())
	f.String(&cfg.SlotName, "slot", "EPITAPH_SLOT", "epitaph", "replication slot", cli.KeepEmpty())
	f.String(&cfg.PublicationName, "publication", "EPITAPH_PUBLICATION", "epitaph", "publication", cli.KeepEmpty())
	f.Bool(&yes, "yes", "", false, "do it (without: print what it would do, and exit 2); on the command line only")
	return cmd
}
