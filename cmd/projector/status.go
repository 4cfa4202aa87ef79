package main

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/spf13/cobra"

	"github.com/epitaph-dev/epitaph/cmd/internal/cli"
	"github.com/epitaph-dev/epitaph/event"
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
--json prints the same document as GET /status. A lag that could not be
measured (NATS unreachable, credentials refused, no stream) is printed as
"unknown" (null in JSON, with lag_unknown saying why), never as 0.

Exit status: 0 printed (without --check, also when the lag is unknown);
1 the target database cannot be read, or with --check a lag could not be
measured (NATS unreachable or refusing the credentials, no stream); 2
usage; 3 with --check, everything was measured and a live version is not
healthy (health "live": leased, not failing, nothing in quarantine) or
has an unacknowledged gap (deletes lost upstream or removed from the
stream: projector gaps), or there is no live version.`,
		Example: `  projector status
  projector status --json | jq '.versions[] | {projection, version, state, lag_events}'
  projector status --check || echo "needs attention"
  projector status --wait   # follow rebuilds until they are ready`,
		Args: cli.NoArgs,
	}
	c := commonFlags(cmd, env)
	asJSON := jsonFlag(cmd, "the status document")
	follow := cmd.Flags().Bool("wait", false, "follow every version being built until it is ready, with a progress bar on a terminal")
	check := cmd.Flags().Bool("check", false, "exit 3 unless there is a live version and every live version is healthy, without an unacknowledged gap; exit 1 when NATS or the target cannot be read or a lag is unknown")
	var sample time.Duration
	cli.Local(cmd).Duration(&sample, "sample", "", time.Second, "while a version is being rebuilt, sample twice this far apart for events/s and ETA (0: once)", cli.NotNegative())
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		ctx := cmd.Context()
		if err := c.check(); err != nil {
			return err
		}
		pool, err := c.targetPool(ctx)
		if err != nil {
			return err
		}
		defer pool.Close()
		if err := pool.Ping(ctx); err != nil {
			return fmt.Errorf("target database %s cannot be read: %w", redact(c.targetURL), err)
		}
		var js jetstream.JetStream
		natsProblem := ""
		if nc, err := c.natsConnect(nats.Timeout(3 * time.Second)); err == nil {
			defer nc.Close()
			if js, err = jetstream.New(nc); err != nil {
				natsProblem = fmt.Sprintf("NATS %s: %v", redact(c.natsURL), err)
			}
		} else {
			natsProblem = describeNATSError(redact(c.natsURL), err)
		}
		if natsProblem != "" {
			fmt.Fprintf(env.Stderr, "projector: %s (lag unknown)\n", natsProblem)
		}
		if *follow {
			if js == nil {
				return errors.New("status --wait needs NATS: " + natsProblem)
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
		if natsProblem != "" {
			st.SetStreamError(natsProblem)
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

// describeNATSError says why status could not connect to NATS: the
// broker refused the credentials, or it could not be reached.
func describeNATSError(url string, err error) string {
	if errors.Is(err, nats.ErrAuthorization) || errors.Is(err, nats.ErrAuthExpired) || errors.Is(err, nats.ErrAuthRevoked) ||
		strings.Contains(strings.ToLower(err.Error()), "authorization violation") {
		return fmt.Sprintf("NATS %s refused the credentials (set --nats-creds, --nats-nkey or --nats-user): %v", url, err)
	}
	return fmt.Sprintf("NATS %s unreachable: %v", url, err)
}

// statusCheck is --check: every lag was measured (else exit 1), a live
// version exists and every live version's health is "live" (else exit 3).
func statusCheck(st *status.Status) error {
	unknown := st.LagsUnknown()
	if st.StreamError != "" && len(unknown) == 0 {
		unknown = append(unknown, "stream: "+st.StreamError)
	}
	if len(unknown) > 0 {
		return fmt.Errorf("status check cannot tell: %s", strings.Join(unknown, "; "))
	}
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
		// A gap readers must know of (not a truncate) and nobody has
		// accepted: the version is known to miss deletes.
		var kinds []string
		missing := 0
		for _, g := range v.GapCounts {
			if !g.Acknowledged && g.Kind != event.GapTruncate && g.Count > 0 {
				missing += g.Count
				kinds = append(kinds, g.Kind)
			}
		}
		if missing > 0 {
			bad = append(bad, fmt.Sprintf("%s v%d misses deletes: %d unacknowledged gaps (%s; projector gaps)", v.Projection, v.Version, missing, strings.Join(kinds, ", ")))
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
