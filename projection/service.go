package projection

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/internal/natsconn"
	"github.com/epitaph-dev/epitaph/internal/pgdial"
	"github.com/epitaph-dev/epitaph/internal/startstop"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/progress"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/erasure"
	"github.com/epitaph-dev/epitaph/projection/retention"
	"github.com/epitaph-dev/epitaph/projection/snapshot"
	"github.com/epitaph-dev/epitaph/projection/status"
	"github.com/epitaph-dev/epitaph/projection/version"
	"github.com/epitaph-dev/epitaph/quarantine"
)

// Service is one projector worker process: it keeps a heartbeat, takes its
// fair share of partition leases of every active version, and runs a
// partition worker per lease. It is a service (internal/startstop).
type Service struct {
	cfg     Config
	log     *slog.Logger
	reg     *prometheus.Registry
	now     func() time.Time
	metrics *metrics
	// lifecycle: rebuild progress gauges (states_metrics.go)
	lifecycle *lifecycleMetrics

	pool   *pgxpool.Pool
	group  string // the consumer group (Config.Group or the target's default)
	nc     *nats.Conn
	js     jetstream.JetStream
	leaser *progress.Leaser

	// extraDDL adds per-version tables (snapshots) to a version's schema.
	extraDDL func(schema string) string

	batcher *snapshot.Batcher

	objects *objectReader
	keys    *keyring // trusted signing keys (verify.go)
	// handlers: the row handlers per table, for queueing deliveries
	// (handlers.go).
	handlers *handler.Cache

	// partitionsKnown: the archive partitions this worker made sure of
	// (partitions.go).
	partitionsKnown partitionCache

	// archived: called after each page the archive commits
	// (OnArchiveCommit).
	archived atomic.Pointer[func()]

	fences    *erasure.FenceSet  // erasure fences (fencecheck.go)
	retention *retention.Metrics // cleanup and fence metrics
	cleaner   *retention.Cleaner // cleaner.go; nil when disabled

	// firstBackoff is a partition's first wait after a transient failure.
	firstBackoff time.Duration

	mu      sync.Mutex
	closing bool
	// reconnected is closed when the NATS connection comes back, and
	// replaced: partitions waiting out a backoff retry then, rather than at
	// its end (a broker restart would otherwise cost up to MaxBackoff and
	// its jitter of lag after the broker is back).
	reconnected chan struct{}
	workers     map[progress.Key]*partitionWorker
	partitions  int
	versions    string                      // fingerprint of the active versions last ensured
	live        map[string]int              // live version per projection, as of the last balance
	throttled   map[version.VersionKey]bool // versions building or catching up (RebuildShare applies)
	// rebuildGate bounds the pages of non-live versions applied at once
	// (Config.RebuildShare); nil until the partition count is known.
	rebuildGate  chan struct{}
	lastLivePage time.Time // when a page of a live version was last admitted
	lastStatus   *status.Status

	ss     startstop.Base
	runCtx context.Context       // the hard-stop context partition workers run on
	failed atomic.Pointer[error] // why it stopped on its own (Err)
}

// workerRetention is how long a worker that stopped heartbeating stays in
// epitaph.workers (and in the status) before it is forgotten.
const workerRetention = time.Hour

// New validates cfg and builds a Service; nothing is connected until Start.
func New(cfg Config, opts ...Option) (*Service, error) {
	cfg.setDefaults()
	if _, err := archive.ParsePeriod(cfg.ArchivePartition); err != nil {
		return nil, err
	}
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("projector config: %w", err)
	}
	o := options{logger: slog.Default(), registry: prometheus.NewRegistry(), now: time.Now,
		firstBackoff: 100 * time.Millisecond}
	for _, opt := range opts {
		opt(&o)
	}
	s := &Service{
		cfg: cfg, log: o.logger, reg: o.registry, now: o.now,
		workers: map[progress.Key]*partitionWorker{}, firstBackoff: o.firstBackoff, reconnected: make(chan struct{}),
	}
	s.metrics = newMetrics(o.registry)
	s.lifecycle = newLifecycleMetrics(o.registry)
	s.fences, s.retention = &erasure.FenceSet{}, retention.NewMetrics(o.registry)
	s.extraDDL = snapshotHooks()
	return s, nil
}

// Registry is the registry the service's metrics are on.
func (s *Service) Registry() *prometheus.Registry { return s.reg }

// Group is the consumer group the service reads the stream with (valid
// after Start).
func (s *Service) Group() string { return s.group }

// Pool is the target connection pool (valid after Start).
func (s *Service) Pool() *pgxpool.Pool { return s.pool }

// JetStream is the service's JetStream context (valid after Start), for
// what reads the stream beside it (a replay's large rows).
func (s *Service) JetStream() jetstream.JetStream { return s.js }

// OnArchiveCommit has f called after each page an archive version
// commits (rows archived, or a watermark moved): the webhook dispatcher's
// cue to look for rows to send (handler.Dispatcher.Archived) rather than
// wait for its poll. f runs on the partition's worker: it must return at
// once.
func (s *Service) OnArchiveCommit(f func()) { s.archived.Store(&f) }

// Start connects to the target (and applies the control-schema
// migrations) and to NATS, then runs in the background until Stop or ctx
// is done. It returns configuration and connection errors at once; a
// stream that does not exist yet is waited for in the background.
// Cancelling ctx is the hard stop: pages in flight roll back, leases are
// left to expire, the connections are closed.
func (s *Service) Start(ctx context.Context) (err error) {
	soft, hard, ok := s.ss.StartInit(ctx)
	if !ok {
		return errors.New("projector already started")
	}
	defer func() {
		if err != nil {
			s.ss.Finish(err)
		}
	}()
	pcfg, err := pgxpool.ParseConfig(s.cfg.TargetURL)
	if err != nil {
		return fmt.Errorf("parse target URL: %w", err)
	}
	// Pages are short statements; JIT compilation would cost more than it
	// saves (it was measured at ~250ms on a 700-row commit).
	if _, set := pcfg.ConnConfig.RuntimeParams["jit"]; !set {
		pcfg.ConnConfig.RuntimeParams["jit"] = "off"
	}
	pgdial.Set(&pcfg.ConnConfig.Config, s.cfg.TargetTCPTimeout)
	if s.cfg.MaxConns > 0 {
		pcfg.MaxConns = s.cfg.MaxConns
	} else {
		pcfg.MaxConns = max(pcfg.MaxConns, 20)
	}
	s.pool, err = pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return fmt.Errorf("connect to target: %w", err)
	}
	if err := migrations.Apply(ctx, s.pool); err != nil {
		s.pool.Close()
		return fmt.Errorf("target %s: %w", redactURL(s.cfg.TargetURL), err)
	}
	if s.group, err = resolveGroup(ctx, s.pool, s.cfg.Group); err != nil {
		s.pool.Close()
		return err
	}
	s.leaser, err = progress.NewLeaser(s.pool, s.cfg.WorkerID, s.cfg.LeaseTTL)
	if err != nil {
		s.pool.Close()
		return err
	}
	auth, err := s.cfg.NATSAuth.Options(s.cfg.NATSURL, natsconn.WithLogger(s.log))
	if err != nil {
		s.pool.Close()
		return err
	}
	s.nc, err = nats.Connect(s.cfg.NATSURL, append([]nats.Option{
		nats.Name("epitaph-projector " + s.cfg.WorkerID),
		nats.MaxReconnects(-1), nats.ReconnectWait(250 * time.Millisecond),
		nats.RetryOnFailedConnect(true), nats.ReconnectBufSize(-1),
		nats.ClosedHandler(s.natsClosed), nats.ErrorHandler(s.natsError),
		nats.ReconnectHandler(s.natsReconnected)}, auth...)...)
	if err != nil {
		s.pool.Close()
		return fmt.Errorf("connect to NATS %s: %w", redactURL(s.cfg.NATSURL), err)
	}
	s.js, err = jetstream.New(s.nc)
	if err != nil {
		s.nc.Close()
		s.pool.Close()
		return fmt.Errorf("jetstream: %w", err)
	}
	s.objects = newObjectReader(s.js)
	s.keys = newKeyring(s.pool, s.log)
	s.handlers = handler.NewCache(s.pool, time.Second)
	if err := s.reg.Register(quarantine.NewCollector(s.pool, s.log)); err != nil {
		s.log.Warn("quarantine metrics not registered", "err", err)
	}
	s.runCtx = hard
	if err := s.startSnapshots(hard); err != nil {
		s.nc.Close()
		s.pool.Close()
		return fmt.Errorf("snapshot batcher: %w", err)
	}
	if err := s.startCleaner(hard); err != nil {
		s.batcher.Stop(context.WithoutCancel(hard)) //nolint:errcheck // already failing
		s.nc.Close()
		s.pool.Close()
		return err
	}
	go s.run(soft, hard)
	return nil
}

// Stop is the soft stop: every partition finishes its page (applies,
// commits the cursor, acks), leases are released at once for other workers
// to take, the worker deregisters and the connections are closed. When ctx
// ends first, it turns into the hard stop (see Start) and returns an error
// wrapping ctx's. Safe to call more than once, and before Start.
func (s *Service) Stop(ctx context.Context) error { return s.ss.Stop(ctx) }

// Wait blocks until the service has stopped.
func (s *Service) Wait() error { return s.ss.Wait() }

// Done is closed when the service has stopped (after Start).
func (s *Service) Done() <-chan struct{} { return s.ss.Done() }

// stopPartitions stops every partition worker and returns their leases:
// with a soft stop (ctx alive) each finishes its page; with a hard stop
// (ctx done) the pages in flight roll back.
func (s *Service) stopPartitions() []progress.Lease {
	s.mu.Lock()
	s.closing = true // the coordinator starts no more partitions
	ws := make([]*partitionWorker, 0, len(s.workers))
	for _, w := range s.workers {
		ws = append(ws, w)
	}
	s.mu.Unlock()
	for _, w := range ws {
		w.RequestStop()
	}
	var leases []progress.Lease
	for _, w := range ws {
		<-w.Done()
		leases = append(leases, w.lease)
	}
	return leases
}

// shutdown ends the service after its partitions: the snapshot batcher
// finishes its batch, and with a soft stop (ctx alive) the leases are given
// back and the worker deregisters (with a hard stop they are left to
// expire); the connections are closed.
func (s *Service) shutdown(ctx context.Context, leases []progress.Lease) {
	if err := s.batcher.Stop(ctx); err != nil {
		s.log.Debug("snapshot batcher stopped hard", "err", err)
	}
	if s.cleaner != nil {
		if err := s.cleaner.Stop(ctx); err != nil {
			s.log.Debug("retention cleanup stopped hard", "err", err)
		}
	}
	if ctx.Err() == nil {
		c, cancel := context.WithTimeout(ctx, 5*time.Second)
		if err := s.leaser.Release(c, leases); err != nil {
			s.log.Warn("release leases on stop", "err", err)
		}
		if err := s.leaser.Deregister(c); err != nil {
			s.log.Warn("deregister worker on stop", "err", err)
		}
		cancel()
	}
	s.nc.Close()
	s.pool.Close()
}

// Err is why the service stopped on its own (its NATS connection was
// closed for good, as when the server refuses the credentials); nil when
// it was stopped.
func (s *Service) Err() error {
	if e := s.failed.Load(); e != nil {
		return *e
	}
	return nil
}

// natsError logs what the server reports asynchronously, such as a
// permissions violation (a refused subscription leaves a fetch waiting
// for replies that never come: the log says why).
func (s *Service) natsError(_ *nats.Conn, sub *nats.Subscription, err error) {
	if sub != nil {
		s.log.Warn("NATS error", "subject", sub.Subject, "err", err)
		return
	}
	s.log.Warn("NATS error", "err", err)
}

// natsReconnected wakes the partitions waiting out a backoff.
func (s *Service) natsReconnected(*nats.Conn) {
	s.log.Info("NATS connection back", "url", redactURL(s.cfg.NATSURL))
	s.mu.Lock()
	close(s.reconnected)
	s.reconnected = make(chan struct{})
	s.mu.Unlock()
}

func (s *Service) firstBackoffWait() time.Duration { return s.firstBackoff }

// reconnectedCh is closed at the next NATS reconnection.
func (s *Service) reconnectedCh() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.reconnected
}

// natsClosed stops the service when its NATS connection is closed for good
// (nats.go gives up after the server refused the credentials twice): the
// worker would otherwise keep its partitions' leases, renewed in Postgres,
// without ever applying an event.
func (s *Service) natsClosed(nc *nats.Conn) {
	s.mu.Lock()
	closing := s.closing
	s.mu.Unlock()
	if closing {
		return
	}
	cause := nc.LastError()
	if cause == nil {
		cause = nats.ErrConnectionClosed
	}
	err := fmt.Errorf("NATS connection to %s closed: %w", redactURL(s.cfg.NATSURL), cause)
	if errors.Is(cause, nats.ErrAuthorization) || errors.Is(cause, nats.ErrAuthExpired) || errors.Is(cause, nats.ErrAuthRevoked) ||
		errors.Is(cause, nats.ErrAccountAuthExpired) {
		err = fmt.Errorf("%w (give the projector's credentials: --nats-creds FILE, or --nats-nkey, --nats-user; with the capture's embedded broker: --nats-creds <its data dir>/nats/projector.creds)", err)
	}
	s.failed.CompareAndSwap(nil, &err)
	s.log.Error("stopping: the NATS connection is closed for good", "err", err)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_ = s.Stop(ctx)
	}()
}

// run is the coordinator: heartbeat, balance leases, start and stop
// partition workers, refresh status metrics; on a stop (soft done) it
// shuts the service down. ctx is the hard-stop context.
func (s *Service) run(soft, ctx context.Context) {
	defer s.ss.Finish(nil)
	bo := backoff.NewExponentialBackOff()
	bo.InitialInterval = 200 * time.Millisecond
	bo.MaxInterval = s.cfg.MaxBackoff
	bo.MaxElapsedTime = 0
	balance := time.NewTimer(0)
	defer balance.Stop()
	// Lag metrics are refreshed on their own goroutine: a slow stream or
	// database must never delay lease renewal.
	// The version state machine also runs on its own goroutine (it reads
	// the stream), for the same reason.
	// Both end once the partitions have stopped.
	bg, cancelBG := context.WithCancel(ctx)
	defer cancelBG()
	lifecycleDone := make(chan struct{})
	go func() {
		defer close(lifecycleDone)
		s.lifecycleLoop(bg)
	}()
	statusDone := make(chan struct{})
	go func() {
		defer close(statusDone)
		t := time.NewTicker(s.cfg.StatusInterval)
		defer t.Stop()
		for {
			select {
			case <-bg.Done():
				return
			case <-t.C:
				s.refreshStatus(bg)
			}
		}
	}()
	for {
		select {
		case <-soft.Done():
			leases := s.stopPartitions()
			cancelBG()
			<-statusDone
			<-lifecycleDone
			s.shutdown(ctx, leases)
			return
		case <-balance.C:
			if err := s.balance(ctx); err != nil {
				if ctx.Err() != nil {
					continue
				}
				wait := bo.NextBackOff()
				s.metrics.transient.WithLabelValues(quarantine.TransientKind(err)).Inc()
				s.log.Warn("balance partitions; retrying", "err", quarantine.Sanitize(err), "retry_in", wait)
				balance.Reset(min(wait, s.cfg.BalanceInterval))
				continue
			}
			bo.Reset()
			balance.Reset(s.cfg.BalanceInterval)
		}
	}
}

// balance is one coordinator round.
func (s *Service) balance(ctx context.Context) error {
	// A worker counts in the others' fair share from its first heartbeat:
	// one that cannot work yet (no stream, the broker unreachable) must
	// not heartbeat, or the others give partitions back that it never takes.
	if s.partitions == 0 {
		stream, err := s.js.Stream(ctx, event.StreamName(s.cfg.SourceName))
		if err != nil {
			return fmt.Errorf("stream %s (is the capture running?): %w", event.StreamName(s.cfg.SourceName), err)
		}
		n, err := version.CheckedPartitions(ctx, stream, s.cfg.SourceName)
		if err != nil {
			return err
		}
		s.partitions = n
	}
	if err := s.leaser.Heartbeat(ctx); err != nil {
		return err
	}
	if _, err := s.leaser.PruneWorkers(ctx, workerRetention); err != nil {
		return err
	}
	vs, err := version.ListVersions(ctx, s.pool, archive.Projection)
	if err != nil {
		return err
	}
	if fp := fingerprint(vs); fp != s.versions || len(vs) == 0 {
		var head *version.Head
		if len(vs) == 0 {
			// A first run: a stream that lost its beginning is a gap.
			var err error
			if head, err = version.StreamHead(ctx, s.js, s.cfg.SourceName); err != nil {
				return err
			}
		}
		ensured, err := version.EnsureArchiveVersionsFrom(ctx, s.pool, s.partitions, s.cfg.ArchivePartition, s.extraDDL, head)
		if err != nil {
			return err
		}
		// Remember what was ensured, not a list read now: a version
		// created since would be remembered as ensured, and its tables
		// never made (its schema never checked) by this worker.
		s.versions = fingerprint(ensured)
		if vs, err = version.ListVersions(ctx, s.pool, archive.Projection); err != nil {
			return err
		}
	}
	s.setLive(vs)
	active := map[version.VersionKey]bool{}
	for _, v := range vs {
		if !v.Active() {
			continue
		}
		active[v.Key()] = true
		if err := s.balanceVersion(ctx, v); err != nil {
			return err
		}
	}
	// Versions retired since: stop their partitions and give them back.
	var gone []*partitionWorker
	s.mu.Lock()
	for k, w := range s.workers {
		if !active[version.VersionKey{Projection: k.Projection, Version: k.Version}] {
			gone = append(gone, w)
		}
	}
	s.mu.Unlock()
	return s.stopAndRelease(ctx, gone)
}

func fingerprint(vs []version.Version) string {
	out := ""
	for _, v := range vs {
		out += fmt.Sprintf("%s/%d/%s/%s;", v.Projection, v.Version, v.State, v.Schema)
	}
	return out
}

func (s *Service) balanceVersion(ctx context.Context, v version.Version) error {
	n := v.Partitions
	if n == 0 {
		n = s.partitions
	}
	var held []progress.Lease
	s.mu.Lock()
	for k, w := range s.workers {
		if k.Projection == v.Projection && k.Version == v.Version {
			held = append(held, w.lease)
		}
	}
	s.mu.Unlock()
	keep, excess, lost, err := s.leaser.Balance(ctx, v.Projection, v.Version, n, held)
	if err != nil {
		return err
	}
	var stop []*partitionWorker
	s.mu.Lock()
	for _, l := range lost {
		if w, ok := s.workers[l.Key]; ok {
			s.log.Warn("partition lease taken over by another worker", "partition", l.ConsumerName())
			stop = append(stop, w)
		}
	}
	for _, l := range excess {
		if w, ok := s.workers[l.Key]; ok {
			stop = append(stop, w)
		}
	}
	excessSet := map[progress.Key]bool{}
	for _, l := range excess {
		excessSet[l.Key] = true
	}
	for _, l := range keep {
		if excessSet[l.Key] {
			continue
		}
		if _, ok := s.workers[l.Key]; ok {
			continue
		}
		w := newPartitionWorker(s, v, l)
		if s.closing {
			w.Finish(nil) // not run: the lease is given back below
			stop = append(stop, w)
			continue
		}
		s.workers[l.Key] = w
		s.log.Info("partition acquired", "partition", l.ConsumerName(), "epoch", l.Epoch)
		_ = w.Start(s.runCtx) // a new worker: cannot fail
	}
	s.mu.Unlock()
	return s.stopAndRelease(ctx, stop)
}

// stopAndRelease soft-stops workers and then gives their leases back.
func (s *Service) stopAndRelease(ctx context.Context, ws []*partitionWorker) error {
	if len(ws) == 0 {
		return nil
	}
	for _, w := range ws {
		w.RequestStop()
	}
	var leases []progress.Lease
	for _, w := range ws {
		<-w.Done()
		leases = append(leases, w.lease)
		s.mu.Lock()
		if s.workers[w.lease.Key] == w {
			delete(s.workers, w.lease.Key)
		}
		s.mu.Unlock()
		s.log.Info("partition handed over", "partition", w.lease.ConsumerName())
	}
	return s.leaser.Release(ctx, leases)
}

// leaseLost is called by a partition worker that found its lease gone.
func (s *Service) leaseLost(w *partitionWorker) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.workers[w.lease.Key] == w {
		delete(s.workers, w.lease.Key)
	}
}

// Owned lists the partitions this worker runs now.
func (s *Service) Owned() []progress.Key {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]progress.Key, 0, len(s.workers))
	for k := range s.workers {
		out = append(out, k)
	}
	return out
}

// Status collects the status document now.
func (s *Service) Status(ctx context.Context) (*status.Status, error) {
	st, err := status.CollectStatus(ctx, s.pool, s.js, s.cfg.SourceName, s.now())
	if err != nil {
		return nil, err
	}
	st.Worker = s.cfg.WorkerID
	s.mu.Lock()
	st.FillRates(s.lastStatus)
	s.mu.Unlock()
	return st, nil
}

// Live reports an error once the service's loops have ended (Stop, or a
// fatal error); while it retries an unreachable target or NATS it is live.
func (s *Service) Live(context.Context) error {
	if s.pool == nil {
		return errors.New("not started")
	}
	select {
	case <-s.ss.Done():
		return errors.New("stopped")
	default:
		return nil
	}
}

// Healthy reports an error when the target cannot be reached.
func (s *Service) Healthy(ctx context.Context) error {
	if s.pool == nil {
		return errors.New("not started")
	}
	if err := s.pool.Ping(ctx); err != nil {
		return fmt.Errorf("target: %w", err)
	}
	if !s.nc.IsConnected() {
		return errors.New("NATS: not connected")
	}
	return nil
}

func (s *Service) refreshStatus(ctx context.Context) {
	c, cancel := context.WithTimeout(ctx, s.cfg.StatusInterval)
	defer cancel()
	st, err := s.Status(c)
	if err != nil {
		s.metrics.statusRefreshErr.Inc()
		// Not measured now: no lag, lease or heartbeat series rather than
		// the last values (a 0 from before the target went down says
		// "caught up", "every partition leased").
		s.metrics.statusUnknown()
		return
	}
	if err := s.recordLag(c, st); err != nil {
		s.metrics.statusRefreshErr.Inc()
		s.log.Warn("record lag for archive.status", "err", quarantine.Sanitize(err))
	}
	s.metrics.publish(st)
	s.lifecycle.publish(st)
	s.mu.Lock()
	s.lastStatus = st
	s.mu.Unlock()
}
