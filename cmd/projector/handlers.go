package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/spf13/cobra"

	"github.com/epitaph-dev/epitaph/cmd/internal/cli"
	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/status"
	"github.com/epitaph-dev/epitaph/quarantine"
)

func init() {
	register(handlersCommand)
	register(deliveriesCommand)
}

func handlersCommand(env *Env) *cobra.Command {
	cmd := cli.Group(&cobra.Command{
		Use:   "handlers <add | list | show | enable | disable | revoke | remove | rotate-secret>",
		Short: "row handlers (side effects of archived deletes): add | list | show | enable | disable | revoke | remove | rotate-secret",
		Long: `A row handler runs for every archived row of one source table, at least once:
a webhook (POST of a JSON body, signed as Standard Webhooks with the whsec_
secret in --secret-file), a command (JSON on
stdin, no shell) or a NATS subject (JetStream, Nats-Msg-Id = delivery id). Its
deliveries are queued in the transaction that archives the row, by the live
version only, and run by every "projector run" (see "projector deliveries").
disable pauses (deliveries wait), revoke stops its open deliveries
(stop_revoked), remove deletes it (open deliveries end stop_completed),
rotate-secret writes a new webhook secret and signs with both for a while.`,
		Example: `  projector handlers add --table public.attachments \
    --kind webhook --target https://blobs.internal/purge --columns blob_name --secret-file /etc/epitaph/hook.secret
  projector handlers add --id 5d1e... --table public.orders --kind exec --target '["/usr/local/bin/reindex","--delete"]'
  projector handlers list --json`,
	})
	cmd.AddCommand(handlersAddCommand(env), handlersListCommand(env), handlersShowCommand(env),
		handlersToggleCommand(env, "enable", true), handlersToggleCommand(env, "disable", false),
		handlersEndCommand(env, "revoke"), handlersEndCommand(env, "remove"), handlersRotateSecretCommand(env))
	return cmd
}

func handlersAddCommand(env *Env) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "add [--id UUID] --table schema.table --kind webhook|exec|nats --target URL|COMMAND|SUBJECT",
		Short: "add a row handler (without --id, a generated id is printed)",
		Example: `  projector handlers add --table public.attachments --kind webhook \
    --target https://blobs.internal/purge --columns blob_name --phase after-group --secret-file /etc/epitaph/hook.secret
  projector handlers add --id 0b6f5e43-3d0e-4c2b-9a51-6f7f2a8c1e90 --table public.orders --kind nats --target orders.deleted`,
		Args: cli.NoArgs,
	}
	c := commonFlags(cmd, env)
	var d handler.Def
	var table, columns string
	var noRevalidate bool
	fs := cmd.Flags()
	fs.StringVar(&d.ID, "id", "", "the handler's stable id (a UUID; default: a random one, printed)")
	fs.StringVar(&d.Name, "name", "", "a name for people (the id is the identity)")
	fs.StringVar(&table, "table", "", "the source table, schema.table (required)")
	fs.StringVar(&d.Kind, "kind", "", "webhook, exec or nats (go: a handler an embedding program registered under --target)")
	fs.StringVar(&d.Target, "target", "", `webhook: URL; exec: a JSON array of arguments ("[\"/bin/purge\",\"-q\"]", no shell); nats: subject`)
	fs.IntVar(&d.Priority, "priority", 0, "handlers of one row run in priority order, lowest first, each after the previous one is terminal")
	fs.StringVar(&d.Phase, "phase", handler.PhaseImmediate, "immediate (once the row is archived and verified) or after-group (once its source transaction's commit is applied)")
	fs.StringVar(&columns, "columns", "", "comma-separated columns the delivery keeps besides the key (default: the key only)")
	fs.IntVar(&d.MaxAttempts, "max-attempts", 25, "attempts before a delivery is dead")
	fs.DurationVar(&d.Backoff, "backoff", time.Second, "base of the exponential backoff between attempts")
	fs.DurationVar(&d.ClaimTimeout, "claim-timeout", 5*time.Minute, "how long an attempt holds its claim; the handler must finish within 9/10 of it")
	fs.StringVar(&d.SecretFile, "secret-file", "", "webhook: a file holding the signing secret, whsec_<base64> (Standard Webhooks; the old raw form is deprecated); read again at most a second after it changes, never stored")
	fs.BoolVar(&noRevalidate, "no-revalidate", false, "do not revalidate a delivery against the source before each attempt")
	fs.IntVar(&d.BatchSize, "batch-size", 1, "webhook: one POST of up to this many deliveries, {\"deliveries\": [...]}, acknowledged or failed as a whole (1: each alone)")
	fs.DurationVar(&d.BatchWait, "batch-wait", 100*time.Millisecond, "webhook with --batch-size > 1: send a partial batch once its first delivery waited this long (at most a tenth of --claim-timeout)")
	asJSON := jsonFlag(cmd, "the handler")
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		ctx := cmd.Context()
		if table == "" || d.Kind == "" || d.Target == "" {
			return cli.Usage("handlers add needs --table, --kind and --target")
		}
		generated := d.ID == ""
		if generated {
			d.ID = handler.NewID()
		}
		schema, name, ok := strings.Cut(table, ".")
		if !ok || schema == "" || name == "" || strings.Contains(name, ".") {
			return cli.Usage("--table %q: want schema.table", table)
		}
		d.Schema, d.Table, d.Columns, d.Revalidate = schema, name, splitList(columns), !noRevalidate
		if err := d.Validate(); err != nil {
			return cli.Usage("%w", err)
		}
		if d.SecretFile != "" {
			if d.Kind != handler.KindWebhook {
				return cli.Usage("--secret-file signs webhooks only")
			}
			// Stored as an absolute path: the projectors read it from
			// their own working directories.
			abs, err := filepath.Abs(d.SecretFile)
			if err != nil {
				return cli.Usage("--secret-file %s: %w", d.SecretFile, err)
			}
			d.SecretFile = abs
			secrets, err := handler.ReadSecrets(d.SecretFile)
			if errors.Is(err, os.ErrNotExist) || errors.Is(err, os.ErrPermission) {
				return cli.Usage("--secret-file %s cannot be read", d.SecretFile)
			}
			if err != nil {
				return cli.Usage("--secret-file %w", err)
			}
			if secrets[0].Raw {
				fmt.Fprintf(env.Stderr, "note: --secret-file holds a raw secret (deprecated): write it as whsec_<base64>, e.g. "+
					"printf 'whsec_%%s\\n' \"$(tr -d '\\r\\n' < %s | base64 -w0)\" (the same key)\n", d.SecretFile)
			}
		}
		if d.Kind == handler.KindWebhook && d.RedactedTarget() != d.Target {
			fmt.Fprintln(env.Stderr, "note: the URL's query is stored in clear in the target database and hidden in every output; "+
				"a receiver should authenticate deliveries by their signature (--secret-file)")
		}
		return withTargetPool(ctx, c, func(pool *pgxpool.Pool) error {
			if err := migrations.Apply(ctx, pool); err != nil {
				return err
			}
			if err := handler.Add(ctx, pool, d); err != nil {
				return err
			}
			got, err := handler.Get(ctx, pool, d.ID)
			if err != nil {
				return err
			}
			if *asJSON {
				return writeJSON(env.Stdout, handlerJSON(got))
			}
			fmt.Fprintf(env.Stdout, "added handler %s (%s %s) for %s\n", got.ID, got.Kind, got.Phase, got.QualifiedTable())
			if generated {
				fmt.Fprintf(env.Stdout, "its id was generated: keep it for handlers show, disable, revoke and remove (handlers list shows it too)\n")
			}
			return nil
		})
	}
	return cmd
}

// handlerOut is a handler as --json prints it.
type handlerOut struct {
	handler.Def
	Backoff      string `json:"backoff"`
	ClaimTimeout string `json:"claim_timeout"`
	BatchWait    string `json:"batch_wait"`
}

func handlerJSON(d handler.Def) handlerOut {
	if d.Columns == nil {
		d.Columns = []string{}
	}
	d.Target = d.RedactedTarget()
	return handlerOut{Def: d, Backoff: d.Backoff.String(), ClaimTimeout: d.ClaimTimeout.String(), BatchWait: d.BatchWait.String()}
}

func handlersListCommand(env *Env) *cobra.Command {
	cmd := &cobra.Command{Use: "list", Short: "list the row handlers", Example: "  projector handlers list --json", Args: cli.NoArgs}
	c := commonFlags(cmd, env)
	asJSON := jsonFlag(cmd, "the handlers")
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		ctx := cmd.Context()
		return withTargetPool(ctx, c, func(pool *pgxpool.Pool) error {
			defs, err := handler.List(ctx, pool)
			if err != nil {
				return err
			}
			if *asJSON {
				out := make([]handlerOut, len(defs))
				for i, d := range defs {
					out[i] = handlerJSON(d)
				}
				return writeJSON(env.Stdout, out)
			}
			writeHandlers(env.Stdout, defs)
			return nil
		})
	}
	return cmd
}

func handlerStatus(d handler.Def) string {
	switch {
	case d.RevokedAt != nil:
		return "revoked"
	case !d.Enabled:
		return "disabled"
	}
	return "enabled"
}

func writeHandlers(w io.Writer, defs []handler.Def) {
	writeTable(w, "ID\tNAME\tTABLE\tKIND\tPHASE\tPRIORITY\tSTATUS\tTARGET", defs, "(no handlers)", func(w io.Writer, d handler.Def) {
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%d\t%s\t%s\n", d.ID, d.Name, d.QualifiedTable(), d.Kind, d.Phase, d.Priority,
			handlerStatus(d), d.RedactedTarget())
	})
}

func handlersShowCommand(env *Env) *cobra.Command {
	cmd := &cobra.Command{Use: "show <id>", Short: "show one handler with its deliveries by state",
		Example: "  projector handlers show 0b6f5e43-3d0e-4c2b-9a51-6f7f2a8c1e90", Args: cli.Args(1)}
	c := commonFlags(cmd, env)
	asJSON := jsonFlag(cmd, "the handler and its deliveries by state")
	cmd.RunE = func(cmd *cobra.Command, args []string) error {
		ctx := cmd.Context()
		if !handler.ValidID(args[0]) {
			return cli.Usage("handler id %q: want a UUID", args[0])
		}
		return withTargetPool(ctx, c, func(pool *pgxpool.Pool) error {
			d, err := handler.Get(ctx, pool, args[0])
			if err != nil {
				return notFound(err)
			}
			stats, err := handler.Stats(ctx, pool)
			if err != nil {
				return err
			}
			counts := map[string]int64{}
			for _, s := range handler.States {
				counts[s] = 0
			}
			var atLeast []string
			var oldest float64
			for _, s := range stats {
				if s.HandlerID == d.ID && s.State != "" {
					counts[s.State] = s.Count
					if s.AtLeast {
						atLeast = append(atLeast, s.State)
					}
					if s.State == handler.StatePending {
						oldest = s.OldestSec
					}
				}
			}
			var cursor *handler.CursorBacklog
			if d.UsesCursor() {
				bs, err := handler.CursorBacklogs(ctx, pool, []handler.Def{d})
				if err != nil {
					return err
				}
				cursor = bs[d.ID]
			}
			if *asJSON {
				return writeJSON(env.Stdout, struct {
					handlerOut
					Deliveries map[string]int64 `json:"deliveries"`
					// AtLeast: the states whose count is a lower bound.
					AtLeast          []string               `json:"deliveries_at_least,omitempty"`
					OldestPendingSec float64                `json:"oldest_pending_age_seconds"`
					Cursor           *handler.CursorBacklog `json:"cursor,omitempty"`
				}{handlerJSON(d), counts, atLeast, oldest, cursor})
			}
			tw := tabwriter.NewWriter(env.Stdout, 0, 4, 2, ' ', 0)
			line := func(k string, v any) { fmt.Fprintf(tw, "%s:\t%v\n", k, v) }
			line("id", d.ID)
			if d.Name != "" {
				line("name", d.Name)
			}
			line("table", d.QualifiedTable())
			line("kind", d.Kind)
			line("target", d.RedactedTarget())
			line("status", handlerStatus(d))
			line("priority", d.Priority)
			line("phase", d.Phase)
			line("columns", strings.Join(append([]string{"(key)"}, d.Columns...), ", "))
			line("max attempts", d.MaxAttempts)
			line("backoff", d.Backoff)
			line("claim timeout", d.ClaimTimeout)
			line("revalidate", d.Revalidate)
			if d.BatchSize > 1 {
				line("batches", fmt.Sprintf("up to %d deliveries, a partial one after %s", d.BatchSize, d.BatchWait))
			}
			if d.SecretFile != "" {
				line("secret file", d.SecretFile)
				line("signing", signingSummary(d.SecretFile, time.Now()))
			}
			for _, s := range handler.States {
				if slices.Contains(atLeast, s) {
					line("deliveries "+s, fmt.Sprintf("at least %d (counted up to %d)", counts[s], handler.CursorCountCap))
					continue
				}
				line("deliveries "+s, counts[s])
			}
			if counts[handler.StatePending] > 0 {
				line("oldest pending", time.Duration(oldest*float64(time.Second)).Truncate(time.Second))
			}
			switch {
			case d.UsesCursor() && d.RevokedAt != nil:
				line("cursor", "revoked: the rows after it are not sent")
			case d.UsesCursor():
				writeCursor(line, cursor)
			}
			return tw.Flush()
		})
	}
	return cmd
}

// writeCursor says where a cursor handler's deliveries stand: its cursor
// and its claimed batch.
func writeCursor(line func(string, any), b *handler.CursorBacklog) {
	if b == nil {
		line("cursor", "none: the handler delivers nothing until it has one")
		return
	}
	line("cursor", fmt.Sprintf("%s seq %d (pending deliveries are the archived rows after it)", b.CommitLSN, b.Seq))
	switch {
	case b.ClaimedToLSN == nil || b.ClaimedToSeq == nil:
		line("batch", "none claimed")
	case b.Claimed:
		exp := ""
		if b.ClaimExpiresAt != nil {
			exp = ", claim expires " + b.ClaimExpiresAt.UTC().Format(time.RFC3339)
		}
		line("batch", fmt.Sprintf("in flight up to %s seq %d, attempt %d%s", *b.ClaimedToLSN, *b.ClaimedToSeq, b.Attempt, exp))
	case b.ClaimExpiresAt != nil:
		line("batch", fmt.Sprintf("up to %s seq %d, attempt %d: its claim expired %s (its dispatcher stopped); claimed again by the next one",
			*b.ClaimedToLSN, *b.ClaimedToSeq, b.Attempt, b.ClaimExpiresAt.UTC().Format(time.RFC3339)))
	default:
		line("batch", fmt.Sprintf("up to %s seq %d failed attempt %d, next attempt %s", *b.ClaimedToLSN, *b.ClaimedToSeq,
			b.Attempt, b.NextAttemptAt.UTC().Format(time.RFC3339)))
	}
}

// notFound makes an id or name that names nothing (a handler, a
// delivery, a gap, a quarantine entry) exit 3 ("cannot"), as `hold remove`
// of an unknown hold does.
func notFound(err error) error {
	if errors.Is(err, handler.ErrNotFound) || errors.Is(err, status.ErrGapNotFound) || errors.Is(err, quarantine.ErrNotFound) {
		return cli.WithCode(cli.ExitNotEqual, err)
	}
	return err
}

func handlersToggleCommand(env *Env, verb string, enabled bool) *cobra.Command {
	short := "enable a handler: its waiting deliveries run again"
	if !enabled {
		short = "disable a handler: deliveries are still queued, and wait"
	}
	cmd := &cobra.Command{Use: verb + " <id>", Short: short, Example: "  projector handlers " + verb + " 0b6f5e43-3d0e-4c2b-9a51-6f7f2a8c1e90",
		Args: cli.Args(1)}
	c := commonFlags(cmd, env)
	asJSON := jsonFlag(cmd, "the handler")
	cmd.RunE = func(cmd *cobra.Command, args []string) error {
		ctx := cmd.Context()
		if !handler.ValidID(args[0]) {
			return cli.Usage("handler id %q: want a UUID", args[0])
		}
		return withTargetPool(ctx, c, func(pool *pgxpool.Pool) error {
			if err := handler.SetEnabled(ctx, pool, args[0], enabled); err != nil {
				return notFound(err)
			}
			d, err := handler.Get(ctx, pool, args[0])
			if err != nil {
				return err
			}
			if *asJSON {
				return writeJSON(env.Stdout, handlerJSON(d))
			}
			fmt.Fprintf(env.Stdout, "handler %s %sd\n", d.ID, verb)
			return nil
		})
	}
	return cmd
}

func handlersEndCommand(env *Env, verb string) *cobra.Command {
	short := "revoke a handler: no more deliveries are queued; open ones stop as stop_revoked"
	outcome := string(handler.StopRevoked)
	if verb == "remove" {
		short = "remove a handler: it is deleted; open deliveries end as stop_completed"
		outcome = string(handler.StopCompleted)
	}
	cmd := &cobra.Command{Use: verb + " <id>", Short: short, Example: "  projector handlers " + verb + " 0b6f5e43-3d0e-4c2b-9a51-6f7f2a8c1e90",
		Args: cli.Args(1)}
	c := commonFlags(cmd, env)
	asJSON := jsonFlag(cmd, `{"id", "stopped": open deliveries stopped, "outcome", "not_sent": a cursor handler's pending rows}`)
	cmd.RunE = func(cmd *cobra.Command, args []string) error {
		ctx := cmd.Context()
		if !handler.ValidID(args[0]) {
			return cli.Usage("handler id %q: want a UUID", args[0])
		}
		return withTargetPool(ctx, c, func(pool *pgxpool.Pool) error {
			end := handler.Revoke
			if verb == "remove" {
				end = handler.Remove
			}
			def, err := handler.Get(ctx, pool, args[0])
			if err != nil {
				return notFound(err)
			}
			n, err := end(ctx, pool, args[0])
			if err != nil {
				return notFound(err)
			}
			if *asJSON {
				return writeJSON(env.Stdout, map[string]any{"id": strings.ToLower(args[0]), "stopped": n, "outcome": outcome})
			}
			cursor := ""
			if def.UsesCursor() {
				cursor = " (the rows after its cursor among them; its cursor is deleted)"
			}
			fmt.Fprintf(env.Stdout, "handler %s %sd; %d open deliveries stopped as %s%s\n", args[0], verb, n, outcome, cursor)
			return nil
		})
	}
	return cmd
}

func deliveriesCommand(env *Env) *cobra.Command {
	cmd := cli.Group(&cobra.Command{
		Use:   "deliveries <list | show | retry | discard | flush>",
		Short: "row handler deliveries: list | show <id> | retry <id> | discard <id> | flush [--timeout D]",
		Long: `A delivery is one (handler, archived row) piece of work (archive.deliveries):
pending, in_flight, done, stopped or dead. Dead ones carry a sanitized
last_error (error type, machine code, diagnostic id, and for webhooks,
commands and NATS subjects the cause, e.g. "dial tcp 10.0.0.7:443: connect:
connection refused", URL credentials redacted); the projector's log line
with that diagnostic id has the whole error. retry puts a dead or stopped one back
(a fresh attempt count); discard gives up a pending or dead one (an
in-flight one is refused until its attempt settles); flush runs queued work
to completion now.`,
		Example: `  projector deliveries list --state dead --json
  projector deliveries retry 3f0c2b1e-...
  projector deliveries flush --timeout 2m`,
	})
	cmd.AddCommand(deliveriesListCommand(env), deliveriesShowCommand(env), deliveriesActCommand(env, "retry"),
		deliveriesActCommand(env, "discard"), deliveriesFlushCommand(env))
	return cmd
}

func deliveriesListCommand(env *Env) *cobra.Command {
	cmd := &cobra.Command{Use: "list", Short: "list deliveries, newest first, without payloads",
		Long: `list lists deliveries, newest first, without payloads. A cursor handler's
pending and in-flight deliveries (a webhook batching without revalidation)
have no row until their batch settles: they are listed from the archived
rows after its cursor, with the ids their deliveries carry ("from_archive":
true in --json, "(archive)" after the state otherwise); "deliveries show",
retry and discard find them once settled.`,
		Example: "  projector deliveries list --handler 0b6f5e43-3d0e-4c2b-9a51-6f7f2a8c1e90 --state dead --json", Args: cli.NoArgs}
	c := commonFlags(cmd, env)
	var f handler.Filter
	var table string
	cmd.Flags().StringVar(&f.HandlerID, "handler", "", "only this handler's (id)")
	cli.Local(cmd).Enum(&f.State, "state", "", "", handler.States, "only this state: "+strings.Join(handler.States, ", "))
	cmd.Flags().StringVar(&table, "table", "", "only this table's (schema.table)")
	cmd.Flags().IntVar(&f.Limit, "limit", 1000, "at most this many; when more match, stderr says so")
	asJSON := jsonFlag(cmd, "the deliveries")
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		ctx := cmd.Context()
		if f.HandlerID != "" && !handler.ValidID(f.HandlerID) {
			return cli.Usage("--handler %q: want a UUID", f.HandlerID)
		}
		if table != "" {
			s, t, ok := strings.Cut(table, ".")
			if !ok || s == "" || t == "" {
				return cli.Usage("--table %q: want schema.table", table)
			}
			f.Schema, f.Table = s, t
		}
		return withTargetPool(ctx, c, func(pool *pgxpool.Pool) error {
			// One more than asked, to tell when more match than are shown.
			limit := f.Limit
			if limit <= 0 {
				limit = 1000
			}
			q := f
			q.Limit = limit + 1
			ds, err := handler.ListWithCursors(ctx, pool, q)
			if err != nil {
				return err
			}
			ds = cutAtLimit(env.Stderr, ds, limit, "more deliveries match: the newest %d shown (--limit N for more)")
			if *asJSON {
				return writeJSONList(env.Stdout, ds)
			}
			writeDeliveries(env.Stdout, ds, time.Now())
			return nil
		})
	}
	return cmd
}

func writeDeliveries(w io.Writer, ds []handler.Info, now time.Time) {
	writeTable(w, "ID\tHANDLER\tTABLE\tKEY\tSTATE\tATTEMPT\tOUTCOME\tAGE\tLAST ERROR", ds, "(no deliveries)", func(w io.Writer, d handler.Info) {
		state := d.State
		if d.FromArchive {
			state += " (archive)"
		}
		fmt.Fprintf(w, "%s\t%s\t%s.%s\t%s\t%s\t%d\t%s\t%s\t%s\n", d.ID, d.HandlerID, d.Schema, d.Table, oneLine(string(d.Key), 40),
			state, d.Attempt, deref(d.Outcome), now.Sub(d.CreatedAt).Truncate(time.Second), deref(d.LastError))
	})
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

// diagRE finds the diagnostic id in a delivery's last_error.
var diagRE = regexp.MustCompile(`\bdiag=([0-9a-f]{12})\b`)

func deliveriesShowCommand(env *Env) *cobra.Command {
	cmd := &cobra.Command{Use: "show <id>", Short: "show one delivery; its payload (it holds row values) only with --payload",
		Example: "  projector deliveries show 3f0c2b1e-9d7a-8c1b-a2e4-5f6a7b8c9d0e --payload --json", Args: cli.Args(1)}
	c := commonFlags(cmd, env)
	payload := cmd.Flags().Bool("payload", false, "also print the payload (the key and the kept columns)")
	asJSON := jsonFlag(cmd, "the delivery")
	cmd.RunE = func(cmd *cobra.Command, args []string) error {
		ctx := cmd.Context()
		if !handler.ValidID(args[0]) {
			return cli.Usage("delivery id %q: want a UUID", args[0])
		}
		return withTargetPool(ctx, c, func(pool *pgxpool.Pool) error {
			d, err := handler.ShowDelivery(ctx, pool, args[0])
			if err != nil {
				return notFound(err)
			}
			if !*payload {
				d.Payload = nil
			}
			if *asJSON {
				return writeJSON(env.Stdout, d)
			}
			tw := tabwriter.NewWriter(env.Stdout, 0, 4, 2, ' ', 0)
			line := func(k string, v any) { fmt.Fprintf(tw, "%s:\t%v\n", k, v) }
			line("id", d.ID)
			line("handler", d.HandlerID)
			line("row", fmt.Sprintf("%s.%s %s", d.Schema, d.Table, d.Key))
			line("correlation id", d.CorrelationID)
			line("state", d.State)
			line("attempt", d.Attempt)
			line("outcome", deref(d.Outcome))
			line("last error", deref(d.LastError))
			if m := diagRE.FindStringSubmatch(deref(d.LastError)); m != nil {
				line("full error", "search the projector's log for diag="+m[1]+" (the line \"delivery attempt failed\" with the whole error)")
			}
			line("phase", d.Phase)
			line("released", d.Released)
			if d.ReleasedUnsettled {
				line("released unsettled", true)
			}
			line("next attempt", d.NextAttemptAt.Format(time.RFC3339))
			line("created", d.CreatedAt.Format(time.RFC3339))
			if d.Payload != nil {
				line("payload", string(d.Payload))
			} else if d.PayloadScrubbed {
				line("payload", "(scrubbed)")
			}
			return tw.Flush()
		})
	}
	return cmd
}

func deliveriesActCommand(env *Env, verb string) *cobra.Command {
	short := "put a dead or stopped delivery back to pending with a fresh attempt count"
	if verb == "discard" {
		short = "give up a pending or dead delivery (stopped, outcome discarded; payload scrubbed); an in-flight one is refused"
	}
	cmd := &cobra.Command{Use: verb + " <id>", Short: short, Example: "  projector deliveries " + verb + " 3f0c2b1e-9d7a-8c1b-a2e4-5f6a7b8c9d0e",
		Args: cli.Args(1)}
	c := commonFlags(cmd, env)
	asJSON := jsonFlag(cmd, "the delivery")
	cmd.RunE = func(cmd *cobra.Command, args []string) error {
		ctx := cmd.Context()
		if !handler.ValidID(args[0]) {
			return cli.Usage("delivery id %q: want a UUID", args[0])
		}
		return withTargetPool(ctx, c, func(pool *pgxpool.Pool) error {
			act := handler.Retry
			if verb == "discard" {
				act = handler.Discard
			}
			if err := act(ctx, pool, args[0]); err != nil {
				if errors.Is(err, handler.ErrNotFound) {
					return notFound(err)
				}
				return cli.WithCode(cli.ExitNotEqual, err)
			}
			d, err := handler.ShowDelivery(ctx, pool, args[0])
			if err != nil {
				return err
			}
			d.Payload = nil
			if *asJSON {
				return writeJSON(env.Stdout, d)
			}
			fmt.Fprintf(env.Stdout, "delivery %s: %s\n", d.ID, d.State)
			return nil
		})
	}
	return cmd
}

func deliveriesFlushCommand(env *Env) *cobra.Command {
	cmd := &cobra.Command{Use: "flush", Short: "run queued deliveries to completion now, then exit (exit 2 on --timeout)",
		Long: `flush claims and runs due deliveries in this process (beside any running
projector) until none that it can run is pending and released or in flight,
waiting out backoffs. Deliveries waiting for their group, of disabled handlers
or of Go handlers are not waited for. A cursor handler's rows that cannot
be sent yet (not yet verified, past the archive's horizon, or a batch
waiting for its retry) are not waited for either: flush names how many
are left after the cursors. Exit 0 when done, 2 when --timeout passed
first (naming how many remain).`,
		Example: "  projector deliveries flush --timeout 2m --json", Args: cli.NoArgs}
	c := commonFlags(cmd, env)
	var timeout time.Duration
	var parallelism int
	cli.Local(cmd).Duration(&timeout, "timeout", "", time.Minute, "give up after this long", cli.Positive())
	cli.Local(cmd).Int(&parallelism, "handler-parallelism", "EPITAPH_HANDLER_PARALLELISM", handler.DefaultParallelism, "deliveries run at once", cli.Min(1))
	var sourceURL string
	var sourceTCPTimeout time.Duration
	sourceURLFlag(cli.Local(cmd), &sourceURL)
	sourceTCPTimeoutFlag(cli.Local(cmd), &sourceTCPTimeout)
	asJSON := jsonFlag(cmd, `{"remaining": n, "cursor_pending": rows after cursor handlers' cursors (when any)}`)
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		srcTimeout, err := dialTimeout("source-tcp-timeout", sourceTCPTimeout)
		if err != nil {
			return err
		}
		ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
		defer cancel()
		return withTargetPool(ctx, c, func(pool *pgxpool.Pool) error {
			var js jetstream.JetStream
			if nc, err := c.natsConnect(nats.Name("epitaph-projector deliveries flush")); err == nil {
				defer nc.Close()
				js, _ = jetstream.New(nc)
			} else {
				env.Logger.Warn("no NATS connection: nats handlers' deliveries will be retried", "nats", redact(c.natsURL))
			}
			ev, reval, err := newRevalidator(pool, sourceURL, srcTimeout, env, nil)
			if err != nil {
				return err
			}
			defer ev.Close()
			d, err := handler.NewDispatcher(pool, handler.Config{Parallelism: parallelism, JetStream: js, Revalidate: reval,
				RevalidateBatch: ev.BatchRevalidator(), Logger: env.Logger, Source: c.sourceName})
			if err != nil {
				return err
			}
			left, err := d.Flush(ctx)
			if err != nil && ctx.Err() == nil {
				return err
			}
			// What the cursor handlers still have after their cursors
			// (rows not yet verified or past the archive's horizon, a
			// batch waiting for its retry): not waited for, but said.
			cursorLeft, atLeast, cerr := cursorPending(context.WithoutCancel(ctx), pool)
			if cerr != nil {
				return cerr
			}
			if *asJSON {
				out := map[string]any{"remaining": max(left, 0)}
				if cursorLeft > 0 {
					out["cursor_pending"], out["cursor_pending_at_least"] = cursorLeft, atLeast
				}
				if werr := writeJSON(env.Stdout, out); werr != nil {
					return werr
				}
			}
			if left != 0 || ctx.Err() != nil {
				return cli.WithCode(cli.ExitTimeout, fmt.Errorf("flush: %d deliveries still open after %s", max(left, 0), timeout))
			}
			if !*asJSON {
				if cursorLeft > 0 {
					fmt.Fprintf(env.Stdout, "flushed: no queued deliveries left; %s%d pending after cursor handlers' cursors "+
						"(rows not yet verified or past the archive's horizon, or a batch waiting for its retry)\n",
						map[bool]string{true: "at least "}[atLeast], cursorLeft)
					return nil
				}
				fmt.Fprintln(env.Stdout, "flushed: no open deliveries left")
			}
			return nil
		})
	}
	return cmd
}

// cursorPending sums the pending and in-flight deliveries of the enabled
// cursor handlers (whether the sum is a lower bound).
func cursorPending(ctx context.Context, pool *pgxpool.Pool) (int64, bool, error) {
	defs, err := handler.List(ctx, pool)
	if err != nil {
		return 0, false, err
	}
	var enabled []handler.Def
	for _, d := range defs {
		if d.Enabled {
			enabled = append(enabled, d)
		}
	}
	bs, err := handler.CursorBacklogs(ctx, pool, enabled)
	if err != nil {
		return 0, false, err
	}
	var n int64
	var atLeast bool
	for _, b := range bs {
		n += b.Pending + b.InFlight
		atLeast = atLeast || b.AtLeast
	}
	return n, atLeast, nil
}

// signingSummary says, without a secret, how a webhook is signed now.
func signingSummary(file string, now time.Time) string {
	secrets, err := handler.ReadSecrets(file)
	if err != nil {
		return "the secret file cannot be read or parsed: deliveries fail until it is fixed"
	}
	if secrets[0].Raw {
		return "one raw secret (deprecated form: write it as whsec_<base64>)"
	}
	signing := secrets.Signing(now)
	if len(signing) == 1 {
		return "one whsec_ secret"
	}
	last := signing[1].Until
	for _, k := range signing[2:] {
		if k.Until.After(last) {
			last = k.Until
		}
	}
	return fmt.Sprintf("%d whsec_ secrets: the previous one(s) also sign until %s", len(signing), last.UTC().Format(time.RFC3339))
}

func handlersRotateSecretCommand(env *Env) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "rotate-secret <id> [--window D] [--from-file FILE]",
		Short: "write a new webhook secret into the handler's --secret-file; the old one keeps signing for --window",
		Long: `Writes a new secret (32 random bytes, whsec_<base64>; or the one in --from-file)
as the first line of the handler's secret file, and keeps the current secret
on the next line with "until=<time>": until then every request carries both
signatures (webhook-signature: "v1,<new> v1,<old>"), so the receiver can
switch to the new secret at any moment within the window. The file is
replaced atomically, its mode kept; run this where the projectors read the
file (dispatchers use the new file within a second). No secret is printed:
read the new one from the file's first line.`,
		Example: "  projector handlers rotate-secret 0b6f5e43-3d0e-4c2b-9a51-6f7f2a8c1e90 --window 48h",
		Args:    cli.Args(1),
	}
	c := commonFlags(cmd, env)
	window := cmd.Flags().Duration("window", handler.DefaultRotationWindow, "how long the old secret keeps signing beside the new one (0: replaced at once)")
	from := cmd.Flags().String("from-file", "", "take the new secret (whsec_<base64>) from this file instead of generating one")
	asJSON := jsonFlag(cmd, `{"id", "secret_file", "previous_signs_until"}`)
	cmd.RunE = func(cmd *cobra.Command, args []string) error {
		ctx := cmd.Context()
		if !handler.ValidID(args[0]) {
			return cli.Usage("handler id %q: want a UUID", args[0])
		}
		if *window < 0 {
			return cli.Usage("--window must not be negative")
		}
		next := ""
		if *from != "" {
			b, err := os.ReadFile(*from)
			if err != nil {
				return cli.Usage("--from-file %s cannot be read", *from)
			}
			next = strings.TrimRight(string(b), "\r\n")
			if s, err := handler.ParseSecrets([]byte(next)); err != nil || s[0].Raw || len(s) != 1 {
				return cli.Usage("--from-file %s: want one whsec_<base64> secret", *from)
			}
		}
		return withTargetPool(ctx, c, func(pool *pgxpool.Pool) error {
			d, err := handler.Get(ctx, pool, args[0])
			if err != nil {
				return notFound(err)
			}
			if d.Kind != handler.KindWebhook || d.SecretFile == "" {
				return cli.Usage("handler %s is not a webhook with a --secret-file", d.ID)
			}
			until, err := handler.RotateSecretFile(d.SecretFile, next, *window, time.Now())
			if err != nil {
				return fmt.Errorf("rotate the secret of handler %s: %w", d.ID, err)
			}
			if *asJSON {
				out := map[string]any{"id": d.ID, "secret_file": d.SecretFile, "previous_signs_until": nil}
				if *window > 0 {
					out["previous_signs_until"] = until.UTC()
				}
				return writeJSON(env.Stdout, out)
			}
			if *window == 0 {
				fmt.Fprintf(env.Stdout, "handler %s: a new secret is the first line of %s; the old one no longer signs\n", d.ID, d.SecretFile)
				return nil
			}
			fmt.Fprintf(env.Stdout, "handler %s: a new secret is the first line of %s; the old one also signs until %s\n",
				d.ID, d.SecretFile, until.UTC().Format(time.RFC3339))
			return nil
		})
	}
	return cmd
}
