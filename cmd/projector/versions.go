package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/projection"
)

func init() {
	register("rebuild", Command{Summary: "create the next version of a projection, built beside the live one (--wait shows progress)", Run: rebuildCmd})
	register("compare", Command{Summary: "compare two versions: rows, checksums, snapshots, differing keys (exit 1 on difference)", Run: compareCmd})
	register("promote", Command{Summary: "make a ready version live (re-points the archive.* views in one transaction)", Run: promoteCmd})
	register("rollback", Command{Summary: "make the previous live version live again (it kept consuming)", Run: rollbackCmd})
	register("retire", Command{Summary: "stop a version, delete its consumers (--drop: and its schema)", Run: retireCmd})
	register("wait", Command{Summary: "wait until the live version reflects the source up to --lsn (read your deletes)", Run: waitCmd})
}

// errDiffer makes compare (and a refused promote) exit non-zero.
var errDiffer = errors.New("the versions differ")

// connectBoth opens the target pool and JetStream for a subcommand.
func connectBoth(ctx context.Context, c *common) (*pgxpool.Pool, jetstream.JetStream, func(), error) {
	pool, err := targetPool(ctx, c)
	if err != nil {
		return nil, nil, nil, err
	}
	nc, err := nats.Connect(c.natsURL, nats.Name("epitaph-projector cli"), nats.Timeout(5*time.Second))
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
		return 0, fmt.Errorf("version %q: want a number such as 2", s)
	}
	return n, nil
}

func rebuildCmd(ctx context.Context, args []string, env *Env) error {
	fs := newFlagSet("rebuild", env)
	c := commonFlags(fs, env)
	fs.Bool("from-start", true, "rebuild from the start of the stream (the default)")
	fromTime := fs.String("from-time", "", "PARTIAL rebuild: start every partition at its first message stored at or after this RFC 3339 time; older deletes are not in the new version")
	wait := fs.Bool("wait", false, "wait until the version is ready, showing progress (a bar on a terminal, lines otherwise)")
	note := fs.String("note", "", "why, recorded in the version's config")
	const usage = "projector rebuild <projection> [--from-start | --from-time T] [--wait]"
	pos, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return errors.New("usage: " + usage)
	}
	opts := projection.RebuildOptions{Projection: pos[0], Source: c.sourceName, Note: *note}
	if *fromTime != "" {
		if opts.FromTime, err = time.Parse(time.RFC3339, *fromTime); err != nil {
			return fmt.Errorf("--from-time: %w", err)
		}
	}
	pool, js, closeAll, err := connectBoth(ctx, c)
	if err != nil {
		return err
	}
	defer closeAll()
	v, err := projection.CreateVersion(ctx, pool, js, opts)
	if err != nil {
		return err
	}
	boundary := int64(0)
	if v.BoundarySeq != nil {
		boundary = *v.BoundarySeq
	}
	fmt.Fprintf(env.Stdout, "created %s v%d (schema %s, state %s, boundary seq %d, lsn %s)", v.Projection, v.Version, v.Schema, v.State,
		boundary, v.BoundaryLSN)
	if v.FromTime != nil {
		fmt.Fprintf(env.Stdout, "; partial rebuild from %s", v.FromTime.UTC().Format(time.RFC3339))
	}
	fmt.Fprintln(env.Stdout, "\nrunning projector workers build it in the background; watch it with `projector status`")
	if !*wait {
		return nil
	}
	return waitReady(ctx, pool, js, c.sourceName, v, env.Stdout)
}

func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}

// waitReady follows a version until it is ready (or live): a progress bar
// redrawn in place on a terminal, a line every few seconds otherwise. When
// every partition reaches the boundary it prints the rebuild rate.
func waitReady(ctx context.Context, pool *pgxpool.Pool, js jetstream.JetStream, source string, v projection.Version, w io.Writer) error {
	tty := isTerminal(w)
	var prev *projection.Status
	var firstDone time.Time
	var firstEvents uint64
	start := time.Now()
	lastLine := time.Time{}
	reported := false
	t := time.NewTicker(500 * time.Millisecond)
	defer t.Stop()
	for {
		st, err := projection.CollectStatus(ctx, pool, js, source, time.Now())
		if err != nil {
			return err
		}
		st.FillRates(prev)
		prev = st
		var vs *projection.VersionStatus
		for i := range st.Versions {
			if st.Versions[i].Projection == v.Projection && st.Versions[i].Version == v.Version {
				vs = &st.Versions[i]
			}
		}
		if vs == nil || vs.Lifecycle == nil {
			return fmt.Errorf("%s v%d: %w", v.Projection, v.Version, projection.ErrNoVersion)
		}
		lc := vs.Lifecycle
		if firstDone.IsZero() && lc.EventsDone > 0 {
			firstDone, firstEvents = st.At, lc.EventsDone
		}
		line := fmt.Sprintf("%s v%d %-11s %s %d/%d events %6.0f events/s ETA %-8s partitions at boundary %d/%d",
			v.Projection, v.Version, vs.State, projection.Bar(lc.Progress, 30), lc.EventsDone, lc.EventsToBoundary,
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
		case projection.StateReady, projection.StateLive:
			if tty {
				fmt.Fprintln(w)
			}
			fmt.Fprintf(w, "%s v%d is %s after %s; compare it with `projector compare %s <live> %d`, then `projector promote %s %d`\n",
				v.Projection, v.Version, vs.State, time.Since(start).Round(time.Second), v.Projection, v.Version, v.Projection, v.Version)
			return nil
		case projection.StateFailed, projection.StateRetired:
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

func compareFlags(fs *flag.FlagSet) (*ignoreFlag, *int, *bool) {
	ig := &ignoreFlag{}
	fs.Var(ig, "ignore", "accept an intended difference: expires_at (a TTL policy change) or snapshots (a change of snapshot roots); repeatable")
	maxKeys := fs.Int("max-keys", 20, "list at most this many differing rows")
	all := fs.Bool("all", false, "compare every archived row, not only the transactions both versions reflect")
	return ig, maxKeys, all
}

func compareCmd(ctx context.Context, args []string, env *Env) error {
	fs := newFlagSet("compare", env)
	c := commonFlags(fs, env)
	ig, maxKeys, all := compareFlags(fs)
	asJSON := fs.Bool("json", false, "print the comparison as JSON")
	pos, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 3 {
		return errors.New("usage: projector compare <projection> <a> <b> [--ignore expires_at] [--all] [--json]")
	}
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
	cmp, err := projection.Compare(ctx, pool, projection.CompareOptions{Projection: pos[0], A: a, B: b,
		IgnoreExpiresAt: ig.expiresAt, IgnoreSnapshots: ig.snapshots, MaxKeys: *maxKeys, All: *all})
	if err != nil {
		return err
	}
	if *asJSON {
		err = writeJSON(env.Stdout, cmp)
	} else {
		err = cmp.WriteText(env.Stdout)
	}
	if err != nil {
		return err
	}
	if !cmp.Equal {
		return errDiffer
	}
	return nil
}

func promoteCmd(ctx context.Context, args []string, env *Env) error {
	fs := newFlagSet("promote", env)
	c := commonFlags(fs, env)
	force := fs.Bool("force", false, "promote even if the version is not ready or differs from the live one")
	ig, maxKeys, all := compareFlags(fs)
	pos, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 2 {
		return errors.New("usage: projector promote <projection> <version> [--ignore expires_at] [--force]")
	}
	n, err := versionArg(pos[1])
	if err != nil {
		return err
	}
	pool, err := targetPool(ctx, c)
	if err != nil {
		return err
	}
	defer pool.Close()
	if !*force {
		vs, err := projection.ListVersions(ctx, pool, pos[0])
		if err != nil {
			return err
		}
		for _, v := range vs {
			if v.State != projection.StateLive || v.Version == n {
				continue
			}
			cmp, err := projection.Compare(ctx, pool, projection.CompareOptions{Projection: pos[0], A: v.Version, B: n,
				IgnoreExpiresAt: ig.expiresAt, IgnoreSnapshots: ig.snapshots, MaxKeys: *maxKeys, All: *all})
			if err != nil {
				return err
			}
			if !cmp.Equal {
				_ = cmp.WriteText(env.Stderr)
				return fmt.Errorf("refusing to promote %s v%d: it differs from the live v%d (--ignore expires_at accepts a TTL change; --force promotes anyway): %w",
					pos[0], n, v.Version, errDiffer)
			}
			fmt.Fprintf(env.Stdout, "compare v%d v%d: %d tables equal up to %s", v.Version, n, len(cmp.Tables), orDashText(cmp.UpTo))
			if cmp.ExpiresAtDiffers > 0 {
				fmt.Fprintf(env.Stdout, " (expires_at differs on %d rows: accepted)", cmp.ExpiresAtDiffers)
			}
			fmt.Fprintln(env.Stdout)
		}
	}
	prev, err := projection.Promote(ctx, pool, pos[0], n, *force)
	if err != nil {
		return err
	}
	if prev > 0 {
		fmt.Fprintf(env.Stdout, "%s v%d is live (archive.* views re-pointed); v%d is ready and keeps consuming: `projector rollback %s` switches back\n",
			pos[0], n, prev, pos[0])
	} else {
		fmt.Fprintf(env.Stdout, "%s v%d is live (archive.* views re-pointed)\n", pos[0], n)
	}
	return nil
}

func orDashText(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func rollbackCmd(ctx context.Context, args []string, env *Env) error {
	fs := newFlagSet("rollback", env)
	c := commonFlags(fs, env)
	pos, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return errors.New("usage: projector rollback <projection>")
	}
	pool, err := targetPool(ctx, c)
	if err != nil {
		return err
	}
	defer pool.Close()
	from, to, err := projection.Rollback(ctx, pool, pos[0])
	if err != nil {
		return err
	}
	fmt.Fprintf(env.Stdout, "%s v%d is live again (archive.* views re-pointed); v%d is ready\n", pos[0], to, from)
	return nil
}

func retireCmd(ctx context.Context, args []string, env *Env) error {
	fs := newFlagSet("retire", env)
	c := commonFlags(fs, env)
	drop := fs.Bool("drop", false, "also drop the version's schema (its rows and snapshots)")
	waitReleased := fs.Duration("wait-released", 30*time.Second, "how long to wait for workers to hand the version's partitions back")
	pos, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 2 {
		return errors.New("usage: projector retire <projection> <version> [--drop]")
	}
	n, err := versionArg(pos[1])
	if err != nil {
		return err
	}
	pool, js, closeAll, err := connectBoth(ctx, c)
	if err != nil {
		return err
	}
	defer closeAll()
	if err := projection.Retire(ctx, pool, js, pos[0], n, projection.RetireOptions{Source: c.sourceName, Drop: *drop,
		WaitReleased: *waitReleased}); err != nil {
		return err
	}
	what := "its consumers and progress rows deleted; schema kept"
	if *drop {
		what = "its consumers, progress rows and schema dropped"
	}
	fmt.Fprintf(env.Stdout, "%s v%d retired: %s\n", pos[0], n, what)
	return nil
}

func waitCmd(ctx context.Context, args []string, env *Env) error {
	fs := newFlagSet("wait", env)
	c := commonFlags(fs, env)
	lsnText := fs.String("lsn", "", "source LSN: SELECT pg_current_wal_insert_lsn() in the session, after your delete committed (pg_current_wal_lsn() lags it with synchronous_commit = off)")
	timeout := fs.Duration("timeout", 30*time.Second, "give up after this long (exit status 2)")
	proj := fs.String("projection", projection.ArchiveProjection, "projection")
	if err := fs.Parse(args); err != nil {
		return err
	}
	lsn, err := event.ParseLSN(*lsnText)
	if err != nil || lsn == 0 || fs.NArg() > 0 {
		return errors.New("usage: projector wait --lsn <source LSN> [--timeout 30s]  (exit 0 complete, 1 error, 2 timeout, 3 quarantined or in a gap)")
	}
	pool, err := targetPool(ctx, c)
	if err != nil {
		return err
	}
	defer pool.Close()
	wctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	r, err := projection.WaitComplete(wctx, pool, *proj, lsn, 0)
	var ie *projection.IncompleteError
	var te *projection.TimeoutError
	switch {
	case errors.As(err, &ie):
		return &exitError{code: 3, err: err}
	case errors.As(err, &te) && ctx.Err() == nil:
		return &exitError{code: 2, err: err}
	case err != nil:
		return err
	}
	fmt.Fprintf(env.Stdout, "%s v%d is complete up to %s (asked %s)\n", r.Projection, r.Version, r.CompleteUpToLSN, lsn)
	return nil
}

// sampleRates takes a second status sample after d when a version is
// being built or caught up, so events/s and the ETA can be shown.
func sampleRates(ctx context.Context, db *pgxpool.Pool, js jetstream.JetStream, source string, first *projection.Status, d time.Duration) (*projection.Status, error) {
	busy := false
	for _, v := range first.Versions {
		busy = busy || v.State == projection.StateBuilding || v.State == projection.StateCatchingUp
	}
	if !busy || d <= 0 || js == nil {
		return first, nil
	}
	select {
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-time.After(d):
	}
	st, err := projection.CollectStatus(ctx, db, js, source, time.Now())
	if err != nil {
		return nil, err
	}
	st.FillRates(first)
	return st, nil
}

// followVersions waits, one after the other, for every version that is
// building or catching up to become ready (`projector status --wait`).
func followVersions(ctx context.Context, pool *pgxpool.Pool, js jetstream.JetStream, source string, w io.Writer) error {
	vs, err := projection.ListVersions(ctx, pool, "")
	if err != nil {
		return err
	}
	followed := 0
	for _, v := range vs {
		if v.State != projection.StateBuilding && v.State != projection.StateCatchingUp {
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
