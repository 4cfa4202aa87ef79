package main

import (
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/epitaph-dev/epitaph/cmd/internal/cli"
	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/handler/revalidate"
	"github.com/epitaph-dev/epitaph/internal/pgdial"
	"github.com/epitaph-dev/epitaph/projection"
)

// sourceURLFlag registers --source-url: the source database that
// revalidation reads before every delivery attempt.
func sourceURLFlag(f cli.Flags, p *string) {
	f.String(p, "source-url", "EPITAPH_SOURCE_URL", "", "source Postgres URL that revalidation reads before every delivery attempt (is the deleted key back?); "+
		"a handler with a source URL file reads its own; without either, deliveries of handlers that revalidate defer")
}

// sourceTCPTimeoutFlag registers --source-tcp-timeout, with the capture's
// name and default: how the projector dials the source.
func sourceTCPTimeoutFlag(f cli.Flags, p *time.Duration) {
	f.Duration(p, "source-tcp-timeout", "EPITAPH_SOURCE_TCP_TIMEOUT", projection.DefaultTargetTCPTimeout, "how long what the projector sends to the source (a revalidation read, a restore's statement, a keepalive probe while it waits for an answer) may stay unacknowledged before the connection is given up, so a path to the source that died silently fails the read or the restore within about this long (TCP_USER_TIMEOUT; Linux only; 1s to 24h; 0: the system's default, about 15 minutes)", cli.NotNegative())
}

// dialTimeout is a --*-tcp-timeout as pgdial.Set takes it (systemDefault),
// or a usage error naming the flag when it is out of range.
func dialTimeout(flag string, d time.Duration) (time.Duration, error) {
	if err := pgdial.CheckTimeout("--"+flag, "--"+flag, d); err != nil {
		return 0, cli.Usage("%w", err)
	}
	return systemDefault(d), nil
}

// systemDefault maps a --*-tcp-timeout's 0 (the system's default) to the
// negative value pgdial.Set and projection.Config take for it (0 is the
// default there).
func systemDefault(d time.Duration) time.Duration {
	if d == 0 {
		return -1
	}
	return d
}

// newRevalidator builds the evaluator the dispatcher calls before every
// attempt, dialling the source with sourceTCPTimeout (dialTimeout's).
// Close it after the dispatcher stopped.
func newRevalidator(pool *pgxpool.Pool, sourceURL string, sourceTCPTimeout time.Duration, env *Env, reg prometheus.Registerer) (*revalidate.Evaluator, handler.Revalidator, error) {
	if sourceURL == "" {
		env.Logger.Warn("no EPITAPH_SOURCE_URL (--source-url): every attempt of a handler that revalidates and has no source URL file fails, naming the setting; set it or add the handler with --no-revalidate")
	}
	ev, err := revalidate.New(pool, revalidate.Config{SourceURL: sourceURL, SourceTCPTimeout: sourceTCPTimeout, Logger: env.Logger, Registerer: reg})
	if err != nil {
		return nil, nil, err
	}
	return ev, ev.Revalidator(), nil
}
