package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os/user"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/epitaph-dev/epitaph/cmd/internal/cli"
	"github.com/epitaph-dev/epitaph/internal/pgdial"
	"github.com/epitaph-dev/epitaph/quarantine"
	"github.com/epitaph-dev/epitaph/restore"
)

func init() { register(restoreCommand) }

type restoreOptions struct {
	correlation, rootKey, table, key, sourceURL, onConflict, actor string
	dryRun                                                         bool
	sourceTCPTimeout                                               time.Duration
}

func restoreCommand(env *Env) *cobra.Command {
	var o restoreOptions
	cmd := &cobra.Command{
		Use:   "restore --correlation ID [--root-key JSON] [--table schema.table --key JSON]",
		Short: "put archived rows back into the source: a deleted transaction, one root's snapshot subtree, or one row",
		Long: `restore re-inserts the archived rows of one source transaction (archive.rows
.correlation_id) into the source database, in one source transaction: all
of them or none. With --root-key, only that root's snapshot subtree (the
root and every descendant archive.snapshots nests under it; --table names
the root's table when the transaction has roots of several tables); with
--table and --key, that one row.

Rows go in parents first, in the foreign-key order of the source's current
catalog; foreign keys between tables that form a cycle are deferred to the
commit (they must be DEFERRABLE). Values are rebuilt from the archive alone
and cast to the column types the events named, so a restored row equals the
deleted one by row::text. Identity columns keep their values (OVERRIDING
SYSTEM VALUE); generated columns are computed again; columns added since the
delete take their defaults; columns dropped since are reported and left out.

A row whose key exists in the source aborts the restore, naming it
(--on-conflict abort, the default), or is left as it is (skip). --dry-run
prints the plan (tables in order, row counts, deferred keys, conflicts) from a
read-only source transaction and writes nothing. Every other restore is
recorded in epitaph.restores of the target (who, when, what, outcome), and
the pending row-handler deliveries of the rows it put back stop as
stop_superseded.

Exit status: 0 restored (or planned), 1 error, 2 usage, 3 cannot: conflicts
(abort), nothing archived matches, a table is gone, a row was archived with
its key only.`,
		Example: `  projector restore --correlation 'main:7431:0/1A2B3C8' --dry-run
  projector restore --correlation 'main:7431:0/1A2B3C8' --root-key '{"id": 42}' --actor alice
  projector restore --correlation 'main:7431:0/1A2B3C8' --table public.orders --key '{"id": 7}' --on-conflict skip`,
		Args: cli.NoArgs,
	}
	c := commonFlags(cmd, env)
	f := cli.Local(cmd)
	f.String(&o.sourceURL, "source-url", "EPITAPH_SOURCE_URL", "", "the source Postgres URL to restore into")
	sourceTCPTimeoutFlag(f, &o.sourceTCPTimeout)
	cmd.Flags().StringVar(&o.correlation, "correlation", "", "the source transaction: archive.rows.correlation_id (<src>:<xid>:<commit_lsn>)")
	cmd.Flags().StringVar(&o.rootKey, "root-key", "", `restore this root's snapshot subtree only, e.g. '{"id": 42}'`)
	cmd.Flags().StringVar(&o.table, "table", "", "schema.table: of the row (--key) or of the root (--root-key)")
	cmd.Flags().StringVar(&o.key, "key", "", `restore this one row of --table, e.g. '{"id": 7}'`)
	cmd.Flags().StringVar(&o.onConflict, "on-conflict", restore.OnConflictAbort, "a row whose key exists: abort (nothing is written) or skip")
	cmd.Flags().BoolVar(&o.dryRun, "dry-run", false, "print the plan and write nothing")
	cmd.Flags().StringVar(&o.actor, "actor", "", "who restores, recorded in epitaph.restores (default: the OS user)")
	asJSON := jsonFlag(cmd, "the plan and outcome")
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		cfg, err := o.config(c.sourceName)
		if err != nil {
			return err
		}
		if o.sourceURL == "" {
			return cli.Usage("no source database: set EPITAPH_SOURCE_URL or --source-url")
		}
		srcTimeout, err := dialTimeout("source-tcp-timeout", o.sourceTCPTimeout)
		if err != nil {
			return err
		}
		ctx := cmd.Context()
		pool, err := targetPool(ctx, c)
		if err != nil {
			return err
		}
		defer pool.Close()
		source, err := pgdial.Connect(ctx, o.sourceURL, srcTimeout)
		if err != nil {
			return fmt.Errorf("connect to source %s: %w", redact(o.sourceURL), err)
		}
		defer func() { _ = source.Close(ctx) }()
		res, err := restore.Run(ctx, pool, source, cfg)
		if res != nil {
			if *asJSON {
				if werr := writeJSON(env.Stdout, res); werr != nil && err == nil {
					err = werr
				}
			} else {
				writeRestore(env.Stdout, res)
			}
		}
		var ce *restore.ConflictError
		var cn *restore.CannotError
		if errors.As(err, &ce) || errors.As(err, &cn) {
			return cli.WithCode(cli.ExitNotEqual, err)
		}
		if err != nil {
			return sanitizedError{err}
		}
		return nil
	}
	return cmd
}

// sanitizedError prints a failed restore's error as epitaph.restores and
// the console keep it (quarantine.Sanitize): the source's message may
// quote the row's values (a trigger's, an invalid input value), and a
// job's stderr goes to logs read more widely than the archive, out of an
// erasure's reach.
type sanitizedError struct{ err error }

func (e sanitizedError) Error() string { return quarantine.Sanitize(e.err) }
func (e sanitizedError) Unwrap() error { return e.err }

func (o *restoreOptions) config(source string) (restore.Config, error) {
	cfg := restore.Config{Source: source, CorrelationID: o.correlation, OnConflict: o.onConflict,
		DryRun: o.dryRun, Actor: o.actor, Table: o.table}
	switch {
	case o.correlation == "":
		return cfg, cli.Usage("restore needs --correlation ID (archive.rows.correlation_id)")
	case o.onConflict != restore.OnConflictAbort && o.onConflict != restore.OnConflictSkip:
		return cfg, cli.Usage("--on-conflict %q: want abort or skip", o.onConflict)
	case o.rootKey != "" && o.key != "":
		return cfg, cli.Usage("--root-key and --key exclude each other")
	case o.key != "" && o.table == "":
		return cfg, cli.Usage("--key needs --table schema.table")
	case o.table != "" && o.key == "" && o.rootKey == "":
		return cfg, cli.Usage("--table needs --key (one row) or --root-key (a root's subtree)")
	case o.table != "" && strings.Count(o.table, ".") != 1:
		return cfg, cli.Usage("--table %q: want schema.table", o.table)
	}
	for name, v := range map[string]string{"--root-key": o.rootKey, "--key": o.key} {
		var obj map[string]any
		if v != "" && (json.Unmarshal([]byte(v), &obj) != nil || obj == nil) {
			return cfg, cli.Usage(`%s %q: want a JSON object such as '{"id": 42}'`, name, v)
		}
	}
	if o.rootKey != "" {
		cfg.RootKey = json.RawMessage(o.rootKey)
	}
	if o.key != "" {
		cfg.Key = json.RawMessage(o.key)
	}
	if cfg.Actor == "" && !cfg.DryRun {
		u, err := user.Current()
		if err != nil || u.Username == "" {
			return cfg, cli.Usage("who restores? the OS user is unknown: pass --actor NAME")
		}
		cfg.Actor = u.Username
	}
	return cfg, nil
}

// writeRestore prints the plan and what happened.
func writeRestore(w io.Writer, r *restore.Result) {
	verb := map[bool]string{true: "plan for", false: "restore of"}[r.DryRun]
	fmt.Fprintf(w, "%s %s (%d rows, on conflict: %s)", verb, r.CorrelationID, r.Rows, r.OnConflict)
	if r.ID != 0 {
		fmt.Fprintf(w, ", recorded as epitaph.restores %d", r.ID)
	}
	fmt.Fprintln(w)
	for i, t := range r.Tables {
		fmt.Fprintf(w, "  %d. %s: %d rows", i+1, t.Table, t.Rows)
		for _, part := range []struct {
			what string
			cols []string
		}{{"dropped since (left out)", t.DroppedColumns}, {"added since (defaults)", t.AddedColumns}, {"generated", t.GeneratedColumns}} {
			if len(part.cols) > 0 {
				fmt.Fprintf(w, "; %s: %s", part.what, strings.Join(part.cols, ", "))
			}
		}
		fmt.Fprintln(w)
	}
	if len(r.Deferred) > 0 {
		fmt.Fprintf(w, "  deferred to the commit (cycle): %s\n", strings.Join(r.Deferred, ", "))
	}
	for _, c := range r.Conflicts {
		fmt.Fprintf(w, "  exists in the source: %s\n", c)
	}
	switch {
	case r.DryRun:
		fmt.Fprintln(w, "dry run: nothing written")
	case r.Outcome == restore.OutcomeRestored:
		fmt.Fprintf(w, "restored %d rows, skipped %d; %d pending deliveries stopped as stop_superseded\n", r.Restored, r.Skipped, r.Superseded)
	default:
		fmt.Fprintf(w, "%s: nothing written to the source\n", r.Outcome)
	}
}
