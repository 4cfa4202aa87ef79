// Command capture publishes the source database's deletes to JetStream.
// Every flag has an EPITAPH_* environment variable; see --help.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime/debug"
	"strings"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/spf13/cobra"

	"github.com/epitaph-dev/epitaph/capture"
	"github.com/epitaph-dev/epitaph/cmd/internal/cli"
	"github.com/epitaph-dev/epitaph/internal/broker"
	"github.com/epitaph-dev/epitaph/internal/natsconn"
)

func main() {
	os.Exit(cli.Report(os.Stderr, "capture", run(os.Args[1:])))
}

// run runs the capture with the process's environment.
func run(args []string) error {
	return execute(context.Background(), args, os.LookupEnv, os.Stdout, os.Stderr)
}

func execute(ctx context.Context, args []string, lookup func(string) (string, bool), stdout, stderr io.Writer) error {
	root := newCommand(lookup, stdout, stderr)
	root.SetArgs(args)
	return cli.Execute(ctx, root)
}

// newCommand is the capture's command line; logs and errors go to stderr.
func newCommand(lookup func(string) (string, bool), stdout, stderr io.Writer) *cobra.Command {
	var cfg capture.Config
	var tables, cpuProfile, heapProfile string
	var allowKeyOnly bool
	var failoverSlot bool
	var sourceTCPTimeout time.Duration
	root := &cobra.Command{
		Use:   "capture [flags]",
		Short: "publish the source database's deletes to JetStream",
		Long: `capture reads the DELETEs (and TRUNCATEs) of a PostgreSQL database from a
logical replication slot and publishes them to the JetStream stream
EPITAPH_<SOURCE-NAME>. With no --nats-url it runs an embedded JetStream server.

Every flag has an EPITAPH_* environment variable (named in its help); the
command line overrides the environment, and both override the YAML file
--config names (keys are the flags' names). A malformed or out-of-range value
is refused, never replaced by the default.`,
		Example: `  # one machine, embedded broker
  EPITAPH_SOURCE_URL=postgres://epitaph@db:5432/app capture

  # an external JetStream cluster, standby for takeover
  capture --source-url postgres://epitaph@db:5432/app --nats-url nats://nats:4222 --standby`,
		Args: cli.NoArgs,
		PersistentPreRunE: func(cmd *cobra.Command, _ []string) error {
			return cli.ApplyEnv(cmd, lookup)
		},
	}
	logging := cli.LogFlags(root)
	cli.ConfigFlag(root)
	f := cli.Local(root)
	f.String(&cfg.SourceURL, "source-url", "EPITAPH_SOURCE_URL", "", "source database URL (postgres://user:pass@host:port/db)", cli.KeepEmpty())
	f.Duration(&sourceTCPTimeout, "source-tcp-timeout", "EPITAPH_SOURCE_TCP_TIMEOUT", capture.DefaultSourceTCPTimeout, "how long what the capture sends to the source (a status update, a query, a keepalive probe) may stay unacknowledged before the connection is given up and the capture reconnects, so a network path that died silently is noticed within about this long (TCP_USER_TIMEOUT; Linux only; 1s to 24h; 0: the system's default, about 15 minutes)", cli.NotNegative())
	f.String(&cfg.NATSURL, "nats-url", "EPITAPH_NATS_URL", "", "JetStream server URL; empty runs an embedded server", cli.KeepEmpty())
	f.String(&cfg.EmbeddedListen, "nats-listen", "EPITAPH_NATS_LISTEN", broker.DefaultListen, "listen address of the embedded JetStream server", cli.KeepEmpty())
	f.String(&cfg.DataDir, "data-dir", "EPITAPH_DATA_DIR", "./epitaph-data", "directory of the embedded JetStream server's files", cli.KeepEmpty())
	f.String(&cfg.SourceName, "source-name", "EPITAPH_SOURCE_NAME", capture.DefaultSourceName, "source name (stream EPITAPH_<NAME>)", cli.KeepEmpty())
	f.String(&tables, "tables", "EPITAPH_TABLES", "", "comma-separated schema.table list; empty: every table whose deletes can be published safely", cli.KeepEmpty())
	f.Int(&cfg.Partitions, "partitions", "EPITAPH_PARTITIONS", capture.DefaultPartitions, "stream partitions (fixed when the stream is made)", cli.Min(1), cli.Max(1024))
	f.String(&cfg.SlotName, "slot", "EPITAPH_SLOT", capture.DefaultSlotName, "replication slot", cli.KeepEmpty())
	f.String(&cfg.PublicationName, "publication", "EPITAPH_PUBLICATION", capture.DefaultPublicationName, "publication", cli.KeepEmpty())
	f.String(&cfg.MetricsAddr, "metrics-addr", "EPITAPH_METRICS_ADDR", "127.0.0.1:9187", "address of /metrics, /livez, /readyz, /healthz, /status; empty disables", cli.KeepEmpty())
	f.Bool(&cfg.SetReplicaIdentityFull, "set-replica-identity-full", "EPITAPH_SET_REPLICA_IDENTITY_FULL", false, "ALTER captured tables to REPLICA IDENTITY FULL, so their deletes archive whole rows (recorded on the source: capture uninstall puts them back)")
	f.Bool(&allowKeyOnly, "allow-key-only", "EPITAPH_ALLOW_KEY_ONLY", false, "capture tables that are not REPLICA IDENTITY FULL, their deletes carrying only the key; without it (or --set-replica-identity-full) the capture refuses them")
	f.Bool(&cfg.RecreateSlot, "recreate-slot", "EPITAPH_RECREATE_SLOT", false, "recreate a missing or invalidated slot and record a gap event")
	f.Bool(&failoverSlot, "failover-slot", "EPITAPH_FAILOVER_SLOT", true, "create (or alter at start) the slot with FAILOVER on PostgreSQL 17+, so standbys with sync_replication_slots keep a copy that survives their promotion; ignored on older servers")
	f.Var(&retentionValue{cfg: &cfg}, "retention", "EPITAPH_RETENTION", "the stream limits that may discard events (default none: every event kept, rebuilds need them): a max age such as 720h, or max-age=D,max-bytes=N[K|M|G|T],max-msgs=N,max-msgs-per-subject=N. Any other discarding limit on the stream makes the capture refuse to start; one changed while it streams is restored")
	f.Duration(&cfg.StreamCheckInterval, "stream-check-interval", "EPITAPH_STREAM_CHECK_INTERVAL", capture.DefaultStreamCheckInterval, "how often the stream's limits are checked (and restored) while streaming; negative: only at start", cli.NotZero())
	f.Duration(&cfg.HeartbeatInterval, "heartbeat-interval", "EPITAPH_HEARTBEAT_INTERVAL", capture.DefaultHeartbeatInterval, "heartbeat interval (negative: no heartbeats)", cli.NotZero())
	f.Duration(&cfg.HeartbeatQuiet, "heartbeat-quiet", "EPITAPH_HEARTBEAT_QUIET", capture.DefaultHeartbeatQuiet, "after a captured transaction, emit one heartbeat once no other has followed for this long (at least 50ms), so every partition's watermark reaches its commit (negative: only the interval's heartbeats)", cli.NotZero())
	f.Duration(&cfg.DuplicateWindow, "duplicate-window", "EPITAPH_DUPLICATE_WINDOW", capture.DefaultDuplicateWindow, "JetStream dedupe window (at least 100ms); no guarantee rests on it, the server holds every message id of it in memory", cli.Positive())
	f.Duration(&cfg.BrokerSyncInterval, "broker-sync-interval", "EPITAPH_BROKER_SYNC_INTERVAL", 0, "how long confirmations trail acks for a 1-replica stream (0: embedded 10s, external 2m; negative: none)")
	f.Enum(&cfg.StreamPersist, "stream-persist", "EPITAPH_STREAM_PERSIST", capture.PersistAuto,
		[]string{capture.PersistAuto, capture.PersistAsync, capture.PersistDefault},
		"persist mode of a new stream: async (acknowledge before the write; safe with the trailing confirmation), default (write, then acknowledge) or auto (async with the embedded broker)")
	f.Int(&cfg.MaxInFlight, "max-in-flight", "EPITAPH_MAX_IN_FLIGHT", capture.DefaultMaxInFlight, "messages in flight (published, not yet acknowledged) at most", cli.Positive())
	f.Int(&cfg.Replicas, "replicas", "EPITAPH_REPLICAS", 1, "stream replicas when the stream is created", cli.Min(1), cli.Max(5))
	f.Bool(&cfg.Standby, "standby", "EPITAPH_STANDBY", false, "wait for the lease (an advisory lock on the source) instead of failing while another capture streams the slot; needs EPITAPH_NATS_URL")
	f.Duration(&cfg.StandbyPoll, "standby-poll", "EPITAPH_STANDBY_POLL", capture.DefaultStandbyPoll, "how often a standby tries the lease and the holder checks it", cli.Positive())
	// NATS authentication: the flags both binaries share.
	for _, nf := range natsconn.Flags {
		f.String(nf.Field(&cfg.NATSAuth), nf.Name, nf.Env, "", nf.Usage+"; external server only")
	}
	// Trust: the key the capture signs with.
	f.String(&cfg.SigningKey, "signing-key", "EPITAPH_SIGNING_KEY", "", "Ed25519 signing key file (PEM PKCS#8 or raw 32-byte seed; mode 0600, or group-readable 0440/0640 if owned by root); empty: <data-dir>/signing.key, generated on first start")
	// Following the source's schema while streaming.
	f.Duration(&cfg.CatalogPoll, "catalog-poll", "EPITAPH_CATALOG_POLL", capture.DefaultCatalogPoll, "how often the catalog is checked for new, changed and dropped tables while streaming (negative: never)", cli.NotZero())
	f.Bool(&cfg.InstallDDLGuard, "install-ddl-guard", "EPITAPH_INSTALL_DDL_GUARD", false, "install an event trigger on the DDL that can change what the publication may hold (needs a superuser); --ddl-guard-mode says what it does")
	f.Enum(&cfg.DDLGuardMode, "ddl-guard-mode", "EPITAPH_DDL_GUARD_MODE", capture.DDLGuardNotify,
		[]string{capture.DDLGuardNotify, capture.DDLGuardInline},
		"with --install-ddl-guard: notify (signal the capture, which publishes a new table tens of milliseconds after its transaction commits; adds a few percent to a CREATE TABLE) or inline (apply the publication rules inside the DDL's transaction, so no DELETE fails or is missed between two catalog polls; adds about a fifth to a CREATE TABLE)")
	// Sharing the source's CPUs: see capture.CPUModeTail.
	f.Int(&cfg.TailCPUs, "tail-cpus", "EPITAPH_TAIL_CPUS", defaultTailCPUs, "CPUs (GOMAXPROCS) while the capture tails the source, leaving the others to the source's backends; every CPU while it catches up a backlog of --catch-up-bytes or one found at start (0: every CPU always)", cli.Min(0))
	f.Int(&cfg.TailNice, "tail-nice", "EPITAPH_TAIL_NICE", defaultTailNice, "nice value of the capture's scheduling group (its Linux autogroup) while it tails within a quarter of --catch-up-bytes of the source, so a burst of the source's deletes goes first on shared CPUs; 0 further behind and while it catches up (0: never lowered). Applied when the capture leads its own session (a service, or setsid) in the root CPU cgroup; /status cpu_nice_unavailable says why not", cli.Min(0), cli.Max(19))
	f.Int64(&cfg.CatchUpBytes, "catch-up-bytes", "EPITAPH_CATCH_UP_BYTES", capture.DefaultCatchUpBytes, "WAL bytes behind the source at which a tailing capture uses every CPU (at least 1 MiB; it tails again within 1 MiB)")
	f.String(&cpuProfile, "cpu-profile", "EPITAPH_CPU_PROFILE", "", "write a pprof CPU profile of the whole run to this file (diagnostics; empty: off)", cli.KeepEmpty())
	f.String(&heapProfile, "heap-profile", "EPITAPH_HEAP_PROFILE", "", "write a pprof heap profile to this file each time the live heap reaches a new high, so it holds the run's peak (diagnostics; empty: off)", cli.KeepEmpty())
	root.RunE = func(cmd *cobra.Command, _ []string) error {
		cfg.NoFailoverSlot = !failoverSlot
		cfg.SourceTCPTimeout = sourceTCPTimeout
		if sourceTCPTimeout == 0 {
			cfg.SourceTCPTimeout = -1 // the library's zero is its default
		}
		for _, t := range strings.Split(tables, ",") {
			if t = strings.TrimSpace(t); t != "" {
				cfg.Tables = append(cfg.Tables, t)
			}
		}
		cfg.RefuseKeyOnly = !allowKeyOnly
		logs := stderr
		if logs == nil {
			logs = os.Stderr
		}
		log := logging.Logger(logs)
		if _, set := lookup("GOGC"); !set && cfg.NATSURL == "" {
			// The embedded JetStream server allocates per message in this
			// process: a larger GC target costs heap (bounded by the in-flight
			// window) but saves CPU on a busy drain. GOGC in the environment wins.
			debug.SetGCPercent(embeddedGOGC)
		}
		if cpuProfile != "" {
			stop, err := cli.StartCPUProfile(cpuProfile)
			if err != nil {
				return err
			}
			defer stop()
		}
		if heapProfile != "" {
			hp, err := startHeapProfile(heapProfile)
			if err != nil {
				return fmt.Errorf("--heap-profile: %w", err)
			}
			defer func() {
				if err := hp.Stop(); err != nil {
					log.Warn("heap profile", "err", err)
				}
			}()
		}
		reg := prometheus.NewRegistry()
		reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
		if err := cli.RegisterBuildInfo(reg, cli.BuildInfo()); err != nil {
			return err
		}

		sig, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
		defer stop()
		svc, err := capture.New(cfg, capture.WithLogger(log), capture.WithRegistry(reg))
		if err != nil {
			return settingsUsage(err)
		}
		// The service runs on a context of its own: cancelling it is the
		// hard stop. A signal during Start aborts the start; once started,
		// a signal is the soft stop, bounded by stopTimeout, and a second
		// one kills.
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		abort := context.AfterFunc(sig, cancel)
		err = svc.Start(ctx)
		abort()
		if err != nil {
			return keyOnlyUsage(err)
		}
		ended := make(chan error, 1)
		go func() { ended <- svc.Wait() }()
		select {
		case err := <-ended:
			return keyOnlyUsage(err)
		case <-sig.Done():
		}
		stop()
		log.Info("stopping: awaiting in-flight publishes and confirming them to the slot", "timeout", stopTimeout)
		sctx, scancel := context.WithTimeout(context.Background(), stopTimeout)
		defer scancel()
		if err := svc.Stop(sctx); err != nil {
			return err
		}
		return <-ended
	}
	root.AddCommand(newUninstallCommand(stdout))
	root.AddCommand(newCredsCommand(stdout))
	cli.SetVersion(root)
	cli.Prepare(root, stdout, stderr)
	return root
}

// keyOnlyUsage makes the refusal of key-only tables exit 2, the code of a
// setting the operator must choose: it names both flags that settle it.
func keyOnlyUsage(err error) error {
	var ko *capture.KeyOnlyError
	if errors.As(err, &ko) {
		return cli.WithCode(cli.ExitUsage, err)
	}
	return err
}

// settingsUsage makes the refusal of the settings by capture.New (a
// *capture.ConfigError: a missing, out-of-range or contradictory value
// from a flag, a variable or the --config file; nothing connected yet) a
// usage error, exit 2 like a malformed value.
func settingsUsage(err error) error {
	var ce *capture.ConfigError
	if errors.As(err, &ce) {
		return &cli.UsageError{Err: err}
	}
	return err
}

// retentionValue is --retention (capture.ParseRetention): it sets the
// stream's four discarding limits at once.
type retentionValue struct {
	cfg  *capture.Config
	text string
}

func (r *retentionValue) String() string { return r.text }
func (r *retentionValue) Type() string   { return "limits" }
func (r *retentionValue) Set(s string) error {
	l, err := capture.ParseRetention(s)
	if err != nil {
		return err
	}
	r.text = s
	r.cfg.Retention, r.cfg.RetentionMaxBytes, r.cfg.RetentionMaxMsgs, r.cfg.RetentionMaxMsgsPerSubject = l.MaxAge, l.MaxBytes, l.MaxMsgs, l.MaxMsgsPerSubject
	return nil
}

// defaultTailCPUs is --tail-cpus unless set: one CPU while tailing.
// bench-capture's source cost (300,020 deleted rows on two cores shared
// with the source): the DELETEs slowed 1.74x with the capture on both
// cores, 1.19x with it on one (GOMAXPROCS=1, the same run; a quiet
// machine), at the price of lag during the burst, caught up after it.
const defaultTailCPUs = 1

// defaultTailNice is --tail-nice unless set. Linux shares the CPUs between
// sessions' autogroups before threads, so the capture (a session of its
// own, like the postmaster's) took as much CPU as the source's backend and
// walsender together during a burst; nice 19 on its group, in
// bench-capture's source cost (five interleaved runs of each, a quiet
// machine): the DELETEs slowed 1.03-1.29x against 1.44-1.47x without.
const defaultTailNice = 19

// stopTimeout bounds the soft stop on a signal; past it the stop turns
// hard. Below the grace period of deploy/kubernetes/capture.yaml (30s).
const stopTimeout = 25 * time.Second

// embeddedGOGC is the GC target percentage with the embedded broker
// (unless GOGC is set). 200 paid off while the 2m dedupe window kept
// ~136 MB of message ids live; with the 1 s window the live heap
// is ~20-40 MB and bench-capture measured the same CPU per row at 150
// (12.13 against 12.43 µs, medians of 3 runs, load 17-32) with 10-15% less
// peak RSS (91-109 against 108-116 MiB), and 100 another 20-30% less RSS
// for ~6% more CPU. What kept the 1M-row transaction over 150 MiB at a
// quiet machine's rate was not this target but the ids the 1 s window held
// (40-50 MB live at 82,000 rows/s); with the 100ms default the live heap
// is ~20 MB and the process peaked at 87.6 MiB at the same rate.
const embeddedGOGC = 150
