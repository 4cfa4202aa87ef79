package main

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/epitaph-dev/epitaph/migrations"
)

func init() {
	register("migrate", Command{Summary: "apply the epitaph control-schema migrations to the target", Run: migrateCmd})
}

func migrateCmd(ctx context.Context, args []string, env *Env) error {
	fs := newFlagSet("migrate", env)
	c := commonFlags(fs, env)
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
	if err := migrations.Apply(ctx, pool); err != nil {
		return err
	}
	applied, err := migrations.Applied(ctx, pool)
	if err != nil {
		return err
	}
	fmt.Fprintf(env.Stdout, "epitaph schema at version %d (%d migrations applied)\n", applied[len(applied)-1], len(applied))
	return nil
}
