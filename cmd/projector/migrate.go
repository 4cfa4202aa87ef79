package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/spf13/cobra"

	"github.com/epitaph-dev/epitaph/cmd/internal/cli"
	"github.com/epitaph-dev/epitaph/migrations"
)

func init() { register(migrateCommand) }

type migrateUpOptions struct {
	dryRun   bool
	retryFor time.Duration
	asJSON   *bool
}

func migrateCommand(env *Env) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "migrate [up | status]",
		Short: "apply the epitaph control-schema migrations to the target (migrate status: what is applied and pending)",
		Long: `migrate (the same as "migrate up") applies the embedded migrations of the epitaph
control schema that the target does not have yet, each in its own transaction,
serialized by an advisory lock: every worker may run it. It refuses a schema
that is newer than this binary (a newer binary migrated it).

--retry-for keeps retrying while the target is unreachable (an init container
during a database outage) instead of failing at once.`,
		Example: `  projector migrate
  projector migrate up --dry-run
  projector migrate status --json
  projector migrate --retry-for 10m   # Kubernetes init container`,
		Args: cli.NoArgs,
	}
	c := commonFlags(cmd, env)
	o := migrateUpFlags(cmd)
	cmd.RunE = func(cmd *cobra.Command, _ []string) error { return migrateUp(cmd.Context(), c, o, env) }

	up := &cobra.Command{
		Use:     "up",
		Short:   "apply the pending migrations (--dry-run: list them)",
		Example: "  projector migrate up --dry-run\n  projector migrate up --retry-for 10m",
		Args:    cli.NoArgs,
	}
	cu := commonFlags(up, env)
	ou := migrateUpFlags(up)
	up.RunE = func(cmd *cobra.Command, _ []string) error { return migrateUp(cmd.Context(), cu, ou, env) }

	status := &cobra.Command{
		Use:     "status",
		Short:   "show the applied, pending and unknown (newer) migrations (--check: exit 3 unless up to date)",
		Example: "  projector migrate status\n  projector migrate status --check || projector migrate up",
		Args:    cli.NoArgs,
	}
	cs := commonFlags(status, env)
	asJSON := jsonFlag(status, "the migration state")
	check := status.Flags().Bool("check", false, "exit 3 when migrations are pending or the schema is newer than this binary")
	status.RunE = func(cmd *cobra.Command, _ []string) error {
		pool, err := targetPool(cmd.Context(), cs)
		if err != nil {
			return err
		}
		defer pool.Close()
		st, err := migrations.Status(cmd.Context(), pool)
		if err != nil {
			return err
		}
		if *asJSON {
			err = cli.WriteJSON(env.Stdout, st)
		} else {
			writeMigrationState(env, st)
		}
		if err != nil {
			return err
		}
		if *check && (len(st.Pending) > 0 || len(st.Unknown) > 0) {
			return cli.WithCode(cli.ExitNotEqual, fmt.Errorf("the epitaph schema is not up to date (%d pending, %d unknown)", len(st.Pending), len(st.Unknown)))
		}
		return nil
	}
	cmd.AddCommand(up, status)
	return cmd
}

func migrateUpFlags(cmd *cobra.Command) *migrateUpOptions {
	o := &migrateUpOptions{}
	cmd.Flags().BoolVar(&o.dryRun, "dry-run", false, "list the migrations that would be applied, change nothing")
	cli.Local(cmd).Duration(&o.retryFor, "retry-for", "EPITAPH_MIGRATE_RETRY_FOR", 0,
		"keep retrying with backoff this long while the target is unreachable (0: fail at once)", cli.NotNegative())
	o.asJSON = jsonFlag(cmd, "the migration state afterwards")
	return o
}

func writeMigrationState(env *Env, st migrations.State) {
	cur := 0
	if len(st.Applied) > 0 {
		cur = st.Applied[len(st.Applied)-1]
	}
	fmt.Fprintf(env.Stdout, "epitaph schema at version %d (%d migrations applied); this binary knows up to %d\n", cur, len(st.Applied), st.Latest)
	for _, m := range st.Pending {
		fmt.Fprintf(env.Stdout, "  pending: %04d_%s\n", m.Version, m.Name)
	}
	if len(st.Unknown) > 0 {
		fmt.Fprintf(env.Stdout, "  unknown to this binary (the schema is newer): %v\n", st.Unknown)
	}
}

func migrateUp(ctx context.Context, c *common, o *migrateUpOptions, env *Env) error {
	if err := c.check(); err != nil {
		return err
	}
	pool, err := c.targetPool(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	var st migrations.State
	attempt := func() error {
		var err error
		if st, err = migrations.Status(ctx, pool); err != nil {
			return err
		}
		if len(st.Unknown) > 0 {
			return backoff.Permanent(&migrations.NewerSchemaError{Unknown: st.Unknown, Latest: st.Latest})
		}
		if o.dryRun {
			return nil
		}
		if err := migrations.Apply(ctx, pool); err != nil {
			return err
		}
		st, err = migrations.Status(ctx, pool)
		return err
	}
	if o.retryFor > 0 {
		b := backoff.NewExponentialBackOff(backoff.WithMaxElapsedTime(o.retryFor), backoff.WithMaxInterval(15*time.Second))
		err = backoff.RetryNotify(func() error {
			err := attempt()
			if err != nil && !transientDB(err) {
				return backoff.Permanent(err)
			}
			return err
		}, backoff.WithContext(b, ctx), func(err error, next time.Duration) {
			env.Logger.Warn("migrate: target not reachable, retrying", "err", redact(err.Error()), "in", next.Round(time.Millisecond))
		})
	} else {
		err = attempt()
	}
	if err != nil {
		return err
	}
	if *o.asJSON {
		return cli.WriteJSON(env.Stdout, st)
	}
	if o.dryRun {
		if len(st.Pending) == 0 {
			fmt.Fprintln(env.Stdout, "dry run: nothing to apply")
		} else {
			names := make([]string, len(st.Pending))
			for i, m := range st.Pending {
				names[i] = fmt.Sprintf("%04d_%s", m.Version, m.Name)
			}
			fmt.Fprintf(env.Stdout, "dry run: would apply %s\n", strings.Join(names, ", "))
		}
	}
	writeMigrationState(env, st)
	return nil
}

// transientDB reports a failure to reach the target (connection refused,
// server starting or shutting down, too many connections), which a retry
// may get past, as opposed to a failing migration.
func transientDB(err error) bool {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return strings.HasPrefix(pgErr.Code, "08") || strings.HasPrefix(pgErr.Code, "57P") || pgErr.Code == "53300"
	}
	var ce *pgconn.ConnectError
	return errors.As(err, &ce) || pgconn.Timeout(err) || pgconn.SafeToRetry(err)
}
