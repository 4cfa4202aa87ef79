package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/spf13/cobra"

	"github.com/epitaph-dev/epitaph/cmd/internal/cli"
	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/status"
	"github.com/epitaph-dev/epitaph/projection/version"
)

func init() {
	register(rebuildCommand)
	register(compareCommand)
	register(promoteCommand)
	register(rollbackCommand)
	register(retireCommand)
	register(waitCommand)
}

// errDiffer makes compare (and a refused promote) exit 3.
var errDiffer = errors.New("the versions differ")

// connectBoth opens the target pool and JetStream for a subcommand.
func connectBoth(ctx context.Context, c *common) (*pgxpool.Pool, jetstream.JetStream, func(), error) {
	pool, err := targetPool(ctx, c)
	if err != nil {
		return nil, nil, nil, err
	}
	nc, err := c.natsConnect(nats.Name("epitaph-projector cli"), nats.Timeout(5*time.Second))
	if err != nil {
		pool.Close()
		return nil, nil, nil, fmt.Errorf("connect to NATS %s: %w", redact(c.natsURL), err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		pool.Close()
		return nil, nil, nil, fmt.Errorf("jetstream: %w", err)
	}
	return pool, js, func() { nc.Close(); pool.Close() }, nil
}

func versionArg(s string) (int, error) {
	n, err := strconv.Atoi(strings.TrimPrefix(s, "v"))
	if err != nil || n < 1 {
		return 0, cli.Usage("version %q: want a number such as 2", s)
	}
	return n, nil
}

func rebuildCommand(env *Env) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "rebuild <projection>",
		Short: "create the next version of a projection, built beside the live one (--wait shows progress)",
		Long: `rebuild creates the next version of a projection (schema archive_v<N+1>) with
its own consumers; running workers build it from the start of the stream (or,
PARTIAL, from --from-time) beside the live version, which keeps serving.`,
		Example: `  projector rebuild archive --wait
  projector rebuild archive --from-time 2026-11-01T00:00:00Z --note "TTL change"`,
		Args: cli.Args(1),
	}
	c := commonFlags(cmd, env)
	fromStart := cmd.Flags().Bool("from-start", true, "rebuild from the start of the stream (the default)")
	fromTime := cmd.Flags().String("from-time", "", "PARTIAL rebuild: start every partition at its first message stored at or after this RFC 3339 time; older deletes are not in the new version")
	wait := cmd.Flags().Bool("wait", false, "wait until the version is ready, showing progress (a bar on a terminal, lines otherwise)")
	note := cmd.Flags().String("note", "", "why, recorded in the version's config")
	period := cmd.Flags().String("archive-partition", archive.DefaultPeriod, "partition the new version's rows by commit_time: day, week or month")
	asJSON := jsonFlag(cmd, "the created version")
	cmd.RunE = func(cmd *cobra.Command, pos []string) error {
		ctx := cmd.Context()
		opts := version.RebuildOptions{Projection: pos[0], Source: c.sourceName, Note: *note, Period: *period}
		if _, err := archive.ParsePeriod(*period); err != nil {
			return cli.Usage("--archive-partition %q: want day, week or month", *period)
		}
		switch {
		case !*fromStart && *fromTime == "":
			return cli.Usage("--from-start=false: say where to start with --from-time")
		case *fromStart && cmd.Flags().Changed("from-start") && *fromTime != "":
			return cli.Usage("--from-start and --from-time: give one of them")
		}
		if *fromTime != "" {
			t, err := time.Parse(time.RFC3339, *fromTime)
			if err != nil {
				return cli.Usage("--from-time %q: want an RFC 3339 time such as 2026-11-01T00:00:00Z", *fromTime)
			}
			opts.FromTime = t
		}
		pool, js, closeAll, err := connectBoth(ctx, c)
		if err != nil {
			return err
		}
		defer closeAll()
		v, err := version.CreateVersion(ctx, pool, js, opts)
		if err != nil {
			return err
		}
		boundary := int64(0)
		if v.BoundarySeq != nil {
			boundary = *v.BoundarySeq
		}
		if *asJSON {
			if err := writeJSON(env.Stdout, versionJSON{Projection: v.Projection, Version: v.Version, Schema: v.Schema,
				State: v.State, BoundarySeq: boundary, BoundaryLSN: v.BoundaryLSN.String(), FromTime: v.FromTime}); err != nil {
				return err
			}
		} else {
			fmt.Fprintf(env.Stdout, "created %s v%d (schema %s, state %s, boundary seq %d, lsn %s)", v.Projection, v.Version, v.Schema, v.State,
				boundary, v.BoundaryLSN)
			if v.FromTime != nil {
				fmt.Fprintf(env.Stdout, "; partial rebuild from %s", v.FromTime.UTC().Format(time.RFC3339))
			}
			fmt.Fprintln(env.Stdout, "\nrunning projector workers build it in the background; watch it with `projector status`")
		}
		if !*wait {
			return nil
		}
		out := env.Stdout
		if *asJSON {
			out = env.Stderr // stdout holds the JSON document alone
		}
		return waitReady(ctx, pool, js, c.sourceName, v, out)
	}
	return cmd
}

// versionJSON is a created version in --json output.
type versionJSON struct {
	Projection  string     `json:"projection"`
	Version     int        `json:"version"`
	Schema      string     `json:"schema"`
	State       string     `json:"state"`
	BoundarySeq int64      `json:"boundary_seq"`
	BoundaryLSN string     `json:"boundary_lsn"`
	FromTime    *time.Time `json:"from_time,omitempty"`
}

func isTerminal(w io.Writer) bool { return cli.IsTerminal(w) }

// waitReady follows a version until it is ready (or live): a progress bar
// redrawn in place on a terminal, a line every few seconds otherwise. When
// every partition reaches the boundary it prints the rebuild rate.
func waitReady(ctx context.Context, pool *pgxpool.Pool, js jetstream.JetStream, source string, v version.Version, w io.Writer) error {
	tty := isTerminal(w)
	var prev *status.Status
	var firstDone time.Time
	var firstEvents uint64
	start := time.Now()
	lastLine := time.Time{}
	reported := false
	t := time.NewTicker(500 * time.Millisecond)
	defer t.Stop()
	for {
		st, err := status.CollectStatus(ctx, pool, js, source, time.Now())
		if err != nil {
			return err
		}
		st.FillRates(prev)
		prev = st
		var vs *status.VersionStatus
		for i := range st.Versions {
			if st.Versions[i].Projection == v.Projection && st.Versions[i].Version == v.Version {
				vs = &st.Versions[i]
			}
		}
		if vs == nil || vs.Lifecycle == nil {
			return fmt.Errorf("%s v%d: %w", v.Projection, v.Version, version.ErrNoVersion)
		}
		lc := vs.Lifecycle
		if firstDone.IsZero() && lc.EventsDone > 0 {
			firstDone, firstEvents = st.At, lc.EventsDone
		}
		line := fmt.Sprintf("%s v%d %-11s %s %d/%d events %6.0f events/s ETA %-8s partitions at boundary %d/%d",
			v.Projection, v.Version, vs.State, bar(lc.Progress, 30), lc.EventsDone, lc.EventsToBoundary,
			lc.EventsPerSecond, etaText(lc.ETASeconds), lc.PartitionsAtBoundary, len(vs.Partitions))
		if tty {
			fmt.Fprintf(w, "\r%s\033[K", line)
		} else if time.Since(lastLine) >= 2*time.Second {
			fmt.Fprintln(w, line)
			lastLine = time.Now()
		}
		if !reported && len(vs.Partitions) > 0 && lc.PartitionsAtBoundary == len(vs.Partitions) {
			reported = true
			elapsed := st.At.Sub(start)
			if tty {
				fmt.Fprintln(w)
			}
			fmt.Fprintf(w, "boundary reached: %d events in %s: %.0f events/s", lc.EventsToBoundary, elapsed.Round(time.Millisecond),
				float64(lc.EventsToBoundary)/elapsed.Seconds())
			if !firstDone.IsZero() && st.At.Sub(firstDone) > 0 && lc.EventsToBoundary > firstEvents {
				fmt.Fprintf(w, " (%.0f events/s from the first applied page)",
					float64(lc.EventsToBoundary-firstEvents)/st.At.Sub(firstDone).Seconds())
			}
			fmt.Fprintln(w)
		}
		switch vs.State {
		case version.StateReady, version.StateLive:
			if tty {
				fmt.Fprintln(w)
			}
			fmt.Fprintf(w, "%s v%d is %s after %s; compare it with `projector compare %s <live> %d`, then `projector promote %s %d`\n",
				v.Projection, v.Version, vs.State, time.Since(start).Round(time.Second), v.Projection, v.Version, v.Projection, v.Version)
			return nil
		case version.StateFailed, version.StateRetired:
			if tty {
				fmt.Fprintln(w)
			}
			return fmt.Errorf("%s v%d is %s %s", v.Projection, v.Version, vs.State, lc.FailedReason)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}

func etaText(s float64) string {
	switch {
	case s < 0:
		return "?"
	case s == 0:
		return "now"
	}
	return (time.Duration(s) * time.Second).String()
}

// ignoreFlag is --ignore expires_at|snapshots (repeatable).
type ignoreFlag struct{ expiresAt, snapshots bool }

func (f *ignoreFlag) String() string { return "" }
func (f *ignoreFlag) Type() string   { return "expires_at|snapshots" }
func (f *ignoreFlag) Set(s string) error {
	switch s {
	case "expires_at":
		f.expiresAt = true
	case "snapshots":
		f.snapshots = true
	default:
		return fmt.Errorf("can ignore expires_at (an intended TTL change) or snapshots (an intended change of snapshot roots), not %q", s)
	}
	return nil
}

func compareFlags(cmd *cobra.Command) (*ignoreFlag, *int, *bool) {
	ig := &ignoreFlag{}
	fs := cmd.Flags()
	fs.Var(ig, "ignore", "accept an intended difference: expires_at (a TTL policy change) or snapshots (a change of snapshot roots); repeatable")
	_ = cmd.RegisterFlagCompletionFunc("ignore", cobra.FixedCompletions([]string{"expires_at", "snapshots"}, cobra.ShellCompDirectiveNoFileComp))
	maxKeys := fs.Int("max-keys", 20, "list at most this many differing rows")
	all := fs.Bool("all", false, "compare every archived row, not only the transactions both versions reflect")
	return ig, maxKeys, all
}

func compareCommand(env *Env) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "compare <projection> <a> <b>",
		Short: "compare two versions: rows, checksums, snapshots, differing keys (exit 3 on difference)",
		Long: `compare checks two versions of a projection row by row (checksums per table,
snapshot fingerprints) over the transactions both reflect, and lists the
differing keys. Exit status 0 when equal, 3 when they differ, 1 on error.`,
		Example: `  projector compare archive 1 2
  projector compare archive v1 v2 --ignore expires_at --json`,
		Args: cli.Args(3),
	}
	c := commonFlags(cmd, env)
	ig, maxKeys, all := compareFlags(cmd)
	asJSON := jsonFlag(cmd, "the comparison")
	cmd.RunE = func(cmd *cobra.Command, pos []string) error {
		ctx := cmd.Context()
		a, err := versionArg(pos[1])
		if err != nil {
			return err
		}
		b, err := versionArg(pos[2])
		if err != nil {
			return err
		}
		pool, err := targetPool(ctx, c)
		if err != nil {
			return err
		}
		defer pool.Close()
		cmp, err := version.Compare(ctx, pool, version.CompareOptions{Projection: pos[0], A: a, B: b,
			IgnoreExpiresAt: ig.expiresAt, IgnoreSnapshots: ig.snapshots, MaxKeys: *maxKeys, All: *all})
		if err != nil {
			return err
		}
		if *asJSON {
			err = writeJSON(env.Stdout, cmp)
		} else {
			err = writeComparison(env.Stdout, cmp)
		}
		if err != nil {
			return err
		}
		if !cmp.Equal {
			return cli.WithCode(cli.ExitNotEqual, fmt.Errorf("%s v%d and v%d: %w", pos[0], a, b, errDiffer))
		}
		return nil
	}
	return cmd
}

func promoteCommand(env *Env) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "promote <projection> <version>",
		Short: "make a ready version live (re-points the archive.* views in one transaction)",
		Long: `promote compares the version with the live one first and refuses (exit 3) when
they differ, unless the difference is accepted with --ignore or --force is
given; then it re-points the reader views in one transaction. The previous
live version stays ready and keeps consuming, so rollback is instant.`,
		Example: `  projector promote archive 2
  projector promote archive 2 --ignore expires_at`,
		Args: cli.Args(2),
	}
	c := commonFlags(cmd, env)
	force := cmd.Flags().Bool("force", false, "promote even if the version is not ready or differs from the live one")
	ig, maxKeys, all := compareFlags(cmd)
	asJSON := jsonFlag(cmd, "the outcome")
	cmd.RunE = func(cmd *cobra.Command, pos []string) error {
		ctx := cmd.Context()
		n, err := versionArg(pos[1])
		if err != nil {
			return err
		}
		pool, err := targetPool(ctx, c)
		if err != nil {
			return err
		}
		defer pool.Close()
		out := env.Stdout
		if *asJSON {
			out = env.Stderr
		}
		if !*force {
			vs, err := version.ListVersions(ctx, pool, pos[0])
			if err != nil {
				return err
			}
			for _, v := range vs {
				if v.State != version.StateLive || v.Version == n {
					continue
				}
				cmp, err := version.Compare(ctx, pool, version.CompareOptions{Projection: pos[0], A: v.Version, B: n,
					IgnoreExpiresAt: ig.expiresAt, IgnoreSnapshots: ig.snapshots, MaxKeys: *maxKeys, All: *all})
				if err != nil {
					return err
				}
				if !cmp.Equal {
					_ = writeComparison(env.Stderr, cmp)
					return cli.WithCode(cli.ExitNotEqual, fmt.Errorf("refusing to promote %s v%d: it differs from the live v%d (--ignore expires_at accepts a TTL change; --force promotes anyway): %w",
						pos[0], n, v.Version, errDiffer))
				}
				fmt.Fprintf(out, "compare v%d v%d: %d tables equal up to %s", v.Version, n, len(cmp.Tables), orDashText(cmp.UpTo))
				if cmp.ExpiresAtDiffers > 0 {
					fmt.Fprintf(out, " (expires_at differs on %d rows: accepted)", cmp.ExpiresAtDiffers)
				}
				fmt.Fprintln(out)
			}
		}
		prev, err := version.Promote(ctx, pool, pos[0], n, *force)
		if err != nil {
			return err
		}
		if *asJSON {
			return writeJSON(env.Stdout, liveJSON{Projection: pos[0], Live: n, Previous: prev})
		}
		if prev > 0 {
			fmt.Fprintf(env.Stdout, "%s v%d is live (archive.* views re-pointed); v%d is ready and keeps consuming: `projector rollback %s` switches back\n",
				pos[0], n, prev, pos[0])
		} else {
			fmt.Fprintf(env.Stdout, "%s v%d is live (archive.* views re-pointed)\n", pos[0], n)
		}
		return nil
	}
	return cmd
}

// liveJSON is the outcome of promote and rollback in --json output.
type liveJSON struct {
	Projection string `json:"projection"`
	Live       int    `json:"live"`
	// Previous is the version that was live before (0: none).
	Previous int `json:"previous"`
}

func orDashText(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func rollbackCommand(env *Env) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "rollback <projection>",
		Short: "make the previous live version live again (it kept consuming)",
		Long: `rollback makes the previous live version live again, re-pointing the reader
views in one transaction. It kept consuming, so it is normally current; it
is refused, as promote refuses, when it is not ready (behind: catching up)
or has unresolved quarantined events, unacknowledged gaps, or snapshot
documents behind the live version's, unless --force.`,
		Example: "  projector rollback archive",
		Args:    cli.Args(1),
	}
	c := commonFlags(cmd, env)
	asJSON := jsonFlag(cmd, "the outcome")
	force := cmd.Flags().Bool("force", false, "roll back to a previous version that is not ready (behind, quarantined events, unacknowledged gaps, snapshots behind): readers then see it as it is")
	cmd.RunE = func(cmd *cobra.Command, pos []string) error {
		ctx := cmd.Context()
		pool, err := targetPool(ctx, c)
		if err != nil {
			return err
		}
		defer pool.Close()
		from, to, err := version.Rollback(ctx, pool, pos[0], *force)
		if err != nil {
			return err
		}
		if *asJSON {
			return writeJSON(env.Stdout, liveJSON{Projection: pos[0], Live: to, Previous: from})
		}
		fmt.Fprintf(env.Stdout, "%s v%d is live again (archive.* views re-pointed); v%d is ready\n", pos[0], to, from)
		return nil
	}
	return cmd
}

func retireCommand(env *Env) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "retire <projection> <version>",
		Short: "stop a version, delete its consumers (--drop: and its schema, after confirmation)",
		Long: `retire stops a version: workers hand its partitions back, its consumers and
progress rows are deleted. The schema archive_v<N> is kept unless --drop is
given; --drop asks for confirmation on a terminal and needs --yes otherwise.`,
		Example: `  projector retire archive 1
  projector retire archive 1 --drop --yes`,
		Args: cli.Args(2),
	}
	c := commonFlags(cmd, env)
	drop := cmd.Flags().Bool("drop", false, "also drop the version's schema (its rows and snapshots); asks for confirmation")
	yes := cmd.Flags().BoolP("yes", "y", false, "do not ask for confirmation (scripts)")
	var waitReleased time.Duration
	cli.Local(cmd).Duration(&waitReleased, "wait-released", "", 30*time.Second, "how long to wait for workers to hand the version's partitions back", cli.Positive())
	group := groupFlag(cmd)
	asJSON := jsonFlag(cmd, "the outcome")
	cmd.RunE = func(cmd *cobra.Command, pos []string) error {
		ctx := cmd.Context()
		n, err := versionArg(pos[1])
		if err != nil {
			return err
		}
		if err := checkGroup(*group); err != nil {
			return err
		}
		if *drop && !*yes {
			if err := confirm(env, fmt.Sprintf("drop schema %s (every row and snapshot of %s v%d)?", archive.Schema(n), pos[0], n),
				archive.Schema(n)); err != nil {
				return err
			}
		}
		pool, js, closeAll, err := connectBoth(ctx, c)
		if err != nil {
			return err
		}
		defer closeAll()
		if err := version.Retire(ctx, pool, js, pos[0], n, version.RetireOptions{Source: c.sourceName, Drop: *drop,
			WaitReleased: waitReleased, Group: *group}); err != nil {
			return err
		}
		if *asJSON {
			return writeJSON(env.Stdout, map[string]any{"projection": pos[0], "version": n, "state": version.StateRetired, "dropped": *drop})
		}
		what := "its consumers and progress rows deleted; schema kept"
		if *drop {
			what = "its consumers, progress rows and schema dropped"
		}
		fmt.Fprintf(env.Stdout, "%s v%d retired: %s\n", pos[0], n, what)
		return nil
	}
	return cmd
}

// confirm asks on a terminal to type want; off a terminal it refuses
// (the caller offers --yes).
func confirm(env *Env, question, want string) error {
	if !cli.IsTerminal(env.Stdin) {
		return cli.Usage("%v", errNeedTerminal)
	}
	fmt.Fprintf(env.Stderr, "%s\ntype %q to confirm: ", question, want)
	line, err := bufio.NewReader(env.Stdin).ReadString('\n')
	if err != nil && line == "" {
		return fmt.Errorf("read confirmation: %w", err)
	}
	if strings.TrimSpace(line) != want {
		return errors.New("not confirmed: nothing changed")
	}
	return nil
}

func waitCommand(env *Env) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "wait --lsn <source LSN>",
		Short: "wait until the live archive is complete up to --lsn (read your deletes)",
		Long: `wait blocks until the live archive is complete up to an LSN: take
SELECT pg_current_wal_insert_lsn() in the session after your delete committed.
Exit status 0 when complete, 1 on error (a usage error too), 2 on timeout (naming where the
archive is), 3 when it cannot be complete up to the LSN: an event at or
before it is quarantined, or an unacknowledged gap starts at or before it
(naming them).`,
		Example: `  projector wait --lsn 0/1A2B3C8 --timeout 10s`,
		Args:    cli.NoArgs,
	}
	cli.UsageExit(cmd, cli.ExitError) // 2 is a timeout here (wait's exit codes)
	c := commonFlags(cmd, env)
	lsnText := cmd.Flags().String("lsn", "", "source LSN: SELECT pg_current_wal_insert_lsn() in the session, after your delete committed (pg_current_wal_lsn() lags it with synchronous_commit = off)")
	var timeout time.Duration
	cli.Local(cmd).Duration(&timeout, "timeout", "", 30*time.Second, "give up after this long (exit status 2)", cli.Positive())
	proj := projectionFlag(cmd)
	asJSON := jsonFlag(cmd, "the live version's readiness (archive.status) once complete")
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		ctx := cmd.Context()
		lsn, err := event.ParseLSN(*lsnText)
		if err != nil || lsn == 0 {
			return cli.Usage("--lsn %q: want a source LSN such as 0/1A2B3C8 (usage: %s)", *lsnText, cmd.UseLine())
		}
		if err := checkProjection(*proj); err != nil {
			return err
		}
		pool, err := targetPool(ctx, c)
		if err != nil {
			return err
		}
		defer pool.Close()
		wctx, cancel := context.WithTimeout(ctx, timeout)
		defer cancel()
		r, err := status.WaitComplete(wctx, pool, *proj, lsn, 0)
		var ie *status.IncompleteError
		var te *status.TimeoutError
		switch {
		case errors.As(err, &ie):
			return cli.WithCode(cli.ExitNotEqual, err)
		case errors.As(err, &te) && ctx.Err() == nil:
			return cli.WithCode(cli.ExitTimeout, err)
		case err != nil:
			return err
		}
		if *asJSON {
			return writeJSON(env.Stdout, r)
		}
		fmt.Fprintf(env.Stdout, "%s v%d is complete up to %s (asked %s)\n", r.Projection, r.Version, r.CompleteUpToLSN, lsn)
		return nil
	}
	return cmd
}

// sampleRates takes a second status sample after d when a version is
// being built or caught up, so events/s and the ETA can be shown.
func sampleRates(ctx context.Context, db *pgxpool.Pool, js jetstream.JetStream, source string, first *status.Status, d time.Duration) (*status.Status, error) {
	busy := false
	for _, v := range first.Versions {
		busy = busy || v.State == version.StateBuilding || v.State == version.StateCatchingUp
	}
	if !busy || d <= 0 || js == nil {
		return first, nil
	}
	select {
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-time.After(d):
	}
	st, err := status.CollectStatus(ctx, db, js, source, time.Now())
	if err != nil {
		return nil, err
	}
	st.FillRates(first)
	return st, nil
}

// followVersions waits, one after the other, for every version that is
// building or catching up to become ready (`projector status --wait`).
func followVersions(ctx context.Context, pool *pgxpool.Pool, js jetstream.JetStream, source string, w io.Writer) error {
	vs, err := version.ListVersions(ctx, pool, "")
	if err != nil {
		return err
	}
	followed := 0
	for _, v := range vs {
		if v.State != version.StateBuilding && v.State != version.StateCatchingUp {
			continue
		}
		followed++
		if err := waitReady(ctx, pool, js, source, v, w); err != nil {
			return err
		}
	}
	if followed == 0 {
		fmt.Fprintln(w, "no version is being built")
	}
	return nil
}
