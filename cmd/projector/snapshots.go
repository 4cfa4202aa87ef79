package main

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"

	"github.com/epitaph-dev/epitaph/cmd/internal/cli"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/snapshot"
	"github.com/epitaph-dev/epitaph/projection/version"
)

func init() { register(snapshotsCommand) }

func snapshotsCommand(env *Env) *cobra.Command {
	cmd := cli.Group(&cobra.Command{
		Use:   "snapshots <show | batch>",
		Short: "snapshot documents: show <correlation-id> | batch (run batches until none is due)",
	})
	cmd.AddCommand(snapshotsShowCommand(env), snapshotsBatchCommand(env))
	return cmd
}

func snapshotsShowCommand(env *Env) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "show <correlation-id>",
		Short: "print the snapshot documents of a source transaction (JSON)",
		Long: `show prints, as JSON, the snapshot documents of the transaction
"<src>:<xid>:<commit_lsn>" from archive.snapshots (the live version), or from
archive_v<N> with --version.`,
		Example: `  projector snapshots show main:7431:0/1A2B3C8`,
		Args:    cli.Args(1),
	}
	c := commonFlags(cmd, env)
	version := cmd.Flags().Int("version", 0, "read archive_v<N> instead of the live version (the archive.snapshots view)")
	cmd.RunE = func(cmd *cobra.Command, pos []string) error {
		ctx := cmd.Context()
		pool, err := targetPool(ctx, c)
		if err != nil {
			return err
		}
		defer pool.Close()
		schema := archive.ReaderSchema
		if *version > 0 {
			schema = archive.Schema(*version)
		}
		list, err := snapshot.Show(ctx, pool, schema, pos[0])
		if err != nil {
			return err
		}
		if len(list) == 0 {
			return fmt.Errorf("no snapshots for %q in %s (not a transaction that deleted a root row, or not applied yet)", pos[0], schema)
		}
		return writeJSON(env.Stdout, list)
	}
	return cmd
}

func snapshotsBatchCommand(env *Env) *cobra.Command {
	cmd := &cobra.Command{
		Use:     "batch",
		Short:   "run snapshot batches until none is due, then exit (for a cron job)",
		Example: `  projector snapshots batch --batch-size 100`,
		Args:    cli.NoArgs,
	}
	c := commonFlags(cmd, env)
	version := cmd.Flags().Int("version", 0, "work on archive_v<N> (default: the live version)")
	var size, attempts int
	var delay time.Duration
	f := cli.Local(cmd)
	f.Int(&size, "batch-size", "EPITAPH_SNAPSHOT_BATCH_SIZE", 50, "jobs per batch", cli.Positive())
	f.Int(&attempts, "max-attempts", "EPITAPH_SNAPSHOT_MAX_ATTEMPTS", 8, "attempts before an incomplete group fails", cli.Positive())
	f.Duration(&delay, "retry-delay", "EPITAPH_SNAPSHOT_RETRY_DELAY", 5*time.Second, "first retry delay, doubling", cli.Positive())
	asJSON := jsonFlag(cmd, "the totals")
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		ctx := cmd.Context()
		pool, err := targetPool(ctx, c)
		if err != nil {
			return err
		}
		defer pool.Close()
		schema, err := snapshotSchema(ctx, pool, *version)
		if err != nil {
			return err
		}
		cfg := snapshot.Config{Schema: schema, BatchSize: size, MaxAttempts: attempts, RetryDelay: delay,
			MaxRetryDelay: max(delay, 5*time.Minute)}
		var total snapshot.Result
		for {
			res, err := snapshot.RunBatch(ctx, pool, cfg)
			if err != nil {
				return err
			}
			total.Claimed += res.Claimed
			total.Completed += res.Completed
			total.Retried += res.Retried
			total.Failed += res.Failed
			if res.Claimed < size {
				break
			}
		}
		if *asJSON {
			return writeJSON(env.Stdout, map[string]any{"schema": schema, "claimed": total.Claimed, "completed": total.Completed,
				"retried": total.Retried, "failed": total.Failed})
		}
		fmt.Fprintf(env.Stdout, "%s: claimed %d, complete %d, retry later %d, failed %d\n",
			schema, total.Claimed, total.Completed, total.Retried, total.Failed)
		return nil
	}
	return cmd
}

// snapshotSchema is archive_v<n>, or the live version's schema.
func snapshotSchema(ctx context.Context, pool *pgxpool.Pool, n int) (string, error) {
	if n > 0 {
		return archive.Schema(n), nil
	}
	versions, err := version.ListVersions(ctx, pool, "archive")
	if err != nil {
		return "", err
	}
	var live []string
	for _, v := range versions {
		if v.State == version.StateLive {
			live = append(live, v.Schema)
		}
	}
	if len(live) != 1 {
		return "", fmt.Errorf("no single live archive version (found %q): pass --version", strings.Join(live, ","))
	}
	return live[0], nil
}
