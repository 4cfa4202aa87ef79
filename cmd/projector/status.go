package main

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/spf13/cobra"

	"github.com/epitaph-dev/epitaph/cmd/internal/cli"
	"github.com/epitaph-dev/epitaph/projection/status"
	"github.com/epitaph-dev/epitaph/projection/version"
)

func init() { register(statusCommand) }

func statusCommand(env *Env) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "status",
		Short: "show versions, partitions, lag and quarantine (--json for the /status document)",
		Long: `status prints every projection version with its state and health, each
partition's owner, cursor and lag, the workers and unresolved quarantine.
--json prints the same document as GET /status. --check exits 3 unless every
live version is healthy (health "live": leased, not failing, nothing in
quarantine).`,
		Example: `  projector status
  projector status --json | jq '.versions[] | {projection, version, state, lag_events}'
  projector status --check || echo "needs attention"
  projector status --wait   # follow rebuilds until they are ready`,
		Args: cli.NoArgs,
	}
	c := commonFlags(cmd, env)
	asJSON := jsonFlag(cmd, "the status document")
	follow := cmd.Flags().Bool("wait", false, "follow every version being built until it is ready, with a progress bar on a terminal")
	check := cmd.Flags().Bool("check", false, "exit 3 unless there is a live version and every live version is healthy")
	var sample time.Duration
	cli.Local(cmd).Duration(&sample, "sample", "", time.Second, "while a version is being rebuilt, sample twice this far apart for events/s and ETA (0: once)", cli.NotNegative())
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		ctx := cmd.Context()
		if err := c.check(); err != nil {
			return err
		}
		pool, err := pgxpool.New(ctx, c.targetURL)
		if err != nil {
			return cli.Usage("target URL %s: %w", redact(c.targetURL), err)
		}
		defer pool.Close()
		var js jetstream.JetStream
		if nc, err := c.natsConnect(nats.Timeout(3 * time.Second)); err == nil {
			defer nc.Close()
			js, _ = jetstream.New(nc)
		} else {
			fmt.Fprintf(env.Stderr, "projector: NATS %s unreachable (lag unknown): %v\n", redact(c.natsURL), err)
		}
		if *follow {
			if js == nil {
				return errors.New("status --wait needs NATS")
			}
			return followVersions(ctx, pool, js, c.sourceName, env.Stdout)
		}
		st, err := status.CollectStatus(ctx, pool, js, c.sourceName, time.Now())
		if err != nil {
			return err
		}
		if st, err = sampleRates(ctx, pool, js, c.sourceName, st, sample); err != nil {
			return err
		}
		if *asJSON {
			err = cli.WriteJSON(env.Stdout, st)
		} else {
			err = writeStatusTable(env.Stdout, st)
		}
		if err != nil || !*check {
			return err
		}
		return statusCheck(st)
	}
	return cmd
}

// statusCheck is --check: a live version exists and every live version's
// health is "live".
func statusCheck(st *status.Status) error {
	var bad []string
	live := 0
	for _, v := range st.Versions {
		if v.State != version.StateLive {
			continue
		}
		live++
		if v.Health != version.StateLive {
			bad = append(bad, fmt.Sprintf("%s v%d is %s", v.Projection, v.Version, v.Health))
		}
	}
	if live == 0 {
		bad = append(bad, "no live version")
	}
	if len(bad) > 0 {
		return cli.WithCode(cli.ExitNotEqual, errors.New("status check failed: "+strings.Join(bad, "; ")))
	}
	return nil
}
