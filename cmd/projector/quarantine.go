package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/epitaph-dev/epitaph/projection"
	"github.com/epitaph-dev/epitaph/quarantine"
)

func init() {
	register("quarantine", Command{
		Summary: "events set aside: list | show <id> [--payload] | replay <id>|--all | discard <id> --reason R",
		Run:     quarantineCmd,
	})
}

const quarantineUsage = `usage:
  projector quarantine list [--projection P] [--version N] [--category C] [--status open|replayed|discarded|all] [--limit N] [--json]
  projector quarantine show <id> [--payload] [--json]
  projector quarantine replay <id> | --all [--projection P] [--version N] [--category C] [--archive-ttl ..] [--snapshot-roots ..]
  projector quarantine discard <id> --reason R`

func quarantineCmd(ctx context.Context, args []string, env *Env) error {
	if len(args) == 0 {
		return errors.New(quarantineUsage)
	}
	run := map[string]func(context.Context, []string, *Env) error{
		"list": quarantineList, "show": quarantineShow, "replay": quarantineReplay, "discard": quarantineDiscard,
	}[args[0]]
	if run == nil {
		return fmt.Errorf("unknown quarantine subcommand %q\n%s", args[0], quarantineUsage)
	}
	return run(ctx, args[1:], env)
}

// filterFlags registers --projection, --version and --category.
func filterFlags(fs *flag.FlagSet) *quarantine.Filter {
	f := &quarantine.Filter{}
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
	pool, err := pgxpool.New(ctx, c.targetURL)
	if err != nil {
		return nil, fmt.Errorf("connect to target %s: %w", redact(c.targetURL), err)
	}
	return pool, nil
}

func oneID(pos []string, usage string) (int64, error) {
	if len(pos) != 1 {
		return 0, errors.New("usage: " + usage)
	}
	id, err := strconv.ParseInt(pos[0], 10, 64)
	if err != nil || id <= 0 {
		return 0, fmt.Errorf("quarantine entry id %q: want a positive number", pos[0])
	}
	return id, nil
}

func quarantineList(ctx context.Context, args []string, env *Env) error {
	fs := newFlagSet("quarantine list", env)
	c := commonFlags(fs, env)
	f := filterFlags(fs)
	status := fs.String("status", "open", "open, replayed, discarded or all")
	fs.IntVar(&f.Limit, "limit", 1000, "at most this many entries (0: all)")
	asJSON := fs.Bool("json", false, "JSON output")
	if _, err := parseInterspersed(fs, args); err != nil {
		return err
	}
	switch *status {
	case "all":
	case string(quarantine.StatusOpen), string(quarantine.StatusReplayed), string(quarantine.StatusDiscarded):
		f.Status = quarantine.Status(*status)
	default:
		return fmt.Errorf("--status %q: want open, replayed, discarded or all", *status)
	}
	pool, err := targetPool(ctx, c)
	if err != nil {
		return err
	}
	defer pool.Close()
	recs, err := quarantine.List(ctx, pool, *f)
	if err != nil {
		return err
	}
	if *asJSON {
		return writeJSON(env.Stdout, recs)
	}
	writeList(env.Stdout, recs, time.Now())
	return nil
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

func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func quarantineShow(ctx context.Context, args []string, env *Env) error {
	fs := newFlagSet("quarantine show", env)
	c := commonFlags(fs, env)
	payload := fs.Bool("payload", false, "also print the raw message (it holds row values)")
	asJSON := fs.Bool("json", false, "JSON output (the payload base64-encoded)")
	pos, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	id, err := oneID(pos, "projector quarantine show <id> [--payload] [--json]")
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
		return err
	}
	if *asJSON {
		return writeJSON(env.Stdout, r)
	}
	writeRecord(env.Stdout, r)
	return nil
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

func quarantineDiscard(ctx context.Context, args []string, env *Env) error {
	fs := newFlagSet("quarantine discard", env)
	c := commonFlags(fs, env)
	reason := fs.String("reason", "", "why the event is given up (required; kept in the audit record)")
	pos, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	id, err := oneID(pos, "projector quarantine discard <id> --reason R")
	if err != nil {
		return err
	}
	if strings.TrimSpace(*reason) == "" {
		return errors.New("discard needs --reason (kept in the audit record)")
	}
	pool, err := targetPool(ctx, c)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := quarantine.Discard(ctx, pool, id, *reason); err != nil {
		return err
	}
	fmt.Fprintf(env.Stdout, "entry %d discarded\n", id)
	return nil
}

func quarantineReplay(ctx context.Context, args []string, env *Env) error {
	fs := newFlagSet("quarantine replay", env)
	c := commonFlags(fs, env)
	f := filterFlags(fs)
	all := fs.Bool("all", false, "replay every open entry (matching --projection/--version/--category)")
	applier := replayApplier(fs, env)
	pos, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	var sel quarantine.Selection
	switch {
	case *all && len(pos) == 0:
		sel.Filter = *f
	case !*all && len(pos) == 1:
		if sel.ID, err = oneID(pos, ""); err != nil {
			return err
		}
	default:
		return errors.New("usage: projector quarantine replay <id> | --all [--projection P] [--version N] [--category C]")
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
	res, err := quarantine.Replay(ctx, pool, sel, apply)
	fmt.Fprintf(env.Stdout, "replayed %d, still failing %d, held behind an open entry %d\n",
		len(res.Replayed), len(res.Failed), len(res.Held))
	for _, id := range res.Failed {
		fmt.Fprintf(env.Stdout, "  still failing: %d (projector quarantine show %d)\n", id, id)
	}
	if err != nil {
		return err
	}
	if len(res.Failed) > 0 {
		return fmt.Errorf("%d entries still fail", len(res.Failed))
	}
	return nil
}

// replayApplier returns the projector runtime's apply for replay: decode
// with this build's decoder and apply into the entry's version read model
// (archive rows, roots, snapshot jobs), with the same retention and
// snapshot roots as `projector run`. JetStream is used only for large rows.
func replayApplier(fs *flag.FlagSet, env *Env) func(ctx context.Context, c *common) (quarantine.ApplyFunc, func(), error) {
	ttls := fs.String("archive-ttl", env.Getenv("EPITAPH_ARCHIVE_TTL"), "archive retention per table, as for run (EPITAPH_ARCHIVE_TTL)")
	roots := fs.String("snapshot-roots", env.Getenv("EPITAPH_SNAPSHOT_ROOTS"), "snapshot roots, as for run (EPITAPH_SNAPSHOT_ROOTS)")
	maxRow := fs.Int64("max-row-bytes", int64Env(env, "EPITAPH_MAX_ROW_BYTES", projection.DefaultMaxRowBytes), "largest large-row object fetched, as for run (EPITAPH_MAX_ROW_BYTES)")
	return func(ctx context.Context, c *common) (quarantine.ApplyFunc, func(), error) {
		if err := env.envErr(); err != nil {
			return nil, nil, err
		}
		ttlMap, err := projection.ParseTTLs(*ttls)
		if err != nil {
			return nil, nil, err
		}
		var rootList []string
		for _, r := range strings.Split(*roots, ",") {
			if r = strings.TrimSpace(r); r != "" {
				rootList = append(rootList, r)
			}
		}
		cfg := projection.ReplayConfig{ArchiveTTL: ttlMap, SnapshotRoots: rootList, MaxRowBytes: *maxRow}
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
