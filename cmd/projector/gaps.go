package main

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	"github.com/epitaph-dev/epitaph/cmd/internal/cli"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/status"
)

func init() { register(gapsCommand) }

func gapsCommand(env *Env) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "gaps [ack <id> --reason R]",
		Short: "what the archive is known to miss (archive.gaps): list [--json] | ack <id> --reason R",
		Long: `gaps lists, per active version, what the archive is known to miss: deletes
lost upstream (a recreated slot), events removed from the stream before the
version applied them, TRUNCATEs. lost_upstream and removed_from_stream gaps
keep archive.status not ready until acknowledged with "gaps ack".`,
		Example: `  projector gaps --json
  projector gaps ack 3 --reason "slot recreated after the 2026-11-30 outage; accepted"`,
		Args: cli.NoArgs,
	}
	c := commonFlags(cmd, env)
	proj := projectionFlag(cmd)
	asJSON := jsonFlag(cmd, "one object per active version with its gaps")
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		ctx := cmd.Context()
		if err := checkProjection(*proj); err != nil {
			return err
		}
		pool, err := targetPool(ctx, c)
		if err != nil {
			return err
		}
		defer pool.Close()
		vgs, err := status.ListGaps(ctx, pool, *proj)
		if err != nil {
			return err
		}
		if *asJSON {
			return writeJSONList(env.Stdout, vgs)
		}
		if len(vgs) == 0 {
			fmt.Fprintf(env.Stdout, "%s has no active version\n", *proj)
			return nil
		}
		return writeGaps(env.Stdout, vgs)
	}
	cmd.AddCommand(gapsAckCommand(env))
	return cmd
}

func gapsAckCommand(env *Env) *cobra.Command {
	cmd := &cobra.Command{
		Use:     "ack <id> --reason R",
		Short:   "accept a gap (kept in archive.gaps.ack_reason), so the archive can be ready again",
		Example: `  projector gaps ack 3 --reason "slot recreated after the outage; accepted"`,
		Args:    cli.Args(1),
	}
	c := commonFlags(cmd, env)
	proj := projectionFlag(cmd)
	version := cmd.Flags().Int("version", 0, "the version whose gap it is (default: the live version)")
	reason := cmd.Flags().String("reason", "", "why the loss is accepted (required; kept in archive.gaps.ack_reason)")
	asJSON := jsonFlag(cmd, "the acknowledged gap")
	cmd.RunE = func(cmd *cobra.Command, pos []string) error {
		ctx := cmd.Context()
		id, err := strconv.ParseInt(pos[0], 10, 64)
		if err != nil || id <= 0 {
			return cli.Usage("gap id %q: want a positive number", pos[0])
		}
		if strings.TrimSpace(*reason) == "" {
			return cli.Usage("gaps ack needs --reason TEXT (kept in archive.gaps.ack_reason)")
		}
		if err := checkProjection(*proj); err != nil {
			return err
		}
		pool, err := targetPool(ctx, c)
		if err != nil {
			return err
		}
		defer pool.Close()
		g, err := status.AckGap(ctx, pool, *proj, *version, id, *reason)
		if err != nil {
			return notFound(err)
		}
		if *asJSON {
			return writeJSON(env.Stdout, g)
		}
		fmt.Fprintf(env.Stdout, "%s acknowledged: %s\n", g, *g.AckReason)
		return nil
	}
	return cmd
}

// projectionFlag is --projection, the projection a command reads.
func projectionFlag(cmd *cobra.Command) *string {
	return cmd.Flags().String("projection", archive.Projection, "projection (the only one is "+archive.Projection+")")
}

// checkProjection refuses a projection that does not exist (a typo would
// otherwise read as "no active version", or wait out a timeout).
func checkProjection(name string) error {
	if name != archive.Projection {
		return cli.Usage("--projection %q: no such projection (the only one is %q)", name, archive.Projection)
	}
	return nil
}
