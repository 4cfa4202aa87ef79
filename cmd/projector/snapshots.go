package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/epitaph-dev/epitaph/projection"
	"github.com/epitaph-dev/epitaph/projection/snapshot"
)

func init() {
	register("snapshots", Command{
		Summary: "snapshot documents: show <correlation-id> | batch (run batches until none is due)",
		Run:     snapshotsCmd,
	})
}

func snapshotsCmd(ctx context.Context, args []string, env *Env) error {
	if len(args) == 0 {
		return errors.New("usage: projector snapshots show <correlation-id> | projector snapshots batch")
	}
	switch args[0] {
	case "show":
		return snapshotsShow(ctx, args[1:], env)
	case "batch":
		return snapshotsBatch(ctx, args[1:], env)
	default:
		return fmt.Errorf("unknown snapshots subcommand %q (want show or batch)", args[0])
	}
}

// parseInterspersed parses flags that may come before or after positional
// arguments ("show <id> --version 2").
func parseInterspersed(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		if fs.NArg() == 0 {
			return pos, nil
		}
		pos = append(pos, fs.Arg(0))
		args = fs.Args()[1:]
	}
}

func snapshotsShow(ctx context.Context, args []string, env *Env) error {
	fs := newFlagSet("snapshots show", env)
	c := commonFlags(fs, env)
	version := fs.Int("version", 0, "read archive_v<N> instead of the live version (the archive.snapshots view)")
	pos, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return errors.New("usage: projector snapshots show [--version N] <correlation-id> (\"<src>:<xid>:<commit_lsn>\")")
	}
	if err := c.check(); err != nil {
		return err
	}
	pool, err := pgxpool.New(ctx, c.targetURL)
	if err != nil {
		return fmt.Errorf("connect to target %s: %w", redact(c.targetURL), err)
	}
	defer pool.Close()
	schema := projection.ReaderSchema
	if *version > 0 {
		schema = projection.ArchiveSchema(*version)
	}
	list, err := snapshot.Show(ctx, pool, schema, pos[0])
	if err != nil {
		return err
	}
	if len(list) == 0 {
		return fmt.Errorf("no snapshots for %q in %s (not a transaction that deleted a root row, or not applied yet)", pos[0], schema)
	}
	enc := json.NewEncoder(env.Stdout)
	enc.SetIndent("", "  ")
	return enc.Encode(list)
}

func snapshotsBatch(ctx context.Context, args []string, env *Env) error {
	fs := newFlagSet("snapshots batch", env)
	c := commonFlags(fs, env)
	version := fs.Int("version", 0, "work on archive_v<N> (default: the live version)")
	size := fs.Int("batch-size", intEnv(env, "EPITAPH_SNAPSHOT_BATCH_SIZE", 50), "jobs per batch (EPITAPH_SNAPSHOT_BATCH_SIZE)")
	attempts := fs.Int("max-attempts", intEnv(env, "EPITAPH_SNAPSHOT_MAX_ATTEMPTS", 8), "attempts before an incomplete group fails (EPITAPH_SNAPSHOT_MAX_ATTEMPTS)")
	delay := fs.Duration("retry-delay", durationEnv(env, "EPITAPH_SNAPSHOT_RETRY_DELAY", 5*time.Second), "first retry delay, doubling (EPITAPH_SNAPSHOT_RETRY_DELAY)")
	if _, err := parseInterspersed(fs, args); err != nil {
		return err
	}
	if err := env.envErr(); err != nil {
		return err
	}
	if err := c.check(); err != nil {
		return err
	}
	pool, err := pgxpool.New(ctx, c.targetURL)
	if err != nil {
		return fmt.Errorf("connect to target %s: %w", redact(c.targetURL), err)
	}
	defer pool.Close()
	schema, err := snapshotSchema(ctx, pool, *version)
	if err != nil {
		return err
	}
	cfg := snapshot.Config{Schema: schema, BatchSize: *size, MaxAttempts: *attempts, RetryDelay: *delay,
		MaxRetryDelay: max(*delay, 5*time.Minute)}
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
		if res.Claimed < *size {
			break
		}
	}
	fmt.Fprintf(env.Stdout, "%s: claimed %d, complete %d, retry later %d, failed %d\n",
		schema, total.Claimed, total.Completed, total.Retried, total.Failed)
	return nil
}

// snapshotSchema is archive_v<version>, or the live version's schema.
func snapshotSchema(ctx context.Context, pool *pgxpool.Pool, version int) (string, error) {
	if version > 0 {
		return projection.ArchiveSchema(version), nil
	}
	versions, err := projection.ListVersions(ctx, pool, "archive")
	if err != nil {
		return "", err
	}
	var live []string
	for _, v := range versions {
		if v.State == projection.StateLive {
			live = append(live, v.Schema)
		}
	}
	if len(live) != 1 {
		return "", fmt.Errorf("no single live archive version (found %q): pass --version", strings.Join(live, ","))
	}
	return live[0], nil
}
