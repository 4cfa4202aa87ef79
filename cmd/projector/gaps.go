package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/epitaph-dev/epitaph/projection"
)

func init() {
	register("gaps", Command{
		Summary: "what the archive is known to miss (archive.gaps): list [--json] | ack <id> --reason R",
		Run:     gapsCmd,
	})
}

const gapsUsage = `usage:
  projector gaps [--projection P] [--json]
  projector gaps ack <id> --reason TEXT [--version N]`

func gapsCmd(ctx context.Context, args []string, env *Env) error {
	if len(args) > 0 && args[0] == "ack" {
		return gapsAck(ctx, args[1:], env)
	}
	fs := newFlagSet("gaps", env)
	c := commonFlags(fs, env)
	proj := fs.String("projection", projection.ArchiveProjection, "projection")
	asJSON := fs.Bool("json", false, "print JSON: one object per active version with its gaps")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unknown gaps subcommand %q\n%s", fs.Arg(0), gapsUsage)
	}
	pool, err := targetPool(ctx, c)
	if err != nil {
		return err
	}
	defer pool.Close()
	vgs, err := projection.ListGaps(ctx, pool, *proj)
	if err != nil {
		return err
	}
	if *asJSON {
		if vgs == nil {
			vgs = []projection.VersionGaps{}
		}
		enc := json.NewEncoder(env.Stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(vgs)
	}
	if len(vgs) == 0 {
		fmt.Fprintf(env.Stdout, "%s has no active version\n", *proj)
		return nil
	}
	return projection.WriteGaps(env.Stdout, vgs)
}

func gapsAck(ctx context.Context, args []string, env *Env) error {
	fs := newFlagSet("gaps ack", env)
	c := commonFlags(fs, env)
	proj := fs.String("projection", projection.ArchiveProjection, "projection")
	version := fs.Int("version", 0, "the version whose gap it is (default: the live version)")
	reason := fs.String("reason", "", "why the loss is accepted (required; kept in archive.gaps.ack_reason)")
	pos, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	id, err := oneID(pos, "projector gaps ack <id> --reason TEXT")
	if err != nil {
		return err
	}
	if *reason == "" {
		return errors.New("gaps ack needs --reason TEXT (kept in archive.gaps.ack_reason)")
	}
	pool, err := targetPool(ctx, c)
	if err != nil {
		return err
	}
	defer pool.Close()
	g, err := projection.AckGap(ctx, pool, *proj, *version, id, *reason)
	if err != nil {
		return err
	}
	fmt.Fprintf(env.Stdout, "%s acknowledged: %s\n", g, *g.AckReason)
	return nil
}
