package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/spf13/cobra"

	"github.com/epitaph-dev/epitaph/cmd/internal/cli"
	"github.com/epitaph-dev/epitaph/internal/natsconn"
	"github.com/epitaph-dev/epitaph/internal/pgdial"
	redactpkg "github.com/epitaph-dev/epitaph/internal/redact"
	"github.com/epitaph-dev/epitaph/projection"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// Env is what a subcommand gets from the process: environment, terminal,
// output and logger (so subcommands are testable without globals).
type Env struct {
	// Getenv reads a variable; an empty value counts as unset unless
	// LookupEnv is given.
	Getenv    func(string) string
	LookupEnv func(string) (string, bool)
	// Stdin answers confirmation prompts (retire --drop) when it is a
	// terminal.
	Stdin  io.Reader
	Stdout io.Writer
	Stderr io.Writer
	// Logger, when nil, is built from --log-level and --log-format.
	Logger *slog.Logger
	// configSourceURL: source-url in the --config file, the target's
	// default after EPITAPH_SOURCE_URL.
	configSourceURL string
}

func (e *Env) lookup(key string) (string, bool) {
	if e.LookupEnv != nil {
		return e.LookupEnv(key)
	}
	if e.Getenv == nil {
		return "", false
	}
	v := e.Getenv(key)
	return v, v != ""
}

// builders make the subcommands. Adding a subcommand is one file whose
// init() calls register.
var builders []func(env *Env) *cobra.Command

func register(b func(env *Env) *cobra.Command) { builders = append(builders, b) }

// newRoot is the projector's command tree.
func newRoot(env *Env) *cobra.Command {
	root := &cobra.Command{
		Use:   "projector",
		Short: "apply a source's Epitaph stream to read models in a target Postgres",
		Long: `projector applies a source's Epitaph stream (JetStream EPITAPH_<SOURCE>) to
versioned read models in a target PostgreSQL: the archive of deleted rows and
snapshot documents. ` + "`projector run`" + ` is the worker; the other commands
inspect and operate it.

Every flag has an EPITAPH_* environment variable (named in its help); the
command line overrides the environment, and both override the YAML file
--config names (keys are the flags' names), which every command reads, so
URLs and credentials are set once. A malformed or out-of-range value is
refused, never replaced by the default.

Exit status: 0 success, 1 error, 2 usage (unknown command or flag, bad value,
wrong arguments), 3 "no" (compare found differences, a status check failed;
wait: see its help).`,
		Example: `  projector migrate
  projector run
  projector status --wait
  projector rebuild archive --wait && projector compare archive 1 2 && projector promote archive 2`,
	}
	cli.Group(root)
	logging := cli.LogFlags(root)
	cli.ConfigFlag(root)
	root.PersistentPreRunE = func(cmd *cobra.Command, _ []string) error {
		if err := cli.ApplyEnv(cmd, env.lookup); err != nil {
			return err
		}
		env.configSourceURL, _ = cli.ConfigValue(cmd, "source-url")
		if env.Logger == nil {
			env.Logger = logging.Logger(env.Stderr)
		}
		return nil
	}
	for _, b := range builders {
		root.AddCommand(b(env))
	}
	cli.SetVersion(root)
	cli.Prepare(root, env.Stdout, env.Stderr)
	return root
}

// dispatch runs the command line args.
func dispatch(ctx context.Context, args []string, env *Env) error {
	if env.Stdin == nil {
		env.Stdin = os.Stdin
	}
	root := newRoot(env)
	root.SetArgs(args)
	return cli.Execute(ctx, root)
}

// common holds the connection settings every subcommand shares.
type common struct {
	targetURL        string
	targetTCPTimeout time.Duration
	natsURL          string
	sourceName       string
	natsAuth         natsconn.Auth
	env              *Env
	cmd              *cobra.Command
}

// commonFlags registers --target-url, --target-tcp-timeout, --nats-url,
// --source-name and the NATS authentication flags.
func commonFlags(cmd *cobra.Command, env *Env) *common {
	c := &common{env: env, cmd: cmd}
	f := cli.Local(cmd)
	f.String(&c.targetURL, "target-url", "EPITAPH_TARGET_URL", "", "target Postgres URL (default: the source URL, EPITAPH_SOURCE_URL or --source-url where the command has it)")
	f.Duration(&c.targetTCPTimeout, "target-tcp-timeout", "EPITAPH_TARGET_TCP_TIMEOUT", projection.DefaultTargetTCPTimeout, "how long what the projector sends to the target (a statement, a page, a lease renewal, a keepalive probe while it waits for an answer) may stay unacknowledged before the connection is given up, so a path to the target that died silently (a failover to another address) is noticed within about this long: run retries the work on a new connection, a one-shot command fails (TCP_USER_TIMEOUT; Linux only; 1s to 24h; 0: the system's default, about 15 minutes)", cli.NotNegative())
	f.String(&c.natsURL, "nats-url", "EPITAPH_NATS_URL", "nats://127.0.0.1:4222", "JetStream URL")
	f.String(&c.sourceName, "source-name", "EPITAPH_SOURCE_NAME", projection.DefaultSourceName, "source name")
	// NATS authentication: the flags both binaries share.
	for _, nf := range natsconn.Flags {
		usage := nf.Usage
		if nf.Name == "nats-creds" {
			usage += "; with the capture's embedded broker: <its data dir>/nats/projector.creds, or the target's own from capture creds --target NAME"
		}
		f.String(nf.Field(&c.natsAuth), nf.Name, nf.Env, "", usage)
	}
	return c
}

func (c *common) check() error {
	if f := c.cmd.Flags().Lookup("source-url"); c.targetURL == "" && f != nil {
		// The command's own --source-url (run's revalidation source,
		// restore's): set by flag, EPITAPH_SOURCE_URL or the file.
		c.targetURL = f.Value.String()
	}
	if c.targetURL == "" {
		c.targetURL, _ = c.env.lookup("EPITAPH_SOURCE_URL")
	}
	if c.targetURL == "" {
		c.targetURL = c.env.configSourceURL
	}
	if c.targetURL == "" {
		return cli.Usage("no target database: set EPITAPH_TARGET_URL (or EPITAPH_SOURCE_URL), --target-url, or target-url (source-url) in --config")
	}
	if _, err := dialTimeout("target-tcp-timeout", c.targetTCPTimeout); err != nil {
		return err
	}
	if err := c.natsAuth.Validate(c.natsURL); err != nil {
		return cli.Usage("%w", err)
	}
	return nil
}

// tcpTimeout is --target-tcp-timeout as projection.Config and pgdial.Set
// take it (systemDefault).
func (c *common) tcpTimeout() time.Duration { return systemDefault(c.targetTCPTimeout) }

// targetPool opens a pool on the target for a command, dialled as run
// dials it (--target-tcp-timeout): a statement whose path died silently
// fails within about the timeout instead of waiting for TCP to give up.
func (c *common) targetPool(ctx context.Context) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(c.targetURL)
	if err != nil {
		return nil, cli.Usage("target URL %s: %w", redact(c.targetURL), err)
	}
	pgdial.Set(&cfg.ConnConfig.Config, c.tcpTimeout())
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("connect to target %s: %w", redact(c.targetURL), err)
	}
	return pool, nil
}

// natsConnect connects to NATS with the authentication flags. The
// connection's asynchronous errors (a permissions violation) go to the
// debug log, not to stderr as the NATS client's default handler writes
// them: the command reports what they cost in its own one line.
func (c *common) natsConnect(opts ...nats.Option) (*nats.Conn, error) {
	auth, err := c.natsAuth.Options(c.natsURL)
	if err != nil {
		return nil, err
	}
	quiet := nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
		if c.env != nil && c.env.Logger != nil {
			c.env.Logger.Debug("nats", "err", redactpkg.Text(err.Error()))
		}
	})
	return nats.Connect(c.natsURL, append(append([]nats.Option{quiet}, opts...), auth...)...)
}

// groupFlag registers --group, the consumer group, on
// the commands that create or delete the projector's JetStream consumers.
func groupFlag(cmd *cobra.Command) *string {
	g := new(string)
	cli.Local(cmd).String(g, "group", "EPITAPH_GROUP", "",
		"consumer group: durable consumers are <group>_<projection>-v<N>-p<p>-<random hex>, the name recorded on the progress row (default group: a hash of the target's system identifier and database name, so projectors of different targets never share consumers)")
	return g
}

// checkGroup refuses a malformed --group as a usage error.
func checkGroup(g string) error {
	if g == "" {
		return nil
	}
	if err := version.ValidateGroup(g); err != nil {
		return cli.Usage("--group: %w", err)
	}
	return nil
}

// jsonFlag registers --json.
func jsonFlag(cmd *cobra.Command, what string) *bool {
	p := new(bool)
	cmd.Flags().BoolVar(p, "json", false, "print "+what+" as JSON (snake_case; see docs/cli)")
	return p
}

func defaultWorkerID() string {
	h, err := os.Hostname()
	if err != nil || h == "" {
		h = "projector"
	}
	return fmt.Sprintf("%s-%d", h, os.Getpid())
}

// redact hides a URL's password for messages.
func redact(raw string) string { return redactpkg.URL(raw) }

var errNeedTerminal = errors.New("refusing without confirmation: stdin is not a terminal (pass --yes)")
