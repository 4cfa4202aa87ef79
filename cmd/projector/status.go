package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/epitaph-dev/epitaph/projection"
)

func init() {
	register("status", Command{Summary: "show versions, partitions, lag and quarantine (--json for the /status document)", Run: statusCmd})
}

func statusCmd(ctx context.Context, args []string, env *Env) error {
	fs := newFlagSet("status", env)
	c := commonFlags(fs, env)
	asJSON := fs.Bool("json", false, "print the JSON status document")
	follow := fs.Bool("wait", false, "follow every version being built until it is ready, with a progress bar on a terminal")
	sample := fs.Duration("sample", time.Second, "while a version is being rebuilt, sample twice this far apart for events/s and ETA (0: once)")
	if err := fs.Parse(args); err != nil {
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
	var js jetstream.JetStream
	if nc, err := c.natsConnect(nats.Timeout(3 * time.Second)); err == nil {
		defer nc.Close()
		js, _ = jetstream.New(nc)
	} else {
		fmt.Fprintf(env.Stderr, "projector: NATS %s unreachable (lag unknown): %v\n", redact(c.natsURL), err)
	}
	if *follow {
		if js == nil {
			return errors.New("status --wait needs NATS")
		}
		return followVersions(ctx, pool, js, c.sourceName, env.Stdout)
	}
	st, err := projection.CollectStatus(ctx, pool, js, c.sourceName, time.Now())
	if err != nil {
		return err
	}
	if st, err = sampleRates(ctx, pool, js, c.sourceName, st, *sample); err != nil {
		return err
	}
	if *asJSON {
		enc := json.NewEncoder(env.Stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(st)
	}
	return st.WriteTable(env.Stdout)
}
