package main

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/epitaph-dev/epitaph/observe"
	"github.com/epitaph-dev/epitaph/projection"
	"github.com/epitaph-dev/epitaph/statuspage"
)

func init() {
	register("run", Command{Summary: "run a projector worker until SIGINT/SIGTERM", Run: runCmd})
}

func runCmd(ctx context.Context, args []string, env *Env) error {
	fs := newFlagSet("run", env)
	c := commonFlags(fs, env)
	worker := fs.String("worker-id", envOr(env, "EPITAPH_WORKER_ID", defaultWorkerID()), "worker id in leases (EPITAPH_WORKER_ID)")
	metrics := fs.String("metrics-addr", envOr(env, "EPITAPH_METRICS_ADDR", "127.0.0.1:9188"), "address of /metrics /healthz /status; empty disables (EPITAPH_METRICS_ADDR)")
	ttls := fs.String("archive-ttl", env.Getenv("EPITAPH_ARCHIVE_TTL"), `archive retention per table, e.g. "public.sessions=720h,*=8760h" (EPITAPH_ARCHIVE_TTL)`)
	roots := fs.String("snapshot-roots", env.Getenv("EPITAPH_SNAPSHOT_ROOTS"), "comma-separated schema.table roots of snapshot documents (EPITAPH_SNAPSHOT_ROOTS)")
	leaseTTL := fs.Duration("lease-ttl", durationEnv(env, "EPITAPH_LEASE_TTL", 15*time.Second), "partition lease TTL (EPITAPH_LEASE_TTL)")
	captureStatus := fs.String("capture-status-url", env.Getenv("EPITAPH_CAPTURE_STATUS_URL"), "the capture's /status URL, for its slot lag on the status page at / (EPITAPH_CAPTURE_STATUS_URL)")
	batch := fs.Int("batch-size", intEnv(env, "EPITAPH_BATCH_SIZE", projection.MaxBatchSize), "events per applied page, at most 500 (EPITAPH_BATCH_SIZE)")
	share := fs.Float64("rebuild-share", floatEnv(env, "EPITAPH_REBUILD_SHARE", 0.5), "while the live version is busy, the most of this worker (a fraction of P concurrent pages) that versions being built may use (EPITAPH_REBUILD_SHARE)")
	hold := fs.Bool("hold-on-quarantine", boolEnv(env, "EPITAPH_HOLD_ON_QUARANTINE", false), "hold mode: later events of a source row whose event is quarantined are quarantined as held (released in order by replay) instead of applied (EPITAPH_HOLD_ON_QUARANTINE)")
	maxRow := fs.Int64("max-row-bytes", int64Env(env, "EPITAPH_MAX_ROW_BYTES", projection.DefaultMaxRowBytes), "largest large-row object fetched; a bigger one is quarantined as oversized (EPITAPH_MAX_ROW_BYTES)")
	readyLag := fs.Int64("ready-max-lag", int64Env(env, "EPITAPH_READY_MAX_LAG", 1000), "archive.status is ready (and a rebuilt version becomes ready) only with at most this many events not yet applied (EPITAPH_READY_MAX_LAG)")
	readyAge := fs.Duration("ready-max-pending-age", durationEnv(env, "EPITAPH_READY_MAX_PENDING_AGE", 30*time.Second), "... and its oldest unapplied event at most this old (EPITAPH_READY_MAX_PENDING_AGE)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *readyLag < 1 || *readyAge <= 0 {
		return errors.New("--ready-max-lag must be at least 1 and --ready-max-pending-age positive")
	}
	if err := env.envErr(); err != nil {
		return err
	}
	if err := c.check(); err != nil {
		return err
	}
	ttlMap, err := projection.ParseTTLs(*ttls)
	if err != nil {
		return err
	}
	var rootList []string
	for _, r := range strings.Split(*roots, ",") {
		if r = strings.TrimSpace(r); r != "" {
			rootList = append(rootList, r)
		}
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	svc, err := projection.New(projection.Config{
		TargetURL: c.targetURL, NATSURL: c.natsURL, SourceName: c.sourceName, WorkerID: *worker,
		LeaseTTL: *leaseTTL, BatchSize: *batch, ArchiveTTL: ttlMap, SnapshotRoots: rootList, RebuildShare: *share,
		HoldOnQuarantine: *hold, MaxRowBytes: *maxRow, ReadyMaxLag: uint64(*readyLag), ReadyMaxPendingAge: *readyAge,
	}, projection.WithLogger(env.Logger), projection.WithRegistry(reg))
	if err != nil {
		return err
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
	srv := observe.New(observe.Config{Addr: *metrics, Registry: reg, Logger: env.Logger,
		Status:  func(ctx context.Context) (any, error) { return svc.Status(ctx) },
		Healthy: svc.Healthy})
	srv.Handle("GET /{$}", statuspage.Handler(svc.Status, statuspage.WithCaptureStatusURL(*captureStatus),
		statuspage.WithSnapshotStats(svc.Pool(), 0), statuspage.WithLogger(env.Logger)))
	srv.Handle("GET /wait", projection.WaitHandler(svc.Pool(), projection.ArchiveProjection))
	stopCtx, stopCancel := context.WithTimeout(context.WithoutCancel(ctx), stopTimeout)
	defer stopCancel()
	if err := srv.Start(runCtx); err != nil {
		_ = svc.Stop(stopCtx) // the error says why
		return err
	}
	env.Logger.Info("projector running", "worker", *worker, "target", redact(c.targetURL), "nats", redact(c.natsURL),
		"source", c.sourceName, "metrics", srv.Addr())
	select {
	case <-ctx.Done():
		env.Logger.Info("stopping: finishing the current batches and handing partitions over", "timeout", stopTimeout)
	case <-svc.Done():
	}
	stopCtx, stopCancel = context.WithTimeout(context.WithoutCancel(ctx), stopTimeout) // from the signal on
	defer stopCancel()
	err = svc.Stop(stopCtx)
	if serr := srv.Stop(stopCtx); err == nil {
		err = serr
	}
	if err != nil {
		return err
	}
	env.Logger.Info("projector stopped")
	return svc.Wait()
}

// stopTimeout bounds the soft stop on a signal; past it the stop turns
// hard (pages in flight roll back). Below the grace period of
// deploy/kubernetes/projector.yaml (60s).
const stopTimeout = 50 * time.Second

func durationEnv(env *Env, key string, def time.Duration) time.Duration {
	if v := env.Getenv(key); v != "" {
		if d, err := time.ParseDuration(v); err == nil {
			return d
		}
		env.badEnv(key, v, "a duration such as 15s or 2m")
	}
	return def
}

func intEnv(env *Env, key string, def int) int {
	if v := env.Getenv(key); v != "" {
		if n, err := strconv.Atoi(v); err == nil {
			return n
		}
		env.badEnv(key, v, "an integer")
	}
	return def
}

func floatEnv(env *Env, key string, def float64) float64 {
	if v := env.Getenv(key); v != "" {
		if f, err := strconv.ParseFloat(v, 64); err == nil {
			return f
		}
		env.badEnv(key, v, "a number")
	}
	return def
}

func int64Env(env *Env, key string, def int64) int64 {
	if v := env.Getenv(key); v != "" {
		if n, err := strconv.ParseInt(v, 10, 64); err == nil {
			return n
		}
		env.badEnv(key, v, "an integer")
	}
	return def
}

func boolEnv(env *Env, key string, def bool) bool {
	if v := env.Getenv(key); v != "" {
		if b, err := strconv.ParseBool(v); err == nil {
			return b
		}
		env.badEnv(key, v, "a boolean (true or false)")
	}
	return def
}
