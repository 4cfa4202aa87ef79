package main

import (
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/epitaph-dev/epitaph/cmd/internal/cli"
	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/handler/revalidate"
)

// sourceURLFlag registers --source-url: the source database that
// revalidation reads before every delivery attempt.
func sourceURLFlag(f cli.Flags, p *string) {
	f.String(p, "source-url", "EPITAPH_SOURCE_URL", "", "source Postgres URL that revalidation reads before every delivery attempt (is the deleted key back?); "+
		"a handler with a source URL file reads its own; without either, deliveries of handlers that revalidate defer")
}

// newRevalidator builds the evaluator the dispatcher calls before every
// attempt. Close it after the dispatcher stopped.
func newRevalidator(pool *pgxpool.Pool, sourceURL string, env *Env, reg prometheus.Registerer) (*revalidate.Evaluator, handler.Revalidator, error) {
	if sourceURL == "" {
		env.Logger.Warn("no EPITAPH_SOURCE_URL (--source-url): every attempt of a handler that revalidates and has no source URL file fails, naming the setting; set it or add the handler with --no-revalidate")
	}
	ev, err := revalidate.New(pool, revalidate.Config{SourceURL: sourceURL, Logger: env.Logger, Registerer: reg})
	if err != nil {
		return nil, nil, err
	}
	return ev, ev.Revalidator(), nil
}
