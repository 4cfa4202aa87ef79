package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"os/user"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/spf13/cobra"

	"github.com/epitaph-dev/epitaph/cmd/internal/cli"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/erasure"
	"github.com/epitaph-dev/epitaph/projection/retention"
)

// Retention and erasure: cleanup, hold, erase, erasures.
func init() {
	register(cleanupCommand)
	register(holdCommand)
	register(eraseCommand)
	register(erasuresCommand)
}

func cleanupCommand(env *Env) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "cleanup [--batch N]",
		Short: "run one retention batch (delete expired archive rows of every version) and exit",
		Long: `cleanup deletes at most --batch expired archive rows (oldest first, over every
version), with the snapshot documents rooted at them and the snapshot groups
left without rows, and exits: for cron or a serverless host. Rows under a legal
hold (projector hold) or with a pending or in-flight delivery are kept. Every
"projector run" also runs batches in the background (--cleanup-interval).`,
		Example: `  projector cleanup --batch 10000 --json`,
		Args:    cli.NoArgs,
	}
	c := commonFlags(cmd, env)
	var batch int
	var timeout time.Duration
	f := cli.Local(cmd)
	f.Int(&batch, "batch", "EPITAPH_CLEANUP_BATCH", retention.DefaultCleanupBatch, "most rows deleted", cli.Min(1), cli.Max(retention.MaxCleanupBatch))
	f.Duration(&timeout, "timeout", "EPITAPH_CLEANUP_TIMEOUT", 10*time.Second, "statement timeout", cli.Positive())
	asJSON := jsonFlag(cmd, "what the batch deleted (counts, never values)")
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		ctx := cmd.Context()
		return withTargetPool(ctx, c, func(pool *pgxpool.Pool) error {
			if err := migrations.Apply(ctx, pool); err != nil {
				return err
			}
			res, err := retention.CleanupBatch(ctx, pool, retention.CleanupOptions{Batch: batch, StatementTimeout: timeout})
			if err != nil {
				return err
			}
			if *asJSON {
				return writeJSON(env.Stdout, res)
			}
			fmt.Fprintf(env.Stdout, "deleted %d expired rows (%d snapshots, %d groups, %d deliveries) in %s", res.Deleted, res.Snapshots, res.Groups, res.Deliveries,
				res.Duration.Round(time.Millisecond))
			for _, t := range slices.Sorted(maps.Keys(res.ByTable)) {
				fmt.Fprintf(env.Stdout, "; %s %d", t, res.ByTable[t])
			}
			fmt.Fprintln(env.Stdout)
			if res.Full {
				fmt.Fprintln(env.Stdout, "the batch was full: more rows may be due")
			}
			if len(res.Skipped) > 0 {
				fmt.Fprintf(env.Stdout, "skipped %s: another cleaner is cleaning it\n", strings.Join(res.Skipped, ", "))
			}
			return nil
		})
	}
	return cmd
}

// selectorFlags are --table, --key and --match.
type selectorFlags struct{ table, key, match string }

func addSelectorFlags(cmd *cobra.Command, what string) *selectorFlags {
	s := &selectorFlags{}
	cmd.Flags().StringVar(&s.table, "table", "", "source table, schema.table (required)")
	cmd.Flags().StringVar(&s.key, "key", "", what+" the row with exactly this key, a JSON object like '{\"id\": 42}'")
	cmd.Flags().StringVar(&s.match, "match", "", what+" the rows whose row image has these top-level values, a JSON object like '{\"email\": \"ann@example.com\"}'")
	return s
}

func (s *selectorFlags) parse() (key, match json.RawMessage, err error) {
	if s.table == "" {
		return nil, nil, cli.Usage("--table schema.table is required")
	}
	if (s.key == "") == (s.match == "") {
		return nil, nil, cli.Usage("give exactly one of --key JSON and --match JSON")
	}
	for _, v := range []string{s.key, s.match} {
		if v != "" && !json.Valid([]byte(v)) {
			return nil, nil, cli.Usage("--key/--match: not valid JSON (the value is not shown)")
		}
	}
	if s.key != "" {
		key = json.RawMessage(s.key)
	} else {
		match = json.RawMessage(s.match)
	}
	return key, match, nil
}

func osUser() string {
	if u, err := user.Current(); err == nil && u.Username != "" {
		return u.Username
	}
	if u := os.Getenv("USER"); u != "" {
		return u
	}
	return "unknown"
}

func usageIfBadSelector(err error) error {
	if errors.Is(err, erasure.ErrBadSelector) {
		return cli.Usage("%w", err)
	}
	return err
}

func holdCommand(env *Env) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "hold add|list|remove",
		Short: "legal holds: keep archived rows past their expiry (add --table T (--key|--match) --reason R | list | remove ID)",
		Long: `A legal hold keeps the archived rows it covers past their expires_at: retention
cleanup does not delete them (they stay hidden from archive.rows once expired).
Removing the hold lets the next cleanup batch delete them.`,
		Args: cli.NoArgs,
	}
	cmd.AddCommand(holdAddCommand(env), holdListCommand(env), holdRemoveCommand(env))
	return cli.Group(cmd)
}

func holdAddCommand(env *Env) *cobra.Command {
	cmd := &cobra.Command{
		Use:     "add --table schema.table (--key JSON | --match JSON) --reason TEXT",
		Short:   "add a legal hold",
		Example: `  projector hold add --table public.customers --key '{"id": 42}' --reason "case 2026-117"`,
		Args:    cli.NoArgs,
	}
	c := commonFlags(cmd, env)
	sel := addSelectorFlags(cmd, "hold")
	reason := cmd.Flags().String("reason", "", "why (required; kept with the hold)")
	actor := cmd.Flags().String("actor", "", "who (default: the OS user)")
	asJSON := jsonFlag(cmd, "the hold")
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		key, match, err := sel.parse()
		if err != nil {
			return err
		}
		if *reason == "" {
			return cli.Usage("hold add needs --reason TEXT")
		}
		if *actor == "" {
			*actor = osUser()
		}
		ctx := cmd.Context()
		return withTargetPool(ctx, c, func(pool *pgxpool.Pool) error {
			if err := migrations.Apply(ctx, pool); err != nil {
				return err
			}
			h, err := erasure.AddLegalHold(ctx, pool, erasure.LegalHoldOptions{
				Table: sel.table, Key: key, Match: match, Reason: *reason, Actor: *actor})
			if err != nil {
				return usageIfBadSelector(err)
			}
			if *asJSON {
				return writeJSON(env.Stdout, h)
			}
			fmt.Fprintf(env.Stdout, "legal hold %d on %s added\n", h.ID, h.Table)
			return nil
		})
	}
	return cmd
}

func holdListCommand(env *Env) *cobra.Command {
	cmd := &cobra.Command{Use: "list", Short: "list legal holds", Args: cli.NoArgs}
	c := commonFlags(cmd, env)
	asJSON := jsonFlag(cmd, "the holds")
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		ctx := cmd.Context()
		return withTargetPool(ctx, c, func(pool *pgxpool.Pool) error {
			hs, err := erasure.ListLegalHolds(ctx, pool)
			if err != nil {
				return err
			}
			if *asJSON {
				return writeJSONList(env.Stdout, hs)
			}
			if len(hs) == 0 {
				fmt.Fprintln(env.Stdout, "no legal holds")
			}
			for _, h := range hs {
				sel := "key " + string(h.Key)
				if h.Match != nil {
					sel = "match " + string(h.Match)
				}
				fmt.Fprintf(env.Stdout, "%d\t%s\t%s\t%s by %s at %s\n", h.ID, h.Table, sel, h.Reason, h.CreatedBy, h.CreatedAt.UTC().Format(time.RFC3339))
			}
			return nil
		})
	}
	return cmd
}

func holdRemoveCommand(env *Env) *cobra.Command {
	cmd := &cobra.Command{Use: "remove <id>", Short: "remove a legal hold (its expired rows go with the next cleanup)", Args: cli.Args(1)}
	c := commonFlags(cmd, env)
	cmd.RunE = func(cmd *cobra.Command, pos []string) error {
		id, err := strconv.ParseInt(pos[0], 10, 64)
		if err != nil || id <= 0 {
			return cli.Usage("hold id %q: want a positive number", pos[0])
		}
		ctx := cmd.Context()
		return withTargetPool(ctx, c, func(pool *pgxpool.Pool) error {
			ok, err := erasure.RemoveLegalHold(ctx, pool, id)
			if err != nil {
				return err
			}
			if !ok {
				return cli.WithCode(3, fmt.Errorf("no legal hold %d", id))
			}
			fmt.Fprintf(env.Stdout, "legal hold %d removed\n", id)
			return nil
		})
	}
	return cmd
}

func eraseCommand(env *Env) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "erase --table schema.table (--key JSON | --match JSON) [--with-children] [--reason TEXT] [--purge-stream] [--yes] [--ignore-holds]",
		Short: "erase rows for good: from every version, snapshot, quarantine entry and delivery, and from rebuilds (a fence)",
		Long: `erase records an erasure (a fence in epitaph.erasures that holds a keyed hash of
the matched values, never the values) and removes the matching rows from every
version's archive, the snapshot documents rooted at them (other documents of
their transactions are rebuilt without them), the payloads of their quarantine
entries and deliveries (pending deliveries stop as stop_revoked). Every
version's apply, rebuilds included, skips fenced rows from then on.
--with-children also erases the rows of the same transactions that reference an
erased row by foreign key. --purge-stream also securely deletes the matching
messages (and their large-row objects) from the stream, and checks they are
gone; it needs the erase NATS role (--nats-creds <capture data dir>/nats/erase.creds
with the embedded broker, --nats-user erase with deploy/nats/nats.conf): running
projectors' credentials may not delete messages (checked first: exit 3, nothing
erased). Running it again is harmless. A row under a legal hold is not erased:
the command changes nothing and exits 3 (--ignore-holds erases it anyway).
Exit status 3 also when the stream refuses deletes.`,
		Example: `  projector erase --table public.customers --match '{"email": "ann@example.com"}' --with-children --reason "GDPR request 12" --yes`,
		Args:    cli.NoArgs,
	}
	c := commonFlags(cmd, env)
	sel := addSelectorFlags(cmd, "erase")
	withChildren := cmd.Flags().Bool("with-children", false, "also erase rows of the same transaction that reference an erased row by foreign key (transitively)")
	reason := cmd.Flags().String("reason", "", "why (kept on the receipt)")
	purge := cmd.Flags().Bool("purge-stream", false, "also securely delete the matching messages and objects from the stream")
	yes := cmd.Flags().BoolP("yes", "y", false, "do not ask for confirmation (scripts)")
	actor := cmd.Flags().String("actor", "", "who erases (default: the OS user)")
	ignoreHolds := cmd.Flags().Bool("ignore-holds", false, "erase rows under a legal hold too (otherwise refused, exit 3)")
	asJSON := jsonFlag(cmd, "the receipt")
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		key, match, err := sel.parse()
		if err != nil {
			return err
		}
		if *actor == "" {
			*actor = osUser()
		}
		if !*yes {
			if err := confirm(env, fmt.Sprintf("erase the matching rows of %s from every version, for good?", sel.table), "erase"); err != nil {
				return err
			}
		}
		ctx := cmd.Context()
		pool, err := targetPool(ctx, c)
		if err != nil {
			return err
		}
		defer pool.Close()
		if err := migrations.Apply(ctx, pool); err != nil {
			return err
		}
		var js jetstream.JetStream
		if *purge {
			// Connect first: a purge that cannot reach the stream should fail
			// before anything is recorded.
			nc, err := c.natsConnect(nats.Name("epitaph-projector erase"), nats.Timeout(5*time.Second))
			if err != nil {
				return fmt.Errorf("connect to NATS %s: %w", redact(c.natsURL), err)
			}
			defer nc.Close()
			if js, err = jetstream.New(nc); err != nil {
				return fmt.Errorf("jetstream: %w", err)
			}
			if err := erasure.CheckPurge(ctx, js, c.sourceName); err != nil {
				if errors.Is(err, erasure.ErrStreamDeniesDeletes) {
					return cli.WithCode(3, err)
				}
				return err
			}
		}
		rc, err := erasure.Erase(ctx, pool, erasure.EraseOptions{Table: sel.table, Key: key, Match: match,
			WithChildren: *withChildren, Reason: *reason, Actor: *actor, PurgeStream: *purge, IgnoreHolds: *ignoreHolds})
		if errors.Is(err, erasure.ErrHeld) {
			return cli.WithCode(3, err)
		}
		if err != nil {
			return usageIfBadSelector(err)
		}
		if *purge {
			if rc, err = erasure.PurgeStream(ctx, pool, js, c.sourceName, rc.ID); err != nil {
				if errors.Is(err, erasure.ErrStreamDeniesDeletes) {
					return cli.WithCode(3, err)
				}
				return err
			}
		}
		if *asJSON {
			return writeJSON(env.Stdout, rc)
		}
		writeReceipt(env, rc, false)
		return nil
	}
	return cmd
}

// writeReceipt prints one receipt on a line; withTime adds when it was
// recorded (the listing: erase's own receipt is of now).
func writeReceipt(env *Env, rc erasure.Receipt, withTime bool) {
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(rc.Removed)) {
		parts = append(parts, fmt.Sprintf("%s %d", k, rc.Removed[k]))
	}
	removed := "nothing (nothing archived matches yet; the fence keeps later arrivals out)"
	if len(parts) > 0 {
		removed = strings.Join(parts, ", ")
	}
	reason := ""
	if rc.Reason != nil {
		reason = " (" + *rc.Reason + ")"
	}
	unchecked := ""
	for _, k := range slices.Sorted(maps.Keys(rc.Unchecked)) {
		unchecked += fmt.Sprintf("; could not check %s %d (undecodable, not matched by what could be read)", k, rc.Unchecked[k])
	}
	actor := rc.Actor
	if withTime {
		actor += " at " + rc.CreatedAt.UTC().Format(time.RFC3339)
	}
	fmt.Fprintf(env.Stdout, "erasure %d of %s by %s [%s] by %s%s, %d run(s): removed %s%s\n", rc.ID, rc.Table, rc.Mode,
		strings.Join(rc.Columns, ","), actor, reason, rc.Runs, removed, unchecked)
}

func erasuresCommand(env *Env) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "erasures",
		Short: "list erasure receipts: when, who, why, what was removed where and how many (never the data)",
		Args:  cli.NoArgs,
	}
	c := commonFlags(cmd, env)
	asJSON := jsonFlag(cmd, "the receipts")
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		ctx := cmd.Context()
		return withTargetPool(ctx, c, func(pool *pgxpool.Pool) error {
			rs, err := erasure.ListErasures(ctx, pool)
			if err != nil {
				return err
			}
			if *asJSON {
				return writeJSONList(env.Stdout, rs)
			}
			if len(rs) == 0 {
				fmt.Fprintln(env.Stdout, "no erasures")
			}
			for _, rc := range rs {
				writeReceipt(env, rc, true)
			}
			return nil
		})
	}
	return cmd
}
