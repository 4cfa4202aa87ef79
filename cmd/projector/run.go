package main

import (
	"context"
	"fmt"
	"net"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/spf13/cobra"

	"github.com/epitaph-dev/epitaph/cmd/internal/cli"
	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/internal/console"
	"github.com/epitaph-dev/epitaph/internal/httptoken"
	"github.com/epitaph-dev/epitaph/internal/observe"
	"github.com/epitaph-dev/epitaph/internal/readapi"
	"github.com/epitaph-dev/epitaph/internal/statuspage"
	"github.com/epitaph-dev/epitaph/projection"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/retention"
	"github.com/epitaph-dev/epitaph/projection/status"
)

func init() { register(runCommand) }

type runOptions struct {
	worker, metrics, ttls, roots, captureStatus string
	group                                       *string
	tokenFile                                   string
	leaseTTL, sourceTCPTimeout                  time.Duration
	batch                                       int
	share                                       float64
	hold                                        bool
	maxRow, verifyWindow                        int64
	readyLag                                    int64
	readyAge                                    time.Duration
	cleanupInterval, cleanupTimeout             time.Duration
	cleanupBatch, cleanupRate                   int
	archivePartition                            string
	handlerParallelism                          int
	settleTimeout, payloadRetention             time.Duration
	sourceURL                                   string
	cpuProfile                                  string
}

func runCommand(env *Env) *cobra.Command {
	var o runOptions
	cmd := &cobra.Command{
		Use:   "run",
		Short: "run a projector worker until SIGINT/SIGTERM",
		Long: `run is a projector worker: it leases partitions of every projection version,
applies their events to the target and serves /metrics, /livez, /readyz,
/healthz, /status and the status page at / on --metrics-addr. Run as many as
you like: partitions are spread by leases held in the target.

The same address serves the read API for support tools: GET /v1/rows,
/v1/transactions/{correlation_id} and /v1/snapshots (see the README). With
--http-token-file every read API request needs "Authorization: Bearer
<token>"; the token is required when --metrics-addr is not a loopback
address (run refuses to start without it).`,
		Example: `  EPITAPH_TARGET_URL=postgres://epitaph@archive:5432/archive projector run
  projector run --snapshot-roots public.orders --archive-ttl 'public.sessions=720h,*=8760h'`,
		Args: cli.NoArgs,
	}
	c := commonFlags(cmd, env)
	f := cli.Local(cmd)
	f.String(&o.worker, "worker-id", "EPITAPH_WORKER_ID", "", "worker id in leases (default: <hostname>-<pid>); a worker restarted with the same id takes its leases back at once, so never run two at once with one id")
	f.String(&o.metrics, "metrics-addr", "EPITAPH_METRICS_ADDR", "127.0.0.1:9188", "address of /metrics /livez /readyz /healthz /status; empty disables", cli.KeepEmpty())
	f.String(&o.ttls, "archive-ttl", "EPITAPH_ARCHIVE_TTL", "", `archive retention per table, e.g. "public.sessions=720h,*=8760h"`)
	f.String(&o.archivePartition, "archive-partition", "EPITAPH_ARCHIVE_PARTITION", archive.DefaultPeriod, "partition the archive's rows by commit_time: day, week or month (for archive v1 when this worker creates it; a rebuild takes its own)")
	f.String(&o.roots, "snapshot-roots", "EPITAPH_SNAPSHOT_ROOTS", "", "comma-separated schema.table roots of snapshot documents")
	f.Duration(&o.leaseTTL, "lease-ttl", "EPITAPH_LEASE_TTL", projection.DefaultLeaseTTL, "partition lease TTL", cli.Positive())
	f.String(&o.captureStatus, "capture-status-url", "EPITAPH_CAPTURE_STATUS_URL", "", "the capture's /status URL, for its slot lag on the status page at /")
	f.String(&o.tokenFile, "http-token-file", "EPITAPH_HTTP_TOKEN_FILE", "", "file holding the bearer token (not world-readable) that the HTTP actions and the read API require: the status page's quarantine replay/discard (without it they answer 401) and /v1/... (without it open, allowed on a loopback --metrics-addr only)")
	f.Int(&o.batch, "batch-size", "EPITAPH_BATCH_SIZE", projection.MaxBatchSize, "events per applied page", cli.Min(1), cli.Max(projection.MaxBatchSize))
	f.Float64(&o.share, "rebuild-share", "EPITAPH_REBUILD_SHARE", projection.DefaultRebuildShare, "while the live version is busy, the most of this worker (a fraction of P concurrent pages) that versions being built may use", cli.Positive(), cli.Max(1))
	f.Bool(&o.hold, "hold-on-quarantine", "EPITAPH_HOLD_ON_QUARANTINE", false, "hold mode: later events of a source row whose event is quarantined are quarantined as held (released in order by replay) instead of applied")
	f.Int64(&o.maxRow, "max-row-bytes", "EPITAPH_MAX_ROW_BYTES", projection.DefaultMaxRowBytes, "largest large-row object fetched; a bigger one is quarantined as oversized", cli.Positive())
	f.Int64(&o.verifyWindow, "verify-window-bytes", "EPITAPH_VERIFY_WINDOW_BYTES", projection.DefaultVerifyWindowBytes, "most memory verification may take to read back a transaction whose rows failed the fast check (each message counted as its body + 1.5 KiB); one that needs more holds its partition (transient kind verify_window) until this is raised", cli.Min(1<<20))
	f.Int64(&o.readyLag, "ready-max-lag", "EPITAPH_READY_MAX_LAG", projection.DefaultReadyMaxLag, "archive.status is ready (and a rebuilt version becomes ready) only with at most this many events not yet applied", cli.Min(1))
	f.Duration(&o.readyAge, "ready-max-pending-age", "EPITAPH_READY_MAX_PENDING_AGE", projection.DefaultReadyMaxPendingAge, "... and its oldest unapplied event at most this old", cli.Positive())
	o.group = groupFlag(cmd)
	f.Duration(&o.cleanupInterval, "cleanup-interval", "EPITAPH_CLEANUP_INTERVAL", 10*time.Second, "retention: how often expired rows are looked for (a full batch is followed at once); 0 disables this worker's cleanup", cli.NotNegative())
	f.Int(&o.cleanupBatch, "cleanup-batch", "EPITAPH_CLEANUP_BATCH", retention.DefaultCleanupBatch, "retention: the first batch size (it adapts to how long batches take)", cli.Min(retention.MinCleanupBatch), cli.Max(retention.MaxCleanupBatch))
	f.Duration(&o.cleanupTimeout, "cleanup-timeout", "EPITAPH_CLEANUP_TIMEOUT", 10*time.Second, "retention: statement timeout of a cleanup batch", cli.Positive())
	f.Int(&o.cleanupRate, "cleanup-rate", "EPITAPH_CLEANUP_RATE", retention.DefaultCleanupRate, "retention: the most expired rows deleted per second while this worker applies (unpaced while idle, and while an hour behind for an hour); 0: unpaced", cli.NotNegative())
	f.Int(&o.handlerParallelism, "handler-parallelism", "EPITAPH_HANDLER_PARALLELISM", handler.DefaultParallelism, "row handler deliveries run at once by this worker", cli.Min(1))
	f.Duration(&o.settleTimeout, "group-settle-timeout", "EPITAPH_GROUP_SETTLE_TIMEOUT", handler.DefaultGroupSettleTimeout, "after-group deliveries of a transaction whose commit never arrives are released after this, marked released_unsettled (rows of unsigned streams only)", cli.Positive())
	f.Duration(&o.payloadRetention, "delivery-payload-retention", "EPITAPH_DELIVERY_PAYLOAD_RETENTION", handler.DefaultPayloadRetention, "delivery payloads older than this are scrubbed; queued work whose payload was scrubbed is dead-lettered", cli.Positive())
	sourceURLFlag(f, &o.sourceURL)
	sourceTCPTimeoutFlag(f, &o.sourceTCPTimeout)
	f.String(&o.cpuProfile, "cpu-profile", "EPITAPH_CPU_PROFILE", "", "write a pprof CPU profile of the whole run to this file (diagnostics; empty: off)", cli.KeepEmpty())
	cmd.RunE = func(cmd *cobra.Command, _ []string) error { return runWorker(cmd.Context(), c, o, env) }
	return cmd
}

// check refuses a bad --group or --source-tcp-timeout before anything
// starts, and returns the source's dial timeout as pgdial.Set takes it.
func (o runOptions) check() (srcTimeout time.Duration, err error) {
	if err := checkGroup(*o.group); err != nil {
		return 0, err
	}
	return dialTimeout("source-tcp-timeout", o.sourceTCPTimeout)
}

func runWorker(ctx context.Context, c *common, o runOptions, env *Env) error {
	if err := c.check(); err != nil {
		return err
	}
	srcTimeout, err := o.check()
	if err != nil {
		return err
	}
	if o.worker == "" {
		o.worker = defaultWorkerID()
	}
	ttlMap, err := projection.ParseTTLs(o.ttls)
	if err != nil {
		return cli.Usage("--archive-ttl: %w", err)
	}
	var token *httptoken.Token
	if o.tokenFile != "" {
		if token, err = httptoken.Load(o.tokenFile); err != nil {
			return cli.Usage("%w", err)
		}
	} else if o.metrics != "" && !loopback(o.metrics) {
		// The read API serves deleted rows to whoever reaches the address.
		return cli.Usage("--metrics-addr %s is not a loopback address: the read API needs --http-token-file (EPITAPH_HTTP_TOKEN_FILE)", o.metrics)
	}
	if o.cpuProfile != "" {
		stop, err := cli.StartCPUProfile(o.cpuProfile)
		if err != nil {
			return err
		}
		defer stop()
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	if err := cli.RegisterBuildInfo(reg, cli.BuildInfo()); err != nil {
		return err
	}
	svc, err := projection.New(projection.Config{
		TargetURL: c.targetURL, NATSURL: c.natsURL, NATSAuth: c.natsAuth, SourceName: c.sourceName, WorkerID: o.worker, Group: *o.group,
		LeaseTTL: o.leaseTTL, BatchSize: o.batch, ArchiveTTL: ttlMap, SnapshotRoots: splitList(o.roots), RebuildShare: o.share,
		HoldOnQuarantine: o.hold, MaxRowBytes: o.maxRow, VerifyWindowBytes: o.verifyWindow, ReadyMaxLag: uint64(o.readyLag), ReadyMaxPendingAge: o.readyAge,
		CleanupInterval: cleanupInterval(o.cleanupInterval), CleanupBatch: o.cleanupBatch, CleanupTimeout: o.cleanupTimeout,
		CleanupRate: cleanupRate(o.cleanupRate), ArchivePartition: o.archivePartition, TargetTCPTimeout: c.tcpTimeout(),
	}, projection.WithLogger(env.Logger), projection.WithRegistry(reg))
	if err != nil {
		// New connects nothing: what it refuses is a setting (a flag, a
		// variable or the --config file), exit 2 like a malformed value.
		return &cli.UsageError{Err: err}
	}
	// ctx is done on SIGINT/SIGTERM. The service and the endpoints run on a
	// context of their own, whose cancellation is the hard stop: a signal
	// during Start aborts the start; once started, a signal is the soft
	// stop (pages in flight commit), bounded by stopTimeout.
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	defer cancel()
	abort := context.AfterFunc(ctx, cancel)
	err = svc.Start(runCtx)
	abort()
	if err != nil {
		return err
	}
	ev, reval, err := newRevalidator(svc.Pool(), o.sourceURL, srcTimeout, env, reg)
	if err != nil {
		_ = svc.Stop(context.WithoutCancel(ctx))
		return err
	}
	defer ev.Close()
	disp, err := handler.NewDispatcher(svc.Pool(), handler.Config{Parallelism: o.handlerParallelism,
		GroupSettleTimeout: o.settleTimeout, PayloadRetention: o.payloadRetention, JetStream: svc.JetStream(),
		Revalidate: reval, RevalidateBatch: ev.BatchRevalidator(), Logger: env.Logger, Registerer: reg,
		Source: c.sourceName})
	if err == nil {
		svc.OnArchiveCommit(disp.Archived) // batches leave as their rows are archived
		err = disp.Start(runCtx)
	}
	if err != nil {
		_ = svc.Stop(context.WithoutCancel(ctx))
		return err
	}
	srv := observe.New(observe.Config{Addr: o.metrics, Registry: reg, Logger: env.Logger,
		Status:  func(ctx context.Context) (any, error) { return svc.Status(ctx) },
		Healthy: svc.Healthy, Live: svc.Live, Ready: svc.Healthy})
	actions := statuspage.QuarantineActions(svc.Pool(), projection.ReplayFunc(projection.ReplayConfig{ArchiveTTL: ttlMap,
		SnapshotRoots: splitList(o.roots), MaxRowBytes: o.maxRow, JetStream: svc.JetStream()}), statuspage.HoldMode(o.hold))
	srv.Handle("GET /{$}", statuspage.Handler(svc.Status, statuspage.WithCaptureStatusURL(o.captureStatus),
		statuspage.WithSnapshotStats(svc.Pool(), 0), statuspage.WithQuarantineEntries(svc.Pool(), 0),
		statuspage.WithHandlerStats(svc.Pool(), 0), statuspage.WithActions(actions, token), statuspage.WithLogger(env.Logger)))
	srv.Handle(statuspage.ActionPattern, statuspage.ActionHandler(actions, token, env.Logger))
	// Waits (GET /wait, the read API's wait_lsn) poll on a small pool of
	// their own, a bounded number at once: however many arrive, the apply
	// keeps its connections.
	waitPool, err := status.NewWaitPool(ctx, c.targetURL, c.tcpTimeout())
	if err != nil {
		_ = disp.Stop(context.WithoutCancel(ctx))
		_ = svc.Stop(context.WithoutCancel(ctx))
		return fmt.Errorf("connect to target %s: %w", redact(c.targetURL), err)
	}
	defer waitPool.Close()
	waitLimit := status.NewWaitLimiter(maxWaits)
	srv.Handle("GET /wait", status.WaitHandler(waitPool, archive.Projection, status.WithWaitLimit(waitLimit)))
	readapi.Register(srv, readapi.Config{DB: svc.Pool(), Token: token, Source: c.sourceName, WaitDB: waitPool, WaitLimit: waitLimit})
	console.Register(srv, console.Config{DB: svc.Pool(), Token: token, Source: c.sourceName, SourceURL: o.sourceURL, SourceTCPTimeout: srcTimeout,
		Quarantine: actions, Logger: env.Logger})
	stopCtx, stopCancel := context.WithTimeout(context.WithoutCancel(ctx), stopTimeout)
	defer stopCancel()
	if err := srv.Start(runCtx); err != nil {
		_ = disp.Stop(stopCtx)
		_ = svc.Stop(stopCtx) // the error says why
		return err
	}
	env.Logger.Info("projector running", "worker", o.worker, "group", svc.Group(), "target", redact(c.targetURL), "nats", redact(c.natsURL),
		"source", c.sourceName, "metrics", srv.Addr())
	select {
	case <-ctx.Done():
		env.Logger.Info("stopping: finishing the current batches and handing partitions over", "timeout", stopTimeout)
	case <-svc.Done():
	}
	stopCtx, stopCancel = context.WithTimeout(context.WithoutCancel(ctx), stopTimeout) // from the signal on
	defer stopCancel()
	// The dispatcher first (its settles use the service's pool), within a
	// share of the bound: an attempt that outlasts it (a slow receiver may
	// take up to 9/10 of its handler's claim timeout) is cancelled, its
	// delivery attempted again later (at the latest once its claim
	// expires), so that the partitions still have their soft stop (pages
	// committed, leases handed over).
	dispCtx, dispCancel := context.WithTimeout(stopCtx, dispatcherStopTimeout)
	if disp.Stop(dispCtx) != nil { // the dispatcher's hard stop: nothing more to report
		env.Logger.Warn("delivery attempts still in flight at the stop were cancelled; their deliveries will be attempted again",
			"timeout", dispatcherStopTimeout)
	}
	dispCancel()
	err = svc.Stop(stopCtx)
	if serr := srv.Stop(stopCtx); err == nil {
		err = serr
	}
	if err != nil {
		return err
	}
	if err := svc.Err(); err != nil {
		return err // it stopped on its own (NATS closed for good)
	}
	env.Logger.Info("projector stopped")
	return svc.Wait()
}

// cleanupRate maps --cleanup-rate 0 (unpaced) to the config's negative.
func cleanupRate(n int) int {
	if n == 0 {
		return -1
	}
	return n
}

// cleanupInterval maps --cleanup-interval 0 (disabled) to the config's
// negative interval.
func cleanupInterval(d time.Duration) time.Duration {
	if d == 0 {
		return -1
	}
	return d
}

// stopTimeout bounds the soft stop on a signal; past it the stop turns
// hard (pages in flight roll back). Below the grace period of
// deploy/kubernetes/projector.yaml (60s).
const stopTimeout = 50 * time.Second

// dispatcherStopTimeout is the share of stopTimeout the delivery attempts
// in flight may take; the partitions have the rest.
const dispatcherStopTimeout = 20 * time.Second

// splitList splits a comma-separated list, dropping empty items.
func splitList(s string) []string {
	var out []string
	for _, r := range strings.Split(s, ",") {
		if r = strings.TrimSpace(r); r != "" {
			out = append(out, r)
		}
	}
	return out
}

// loopback reports whether addr (host:port) listens on loopback only.
func loopback(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// maxWaits bounds the waits (GET /wait, wait_lsn) a projector runs at
// once; more are answered 503 with Retry-After.
const maxWaits = 64
