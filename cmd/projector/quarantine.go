package main

import (
	"context"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/spf13/cobra"

	"github.com/epitaph-dev/epitaph/cmd/internal/cli"
	"github.com/epitaph-dev/epitaph/projection"
	"github.com/epitaph-dev/epitaph/quarantine"
)

func init() { register(quarantineCommand) }

func quarantineCommand(env *Env) *cobra.Command {
	cmd := cli.Group(&cobra.Command{
		Use:   "quarantine <list | show | replay | discard>",
		Short: "events set aside: list | show <id> [--payload] | replay <id>|--all | discard <id> --reason R",
		Long: `An event that cannot be decoded or applied is set aside in epitaph.quarantine
with its category, in the same transaction that moves the partition on.
These commands list and show entries, replay them with this build's decoder
(exactly once), or give them up with a reason kept in the audit record.`,
		Example: `  projector quarantine list --category malformed
  projector quarantine show 42 --payload
  projector quarantine replay --all --projection archive
  projector quarantine discard 42 --reason "hand-published by mistake"`,
	})
	cmd.AddCommand(quarantineListCommand(env), quarantineShowCommand(env), quarantineReplayCommand(env), quarantineDiscardCommand(env))
	return cmd
}

// filterFlags registers --projection, --version and --category.
func filterFlags(cmd *cobra.Command) *quarantine.Filter {
	f := &quarantine.Filter{}
	fs := cmd.Flags()
	fs.StringVar(&f.Projection, "projection", "", "only this projection (e.g. archive)")
	fs.IntVar(&f.Version, "version", 0, "only this projection version")
	fs.Func("category", "only this category: "+categoryNames(), func(s string) error {
		for _, c := range quarantine.Categories {
			if string(c) == s {
				f.Category = c
				return nil
			}
		}
		return fmt.Errorf("unknown category %q (want one of %s)", s, categoryNames())
	})
	names := make([]string, len(quarantine.Categories))
	for i, c := range quarantine.Categories {
		names[i] = string(c)
	}
	_ = cmd.RegisterFlagCompletionFunc("category", cobra.FixedCompletions(names, cobra.ShellCompDirectiveNoFileComp))
	return f
}

func categoryNames() string {
	names := make([]string, len(quarantine.Categories))
	for i, c := range quarantine.Categories {
		names[i] = string(c)
	}
	return strings.Join(names, ", ")
}

func targetPool(ctx context.Context, c *common) (*pgxpool.Pool, error) {
	if err := c.check(); err != nil {
		return nil, err
	}
	return c.targetPool(ctx)
}

func entryID(s string) (int64, error) {
	id, err := strconv.ParseInt(s, 10, 64)
	if err != nil || id <= 0 {
		return 0, cli.Usage("quarantine entry id %q: want a positive number", s)
	}
	return id, nil
}

func quarantineListCommand(env *Env) *cobra.Command {
	cmd := &cobra.Command{
		Use:     "list",
		Short:   "list quarantine entries (open ones by default), without payloads",
		Example: "  projector quarantine list --status all --projection archive --version 2 --json",
		Args:    cli.NoArgs,
	}
	c := commonFlags(cmd, env)
	f := filterFlags(cmd)
	var status string
	cli.Local(cmd).Enum(&status, "status", "", "open", []string{"open", "replayed", "discarded", "all"}, "open, replayed, discarded or all")
	cmd.Flags().IntVar(&f.Limit, "limit", 1000, "at most this many entries (0: all); when more match, stderr says so")
	asJSON := jsonFlag(cmd, "the entries")
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		ctx := cmd.Context()
		if status != "all" {
			f.Status = quarantine.Status(status)
		}
		pool, err := targetPool(ctx, c)
		if err != nil {
			return err
		}
		defer pool.Close()
		// One more than asked, to tell when more match than are shown.
		q, limit := *f, f.Limit
		if limit > 0 {
			q.Limit = limit + 1
		}
		recs, err := quarantine.List(ctx, pool, q)
		if err != nil {
			return err
		}
		if limit > 0 {
			recs = cutAtLimit(env.Stderr, recs, limit, "more entries match: the first %d shown (--limit N or --limit 0 for all)")
		}
		if *asJSON {
			if recs == nil {
				recs = []quarantine.Record{}
			}
			return cli.WriteJSON(env.Stdout, recs)
		}
		writeList(env.Stdout, recs, time.Now())
		return nil
	}
	return cmd
}

func writeList(w io.Writer, recs []quarantine.Record, now time.Time) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tPROJECTION\tVERSION\tPARTITION\tSTREAM SEQ\tCATEGORY\tSTATUS\tATTEMPTS\tAGE\tSIZE\tERROR")
	for _, r := range recs {
		fmt.Fprintf(tw, "%d\t%s\t%d\t%d\t%d\t%s\t%s\t%d\t%s\t%d\t%s\n", r.ID, r.Projection, r.Version, r.Partition,
			r.StreamSeq, r.Category, r.Status, r.Attempts, now.Sub(r.FirstSeen).Truncate(time.Second), r.Size,
			oneLine(r.Error, 100))
	}
	tw.Flush()
	if len(recs) == 0 {
		fmt.Fprintln(w, "(no entries)")
	}
}

func oneLine(s string, n int) string {
	s = strings.Join(strings.Fields(s), " ")
	if utf8.RuneCountInString(s) > n {
		return string([]rune(s)[:n]) + "…"
	}
	return s
}

func writeJSON(w io.Writer, v any) error { return cli.WriteJSON(w, v) }

func quarantineShowCommand(env *Env) *cobra.Command {
	cmd := &cobra.Command{
		Use:     "show <id>",
		Short:   "show one entry; the payload (it holds row values) only with --payload",
		Example: "  projector quarantine show 42\n  projector quarantine show 42 --payload --json",
		Args:    cli.Args(1),
	}
	c := commonFlags(cmd, env)
	payload := cmd.Flags().Bool("payload", false, "also print the raw message (it holds row values)")
	asJSON := jsonFlag(cmd, "the entry (the payload base64-encoded in \"data\")")
	cmd.RunE = func(cmd *cobra.Command, args []string) error {
		ctx := cmd.Context()
		id, err := entryID(args[0])
		if err != nil {
			return err
		}
		pool, err := targetPool(ctx, c)
		if err != nil {
			return err
		}
		defer pool.Close()
		r, err := quarantine.Show(ctx, pool, id, *payload)
		if err != nil {
			return notFound(err)
		}
		if *asJSON {
			return writeJSON(env.Stdout, r)
		}
		writeRecord(env.Stdout, r)
		return nil
	}
	return cmd
}

func writeRecord(w io.Writer, r quarantine.Record) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	line := func(k string, v any) { fmt.Fprintf(tw, "%s:\t%v\n", k, v) }
	line("id", r.ID)
	line("projection", fmt.Sprintf("%s v%d", r.Projection, r.Version))
	line("partition", r.Partition)
	line("stream seq", r.StreamSeq)
	line("subject", r.Subject)
	if r.SourceTable != "" {
		line("source row", fmt.Sprintf("%s.%s %s", r.SourceSchema, r.SourceTable, r.SourceKey))
	}
	line("category", r.Category)
	line("error", r.Error)
	line("status", r.Status)
	line("attempts", r.Attempts)
	line("first seen", r.FirstSeen.UTC().Format(time.RFC3339))
	line("last attempt", r.LastAttemptAt.UTC().Format(time.RFC3339))
	if r.ResolvedAt != nil {
		line("resolved", fmt.Sprintf("%s (%s)", r.ResolvedAt.UTC().Format(time.RFC3339), r.ResolutionReason))
	}
	for k, vs := range r.Headers {
		line("header "+k, strings.Join(vs, ", "))
	}
	line("size", fmt.Sprintf("%d bytes", r.Size))
	tw.Flush()
	switch {
	case r.Data == nil:
		fmt.Fprintln(w, "(payload not shown: use --payload)")
	case utf8.Valid(r.Data) && !strings.ContainsRune(string(r.Data), 0):
		fmt.Fprintf(w, "payload:\n%s\n", r.Data)
	default:
		fmt.Fprintf(w, "payload (not UTF-8 text, Go-quoted):\n%q\n", r.Data)
	}
}

func quarantineDiscardCommand(env *Env) *cobra.Command {
	cmd := &cobra.Command{
		Use:     "discard <id> --reason R",
		Short:   "give an entry up, with a reason kept in the audit record",
		Example: `  projector quarantine discard 42 --reason "hand-published by mistake"`,
		Args:    cli.Args(1),
	}
	c := commonFlags(cmd, env)
	reason := cmd.Flags().String("reason", "", "why the event is given up (required; kept in the audit record)")
	asJSON := jsonFlag(cmd, "the outcome")
	cmd.RunE = func(cmd *cobra.Command, args []string) error {
		ctx := cmd.Context()
		id, err := entryID(args[0])
		if err != nil {
			return err
		}
		if strings.TrimSpace(*reason) == "" {
			return cli.Usage("discard needs --reason (kept in the audit record)")
		}
		pool, err := targetPool(ctx, c)
		if err != nil {
			return err
		}
		defer pool.Close()
		if err := quarantine.Discard(ctx, pool, id, *reason); err != nil {
			return notFound(err)
		}
		if *asJSON {
			return writeJSON(env.Stdout, map[string]any{"id": id, "status": quarantine.StatusDiscarded, "reason": *reason})
		}
		fmt.Fprintf(env.Stdout, "entry %d discarded\n", id)
		return nil
	}
	return cmd
}

func quarantineReplayCommand(env *Env) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "replay <id> | --all",
		Short: "apply entries again with this build's decoder, exactly once; progress on stderr",
		Long: `replay applies open entries again, in stream order, one transaction each: an
entry is marked replayed in the transaction that applied it, so it is applied
once even when replays race. With --all, progress (entries done of the total,
rate, ETA) is shown on stderr: a bar on a terminal, a line every 2s otherwise.
Exit status 1 when entries still fail, or stay held behind an earlier open
entry of the same row (the one asked for, or with --all any of them: those
were not replayed).`,
		Example: "  projector quarantine replay 42\n  projector quarantine replay --all --projection archive --category incompatible",
		Args:    cli.RangeArgs(0, 1),
	}
	c := commonFlags(cmd, env)
	f := filterFlags(cmd)
	all := cmd.Flags().Bool("all", false, "replay every open entry (matching --projection/--version/--category)")
	var hold bool
	cli.Local(cmd).Bool(&hold, "hold-on-quarantine", "EPITAPH_HOLD_ON_QUARANTINE", false,
		"hold mode, as for run: an entry of any category waits behind an earlier open entry of the same source row")
	asJSON := jsonFlag(cmd, "the outcome (replayed, failed and held entry ids)")
	applier := replayApplier(cmd, env)
	cmd.RunE = func(cmd *cobra.Command, pos []string) error {
		ctx := cmd.Context()
		sel := quarantine.Selection{Hold: hold}
		var err error
		switch {
		case *all && len(pos) == 0:
			sel.Filter = *f
		case !*all && len(pos) == 1:
			if sel.ID, err = entryID(pos[0]); err != nil {
				return err
			}
		default:
			return cli.Usage("usage: %s (an id or --all, not both)", cmd.UseLine())
		}
		pool, err := targetPool(ctx, c)
		if err != nil {
			return err
		}
		defer pool.Close()
		apply, closeApply, err := applier(ctx, c)
		if err != nil {
			return err
		}
		defer closeApply()
		if sel.ID == 0 {
			open := sel.Filter
			open.Status, open.Limit = quarantine.StatusOpen, 0
			recs, err := quarantine.List(ctx, pool, open)
			if err != nil {
				return err
			}
			p := newReplayProgress(env.Stderr, len(recs))
			apply = p.wrap(apply)
			defer p.done()
		}
		res, err := quarantine.Replay(ctx, pool, sel, apply)
		if *asJSON {
			if res.Replayed == nil {
				res.Replayed = []int64{}
			}
			if res.Failed == nil {
				res.Failed = []int64{}
			}
			if res.Held == nil {
				res.Held = []int64{}
			}
			if jerr := writeJSON(env.Stdout, res); jerr != nil {
				return jerr
			}
		} else {
			fmt.Fprintf(env.Stdout, "replayed %d, still failing %d, held behind an open entry %d\n",
				len(res.Replayed), len(res.Failed), len(res.Held))
			for _, id := range res.Failed {
				fmt.Fprintf(env.Stdout, "  still failing: %d (projector quarantine show %d)\n", id, id)
			}
		}
		if err != nil {
			return notFound(err)
		}
		if len(res.Failed) > 0 {
			return fmt.Errorf("%d entries still fail", len(res.Failed))
		}
		if sel.ID != 0 && len(res.Held) > 0 {
			return fmt.Errorf("entry %d is held behind an earlier open entry of the same row: replay or discard that one first", sel.ID)
		}
		if len(res.Held) > 0 {
			return fmt.Errorf("%d entries stay held behind an earlier open entry of the same row: replay or discard those first", len(res.Held))
		}
		return nil
	}
	return cmd
}

// replayProgress shows how far a replay --all is: a bar redrawn in place
// on a terminal, a line every 2 s otherwise.
type replayProgress struct {
	w        io.Writer
	tty      bool
	total    int
	n        int
	start    time.Time
	lastLine time.Time
}

func newReplayProgress(w io.Writer, total int) *replayProgress {
	return &replayProgress{w: w, tty: isTerminal(w), total: total, start: time.Now()}
}

func (p *replayProgress) wrap(apply quarantine.ApplyFunc) quarantine.ApplyFunc {
	return func(ctx context.Context, tx pgx.Tx, e quarantine.Entry) error {
		err := apply(ctx, tx, e)
		p.n++
		p.show(false)
		return err
	}
}

func (p *replayProgress) show(final bool) {
	if p.total == 0 {
		return
	}
	now := time.Now()
	if !final && !p.tty && now.Sub(p.lastLine) < 2*time.Second {
		return
	}
	if !final && p.tty && now.Sub(p.lastLine) < 100*time.Millisecond {
		return
	}
	p.lastLine = now
	elapsed := now.Sub(p.start).Seconds()
	rate := 0.0
	if elapsed > 0 {
		rate = float64(p.n) / elapsed
	}
	eta := -1.0
	if rate > 0 {
		eta = float64(max(p.total-p.n, 0)) / rate
	}
	line := fmt.Sprintf("replaying %s %d/%d entries %6.0f/s ETA %s", bar(float64(p.n)/float64(p.total), 30),
		p.n, p.total, rate, etaText(eta))
	if p.tty {
		fmt.Fprintf(p.w, "\r%s\033[K", line)
		if final {
			fmt.Fprintln(p.w)
		}
	} else {
		fmt.Fprintln(p.w, line)
	}
}

func (p *replayProgress) done() { p.show(true) }

// replayApplier returns the projector runtime's apply for replay: decode
// with this build's decoder and apply into the entry's version read model
// (archive rows, roots, snapshot jobs), with the same retention and
// snapshot roots as `projector run`. JetStream is used only for large rows.
func replayApplier(cmd *cobra.Command, env *Env) func(ctx context.Context, c *common) (quarantine.ApplyFunc, func(), error) {
	var ttls, roots string
	var maxRow int64
	f := cli.Local(cmd)
	f.String(&ttls, "archive-ttl", "EPITAPH_ARCHIVE_TTL", "", "archive retention per table, as for run")
	f.String(&roots, "snapshot-roots", "EPITAPH_SNAPSHOT_ROOTS", "", "snapshot roots, as for run")
	f.Int64(&maxRow, "max-row-bytes", "EPITAPH_MAX_ROW_BYTES", projection.DefaultMaxRowBytes, "largest large-row object fetched, as for run", cli.Positive())
	return func(ctx context.Context, c *common) (quarantine.ApplyFunc, func(), error) {
		ttlMap, err := projection.ParseTTLs(ttls)
		if err != nil {
			return nil, nil, cli.Usage("--archive-ttl: %w", err)
		}
		cfg := projection.ReplayConfig{ArchiveTTL: ttlMap, SnapshotRoots: splitList(roots), MaxRowBytes: maxRow}
		closeFn := func() {}
		nc, err := c.natsConnect(nats.Name("epitaph-projector quarantine replay"), nats.Timeout(5*time.Second))
		if err != nil {
			env.Logger.Warn("no JetStream connection: events with large rows (row_ref) cannot be replayed",
				"nats", redact(c.natsURL), "err", err)
		} else if js, err := jetstream.New(nc); err == nil {
			cfg.JetStream, closeFn = js, nc.Close
		} else {
			nc.Close()
		}
		return projection.ReplayFunc(cfg), closeFn, nil
	}
}
