// Command capture publishes the source database's deletes to JetStream.
// Every flag has an EPITAPH_* environment variable; see --help.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"runtime/debug"
	"runtime/pprof"
	"strings"
	"syscall"
	"time"

	"github.com/epitaph-dev/epitaph/capture"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return
		}
		fmt.Fprintln(os.Stderr, "capture: "+capture.RedactURL(strings.ReplaceAll(err.Error(), "\n", " ")))
		os.Exit(1)
	}
}

func run(args []string) error {
	var cfg capture.Config
	var tables, level, cpuProfile string
	fs := flag.NewFlagSet("capture", flag.ContinueOnError)
	str(fs, &cfg.SourceURL, "source-url", "EPITAPH_SOURCE_URL", "", "source database URL (postgres://user:pass@host:port/db)")
	str(fs, &cfg.NATSURL, "nats-url", "EPITAPH_NATS_URL", "", "JetStream server URL; empty runs an embedded server")
	str(fs, &cfg.EmbeddedListen, "nats-listen", "EPITAPH_NATS_LISTEN", "127.0.0.1:4222", "listen address of the embedded JetStream server")
	str(fs, &cfg.DataDir, "data-dir", "EPITAPH_DATA_DIR", "./epitaph-data", "directory of the embedded JetStream server's files")
	str(fs, &cfg.SourceName, "source-name", "EPITAPH_SOURCE_NAME", "main", "source name (stream EPITAPH_<NAME>)")
	str(fs, &tables, "tables", "EPITAPH_TABLES", "", "comma-separated schema.table list; empty: every table whose deletes can be published safely")
	num(fs, &cfg.Partitions, "partitions", "EPITAPH_PARTITIONS", 8, "stream partitions (fixed when the stream is made)")
	str(fs, &cfg.SlotName, "slot", "EPITAPH_SLOT", "epitaph", "replication slot")
	str(fs, &cfg.PublicationName, "publication", "EPITAPH_PUBLICATION", "epitaph", "publication")
	str(fs, &cfg.MetricsAddr, "metrics-addr", "EPITAPH_METRICS_ADDR", "127.0.0.1:9187", "address of /metrics, /healthz, /status; empty disables")
	boolean(fs, &cfg.SetReplicaIdentityFull, "set-replica-identity-full", "EPITAPH_SET_REPLICA_IDENTITY_FULL", "ALTER captured tables to REPLICA IDENTITY FULL")
	boolean(fs, &cfg.RecreateSlot, "recreate-slot", "EPITAPH_RECREATE_SLOT", "recreate a missing or invalidated slot and record a gap event")
	retention(fs, &cfg, "retention", "EPITAPH_RETENTION", "the stream limits that may discard events (default none: every event kept, rebuilds need them): a max age such as 720h, or max-age=D,max-bytes=N[K|M|G|T],max-msgs=N,max-msgs-per-subject=N. Any other discarding limit on the stream makes the capture refuse to start; one changed while it streams is restored")
	dur(fs, &cfg.StreamCheckInterval, "stream-check-interval", "EPITAPH_STREAM_CHECK_INTERVAL", 10*time.Second, "how often the stream's limits are checked (and restored) while streaming; negative: only at start")
	dur(fs, &cfg.HeartbeatInterval, "heartbeat-interval", "EPITAPH_HEARTBEAT_INTERVAL", 10*time.Second, "heartbeat interval")
	dur(fs, &cfg.DuplicateWindow, "duplicate-window", "EPITAPH_DUPLICATE_WINDOW", 2*time.Minute, "JetStream dedupe window")
	dur(fs, &cfg.BrokerSyncInterval, "broker-sync-interval", "EPITAPH_BROKER_SYNC_INTERVAL", 0, "how long confirmations trail acks for a 1-replica stream (0: embedded 10s, external 2m; negative: none)")
	str(fs, &cfg.StreamPersist, "stream-persist", "EPITAPH_STREAM_PERSIST", "auto", "persist mode of a new stream: async (acknowledge before the write; safe with the trailing confirmation), default (write, then acknowledge) or auto (async with the embedded broker)")
	num(fs, &cfg.MaxInFlight, "max-in-flight", "EPITAPH_MAX_IN_FLIGHT", 4096, "messages in flight (published, not yet acknowledged) at most")
	num(fs, &cfg.Replicas, "replicas", "EPITAPH_REPLICAS", 1, "stream replicas when the stream is created")
	boolean(fs, &cfg.Standby, "standby", "EPITAPH_STANDBY", "wait for the lease (an advisory lock on the source) instead of failing while another capture streams the slot; needs EPITAPH_NATS_URL")
	dur(fs, &cfg.StandbyPoll, "standby-poll", "EPITAPH_STANDBY_POLL", time.Second, "how often a standby tries the lease and the holder checks it")
	// Trust: the key the capture signs with.
	str(fs, &cfg.SigningKey, "signing-key", "EPITAPH_SIGNING_KEY", "", "Ed25519 signing key file (PEM PKCS#8 or raw 32-byte seed, mode 0600); empty: <data-dir>/signing.key, generated on first start")

	// Following the source's schema while streaming (issue 12).
	dur(fs, &cfg.CatalogPoll, "catalog-poll", "EPITAPH_CATALOG_POLL", 5*time.Second, "how often the catalog is checked for new, changed and dropped tables while streaming (negative: never)")
	boolean(fs, &cfg.InstallDDLGuard, "install-ddl-guard", "EPITAPH_INSTALL_DDL_GUARD", "install an event trigger that applies the publication rules at DDL time, so no DELETE fails between two catalog polls (needs a superuser)")
	str(fs, &cpuProfile, "cpu-profile", "EPITAPH_CPU_PROFILE", "", "write a pprof CPU profile of the whole run to this file (diagnostics; empty: off)")
	str(fs, &level, "log-level", "EPITAPH_LOG_LEVEL", "info", "debug, info, warn or error")
	if err := applyEnv(fs); err != nil {
		return err
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	for _, t := range strings.Split(tables, ",") {
		if t = strings.TrimSpace(t); t != "" {
			cfg.Tables = append(cfg.Tables, t)
		}
	}
	var lv slog.Level
	if err := lv.UnmarshalText([]byte(level)); err != nil {
		return fmt.Errorf("--log-level: %w", err)
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: lv}))
	if _, set := os.LookupEnv("GOGC"); !set && cfg.NATSURL == "" {
		// The embedded JetStream server allocates per message in this
		// process: a larger GC target costs heap (bounded by the in-flight
		// window) but saves CPU on a busy drain. GOGC in the environment wins.
		debug.SetGCPercent(embeddedGOGC)
	}
	if cpuProfile != "" {
		f, err := os.Create(cpuProfile)
		if err != nil {
			return fmt.Errorf("--cpu-profile: %w", err)
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			f.Close()
			return fmt.Errorf("--cpu-profile: %w", err)
		}
		defer func() {
			pprof.StopCPUProfile()
			f.Close()
		}()
	}

	sig, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	svc, err := capture.New(cfg, capture.WithLogger(log))
	if err != nil {
		return err
	}
	// The service runs on a context of its own: cancelling it is the hard
	// stop. A signal during Start aborts the start; once started, a signal
	// is the soft stop, bounded by stopTimeout, and a second one kills.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	abort := context.AfterFunc(sig, cancel)
	err = svc.Start(ctx)
	abort()
	if err != nil {
		return err
	}
	ended := make(chan error, 1)
	go func() { ended <- svc.Wait() }()
	select {
	case err := <-ended:
		return err
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

// stopTimeout bounds the soft stop on a signal; past it the stop turns
// hard. Below the grace period of deploy/kubernetes/capture.yaml (30s).
const stopTimeout = 25 * time.Second

// embeddedGOGC is the GC target percentage with the embedded broker
// (unless GOGC is set).
const embeddedGOGC = 200

// envOf maps each flag to its environment variable. Values from the
// environment go through the flag's own parser (applyEnv), so a malformed
// one is an error, never silently the default.
var envOf = map[string]envVar{}

type envVar struct {
	name string
	text bool // an empty value is meaningful (EPITAPH_NATS_URL= : embedded)
}

func str(fs *flag.FlagSet, p *string, name, env, def, usage string) {
	envOf[name] = envVar{env, true}
	fs.StringVar(p, name, def, usage+" ("+env+")")
}

func num(fs *flag.FlagSet, p *int, name, env string, def int, usage string) {
	envOf[name] = envVar{name: env}
	fs.IntVar(p, name, def, usage+" ("+env+")")
}

func dur(fs *flag.FlagSet, p *time.Duration, name, env string, def time.Duration, usage string) {
	envOf[name] = envVar{name: env}
	fs.DurationVar(p, name, def, usage+" ("+env+")")
}

// retention registers --retention (capture.ParseRetention).
func retention(fs *flag.FlagSet, cfg *capture.Config, name, env, usage string) {
	envOf[name] = envVar{name: env}
	fs.Func(name, usage+" ("+env+")", func(s string) error {
		l, err := capture.ParseRetention(s)
		if err != nil {
			return err
		}
		cfg.Retention, cfg.RetentionMaxBytes, cfg.RetentionMaxMsgs, cfg.RetentionMaxMsgsPerSubject = l.MaxAge, l.MaxBytes, l.MaxMsgs, l.MaxMsgsPerSubject
		return nil
	})
}

func boolean(fs *flag.FlagSet, p *bool, name, env, usage string) {
	envOf[name] = envVar{name: env}
	fs.BoolVar(p, name, false, usage+" ("+env+")")
}

// applyEnv sets every flag whose variable is in the environment (an empty
// value counts only for text flags); flags on the command line, parsed
// afterwards, override them.
func applyEnv(fs *flag.FlagSet) error {
	var bad []string
	fs.VisitAll(func(f *flag.Flag) {
		ev, ok := envOf[f.Name]
		if !ok {
			return
		}
		v, ok := os.LookupEnv(ev.name)
		if !ok || (v == "" && !ev.text) {
			return
		}
		if err := fs.Set(f.Name, v); err != nil {
			bad = append(bad, fmt.Sprintf("%s=%q: %v", ev.name, v, err))
		}
	})
	if len(bad) > 0 {
		return errors.New("bad environment: " + strings.Join(bad, "; "))
	}
	return nil
}
