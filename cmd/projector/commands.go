package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sort"
	"strings"

	redactpkg "github.com/epitaph-dev/epitaph/redact"
)

// Env is what a subcommand gets from the process: environment, output and
// logger (so subcommands are testable without globals).
type Env struct {
	Getenv func(string) string
	Stdout io.Writer
	Stderr io.Writer
	Logger *slog.Logger

	// bad collects environment variables whose values do not parse; a
	// subcommand refuses to run with any (never silently uses a default).
	bad []string
}

func (e *Env) badEnv(key, value, want string) {
	e.bad = append(e.bad, fmt.Sprintf("%s=%q is not %s", key, value, want))
}

// envErr reports every unparseable EPITAPH_* variable seen so far.
func (e *Env) envErr() error {
	if len(e.bad) == 0 {
		return nil
	}
	return errors.New("bad environment: " + strings.Join(e.bad, "; "))
}

// Command is one subcommand. Adding a subcommand is one file whose init()
// calls register.
type Command struct {
	Summary string
	Run     func(ctx context.Context, args []string, env *Env) error
}

var commands = map[string]Command{}

// exitError is an error that ends the process with a status other than 1
// (wait: 2 timeout, 3 cannot be complete).
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string { return e.err.Error() }
func (e *exitError) Unwrap() error { return e.err }

// ExitCode is the process exit status for err: 0 for nil, the code of an
// exitError, else 1.
func ExitCode(err error) int {
	var ee *exitError
	switch {
	case err == nil:
		return 0
	case errors.As(err, &ee):
		return ee.code
	default:
		return 1
	}
}

func register(name string, c Command) {
	if _, dup := commands[name]; dup {
		panic("projector: subcommand registered twice: " + name)
	}
	commands[name] = c
}

func dispatch(ctx context.Context, args []string, env *Env) error {
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		usage(env.Stderr)
		if len(args) == 0 {
			return errors.New("a subcommand is required")
		}
		return nil
	}
	c, ok := commands[args[0]]
	if !ok {
		usage(env.Stderr)
		return fmt.Errorf("unknown subcommand %q", args[0])
	}
	return c.Run(ctx, args[1:], env)
}

func usage(w io.Writer) {
	fmt.Fprintln(w, "usage: projector <subcommand> [flags]")
	names := make([]string, 0, len(commands))
	for n := range commands {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		fmt.Fprintf(w, "  %-12s %s\n", n, commands[n].Summary)
	}
}

// common holds the connection settings every subcommand shares.
type common struct {
	targetURL  string
	natsURL    string
	sourceName string
}

// commonFlags registers --target-url, --nats-url and --source-name with
// their EPITAPH_* defaults on fs.
func commonFlags(fs *flag.FlagSet, env *Env) *common {
	c := &common{}
	target := env.Getenv("EPITAPH_TARGET_URL")
	if target == "" {
		target = env.Getenv("EPITAPH_SOURCE_URL")
	}
	fs.StringVar(&c.targetURL, "target-url", target, "target Postgres URL (EPITAPH_TARGET_URL, default EPITAPH_SOURCE_URL)")
	fs.StringVar(&c.natsURL, "nats-url", envOr(env, "EPITAPH_NATS_URL", "nats://127.0.0.1:4222"), "JetStream URL (EPITAPH_NATS_URL)")
	fs.StringVar(&c.sourceName, "source-name", envOr(env, "EPITAPH_SOURCE_NAME", "main"), "source name (EPITAPH_SOURCE_NAME)")
	return c
}

func (c *common) check() error {
	if c.targetURL == "" {
		return errors.New("no target database: set EPITAPH_TARGET_URL (or EPITAPH_SOURCE_URL) or --target-url")
	}
	return nil
}

func envOr(env *Env, key, def string) string {
	if v := env.Getenv(key); v != "" {
		return v
	}
	return def
}

func newFlagSet(name string, env *Env) *flag.FlagSet {
	fs := flag.NewFlagSet("projector "+name, flag.ContinueOnError)
	fs.SetOutput(env.Stderr)
	return fs
}

func defaultWorkerID() string {
	h, err := os.Hostname()
	if err != nil || h == "" {
		h = "projector"
	}
	return fmt.Sprintf("%s-%d", h, os.Getpid())
}

func logLevel(s string) slog.Level {
	var l slog.Level
	if err := l.UnmarshalText([]byte(strings.ToUpper(s))); err != nil {
		return slog.LevelInfo
	}
	return l
}

// redact hides a URL's password for messages.
func redact(raw string) string { return redactpkg.URL(raw) }
