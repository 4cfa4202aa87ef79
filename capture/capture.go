package capture

import (
	"context"
	"crypto/ed25519"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/broker"
	"github.com/epitaph-dev/epitaph/internal/natsconn"
	"github.com/epitaph-dev/epitaph/internal/observe"
	"github.com/epitaph-dev/epitaph/internal/pgdial"
	"github.com/epitaph-dev/epitaph/internal/pgquote"
	"github.com/epitaph-dev/epitaph/internal/redact"
	"github.com/epitaph-dev/epitaph/internal/startstop"
)

// Service captures the source's deletes into JetStream. It is a service
// (internal/startstop): Start it once; Stop ends it softly (in-flight
// publishes are awaited and what is safe is confirmed to the slot);
// cancelling Start's context is the hard stop (nothing more is awaited or
// confirmed: a restart sends the unconfirmed tail again, deduplicated).
type Service struct {
	cfg Config
	log *slog.Logger
	reg *prometheus.Registry
	now func() time.Time
	m   *metrics

	pool    *pgxpool.Pool
	repl    *pgconn.PgConn
	embed   *broker.Server
	nc      *nats.Conn
	natsURL string
	obsrv   *observe.Server
	st      *streamer

	// failoverOnce: the server's lack of failover slots is logged once.
	failoverOnce sync.Once

	// walsender is the source backend of the replication connection that
	// last started replication on the slot (0: none yet): after a lost
	// session, the one walsender this process may end (walsender.go).
	walsender uint32
	// terminateRefused: ending a stale walsender was refused; said once.
	terminateRefused sync.Once

	// movesOff: the sessions do not read the moves publication
	// (movesPublication), which keeps a row moved between partitions out of
	// the archive. Set for the life of a process that created it for an
	// existing slot: pgoutput fails on WAL older than a publication it is
	// asked for.
	movesOff bool

	// embedDone is closed when the embedded server started in the
	// background (startEmbedded) is up (embed) or failed (embedErr).
	embedDone chan struct{}
	embedErr  error

	// The CPU mode (cpumode.go; nil: not limited) and the LSN the stream
	// loop has received everything before (commits, idle keepalives).
	cpu      *cpuGovernor
	received atomic.Uint64

	// rowCommit is the commit LSN of the last transaction with rows the
	// stream loop handled; heartbeats watches it for the source going
	// quiet (Config.HeartbeatQuiet).
	rowCommit atomic.Uint64

	ss      startstop.Base
	hardCtx context.Context    // done: the hard stop
	cancel  context.CancelFunc // ends the stream loop and the background work
	bgWG    sync.WaitGroup

	mu          sync.Mutex
	sel         *tableSelection
	pubTables   []string
	confirmed   event.LSN
	lagSeconds  float64
	slotStats   slotStats
	lastHB      atomic.Int64 // unix nanos of the last heartbeat seen
	activeState atomic.Bool
	links       *links // the source's and the broker's connection state (outage.go)
	role        string
	standby     *StandbyStatus

	cat         *catalog      // shared by the streamer and the catalog watch
	catalogKick chan struct{} // a Relation message arrived: check the catalog

	settleStoredWarned atomic.Bool     // settleStoredWarning was logged
	ownerWarned        map[string]bool // tables warned about as not owned, under mu
	catalogFP          string          // catalog fingerprint at the last reconcile (watchCatalog's goroutine)
	// leaves are the published partitioned tables' leaves at the last look
	// (setup, then watchCatalog's goroutine; leaves.go).
	leaves      map[uint32]leafOf
	leafRec     *leafRecord // nil until the first look
	ddlListenUp atomic.Bool // the notify guard's LISTEN is up (listenDDL)
	ddlDue      atomic.Bool // a catalog check for the notify guard's signals is due (ddlSignal)
	// catalogAbort cancels the catalog check running, if any
	// (abortCatalogCheck).
	catalogAbort atomic.Pointer[context.CancelFunc]

	lease    *lease // with Config.Standby
	leaseErr atomic.Pointer[LeaseLostError]
	// limitsErr: the stream's limits could not be kept (limits.go).
	limitsErr atomic.Pointer[LimitsError]
	// unsafeWarned: the stream settings that cannot be undone already
	// logged while streaming (by name).
	unsafeWarned sync.Map
	// The partition sequences kept outside the stream (seqrecord.go):
	// seqTableOK, the source's record can be used; the failing flags
	// (streaming goroutine only) log a failing record once.
	seqTableOK                      atomic.Bool
	seqFileFailing, seqTableFailing bool
	// timeline: the source's timeline in this session, recorded with
	// the slot's position (timeline.go).
	timeline atomic.Int32

	// Trust (trust.go): the signing key, and the foreign and implausible
	// messages already reported (by stream sequence).
	priv            ed25519.PrivateKey
	pub             ed25519.PublicKey
	keyID, pubPath  string
	foreignSeen     map[uint64]struct{}
	implausibleSeen map[uint64]struct{}

	// The session's collaborators, kept for the next session.
	db  string
	js  jetstream.JetStream
	obs jetstream.ObjectStore

	// hooks: set by tests only (nil in production).
	hooks *testHooks
}

// testHooks let a test stop the capture at a chosen point, on the stream
// loop's goroutine, to play another writer there deterministically.
type testHooks struct {
	// beforeCommit runs before a commit message is published.
	beforeCommit func(commitLSN event.LSN)
	// holdAcks, returning true, makes the loop leave acknowledgements
	// uncollected for now (as when they arrive late under load).
	holdAcks func() bool
	// untaggedIDs: publish plain message ids, as a capture before
	// event.MsgIDTagger did.
	untaggedIDs bool
	// afterMembers runs in a catalog reconcile once it has read the
	// publication's members (on the catalog watch's goroutine).
	afterMembers func()
}

// New validates cfg and builds a service. It connects to nothing.
func New(cfg Config, opts ...Option) (*Service, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	s := &Service{cfg: cfg, role: RoleStarting, catalogKick: make(chan struct{}, 1)}
	for _, o := range opts {
		o(s)
	}
	if s.log == nil {
		s.log = slog.Default()
	}
	if s.reg == nil {
		s.reg = prometheus.NewRegistry()
	}
	if s.now == nil {
		s.now = time.Now
	}
	m, err := newMetrics(s.reg, s.heartbeatAge, s.now)
	if err != nil {
		return nil, fmt.Errorf("register capture metrics: %w", err)
	}
	s.m = m
	s.m.syncInterval.Set(max(cfg.BrokerSyncInterval, 0).Seconds())
	s.links = newLinks(s.log, m.connected, s.now)
	s.cpu = newCPUGovernor(&s.cfg)
	s.m.cpus.Set(float64(runtime.GOMAXPROCS(0)))
	if !pgdial.UserTimeoutApplies && cfg.SourceTCPTimeout > 0 {
		s.log.Info("--source-tcp-timeout not applied: TCP_USER_TIMEOUT is Linux's; a silently dead path to the source is noticed when the system's TCP gives up",
			"os", runtime.GOOS)
	}
	if g := s.cpu; g != nil && g.tailNice > 0 && g.setNice == nil {
		s.log.Info("--tail-nice not applied: the source's backends get no precedence over the capture on shared CPUs",
			"reason", g.niceWhy, "instead", "a lower CPU weight for the capture's cgroup (systemd: CPUWeight=), or --tail-cpus alone")
	}
	return s, nil
}

// NATSURL is the URL of the JetStream server in use: the embedded server's
// client URL, or Config.NATSURL. Valid after Start.
func (s *Service) NATSURL() string { return s.natsURL }

// MetricsAddr is the address the endpoint server listens on, after Start.
func (s *Service) MetricsAddr() string {
	if s.obsrv == nil {
		return ""
	}
	return s.obsrv.Addr()
}

// Start connects, checks the source, sets up the publication, the stream
// and the slot, and starts streaming in the background. Setup errors are
// returned here (a *ConfigError when the operator must change something).
// Cancelling ctx later is the hard stop.
//
// With Config.Standby, Start returns once the source is checked and the
// endpoints are served: the capture waits for the lease in the background,
// and errors of the setup that follows are returned by Wait.
func (s *Service) Start(ctx context.Context) (err error) {
	soft, hard, ok := s.ss.StartInit(ctx)
	if !ok {
		return errors.New("capture already started")
	}
	s.hardCtx = hard
	defer func() {
		if err != nil {
			s.closeAll()
			s.setRole(RoleStopped, nil)
			s.ss.Finish(err)
		}
	}()
	cfg := &s.cfg
	s.log.Info("capture starting", "source", RedactURL(cfg.SourceURL), "source_name", cfg.SourceName, "slot", cfg.SlotName,
		"publication", cfg.PublicationName, "partitions", cfg.Partitions, "standby", cfg.Standby, "application_name", cfg.ApplicationName)
	if cfg.NATSURL != "" {
		s.natsURL = cfg.NATSURL
	}

	pcfg, err := pgxpool.ParseConfig(cfg.SourceURL)
	if err != nil {
		return configErr("source URL %s: %v", RedactURL(cfg.SourceURL), redactErr(err))
	}
	if !cfg.Standby && cfg.NATSURL == "" {
		// The embedded server starts (and recovers its store) while the
		// source is checked: nothing is published before setup has passed
		// every check, it only waits for the server there.
		s.startEmbedded()
	}
	pcfg.MaxConns = 3
	if pcfg.PingTimeout == 0 { // pool_ping_timeout in the source URL wins
		pcfg.PingTimeout = sourcePingTimeout
	}
	pcfg.ConnConfig.RuntimeParams["application_name"] = cfg.ApplicationName
	pgdial.Set(&pcfg.ConnConfig.Config, cfg.SourceTCPTimeout)
	pcfg.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
		_, err := c.Exec(ctx, "SET search_path = pg_catalog")
		return err
	}
	if s.pool, err = pgxpool.NewWithConfig(ctx, pcfg); err != nil {
		return fmt.Errorf("connect to source %s: %w", RedactURL(cfg.SourceURL), err)
	}
	var db string
	err = s.untilReachable(ctx, linkSource, func() (err error) {
		db, err = checkServer(ctx, s.pool)
		return err
	})
	if err != nil {
		if ce := sourceLoginErr(cfg.SourceURL, err); ce != nil {
			return ce
		}
		return fmt.Errorf("check source %s: %w", RedactURL(cfg.SourceURL), err)
	}
	s.links.connected(linkSource)
	if err := s.loadKey(); err != nil {
		return err
	}
	s.ensureSeqTable(ctx)

	if !cfg.Standby {
		if err := s.setup(ctx, db); err != nil {
			return err
		}
		if err := s.startEndpoints(ctx); err != nil {
			return err
		}
		loopCtx, cancel := context.WithCancel(soft)
		s.cancel = cancel
		s.activate(loopCtx)
		go s.runLoop(loopCtx)
		return nil
	}

	if s.lease, err = newLease(cfg.SourceURL, cfg.ApplicationName, db, cfg.SlotName, cfg.SourceTCPTimeout); err != nil {
		return err
	}
	s.setRole(RoleStandby, &StandbyStatus{Since: s.now().UTC(), WaitingFor: "lease"})
	if err := s.startEndpoints(ctx); err != nil {
		return err
	}
	loopCtx, cancel := context.WithCancel(soft)
	s.cancel = cancel
	go s.runStandby(loopCtx, db)
	return nil
}

// startEndpoints serves /metrics, the probes and /status; a second call
// does nothing.
func (s *Service) startEndpoints(ctx context.Context) error {
	if s.obsrv != nil {
		return nil
	}
	s.obsrv = observe.New(observe.Config{Addr: s.cfg.MetricsAddr, Registry: s.reg, Status: s.status, Healthy: s.healthy,
		Live: s.live, Logger: s.log})
	return s.obsrv.Start(ctx)
}

// startEmbedded starts the embedded JetStream server in the background:
// awaitEmbedded waits for it.
func (s *Service) startEmbedded() {
	cfg := &s.cfg
	bc := broker.Config{StoreDir: cfg.embeddedStoreDir(), Listen: cfg.EmbeddedListen,
		Auth: &broker.Auth{Dir: EmbeddedCredsDir(cfg.DataDir), Source: cfg.SourceName}, Logger: s.log}
	if cfg.BrokerSyncInterval < 0 {
		bc.SyncAlways = true
	} else {
		bc.SyncInterval = cfg.BrokerSyncInterval
	}
	done := make(chan struct{})
	s.embedDone = done
	go func() {
		defer close(done)
		srv, err := broker.Start(bc)
		if err != nil {
			s.embedErr = err
			return
		}
		s.embed = srv
		s.log.Info("embedded JetStream started", "url", srv.ClientURL(), "store", bc.StoreDir,
			"projector_creds", srv.ProjectorCreds(), "erase_creds", srv.EraseCreds())
	}()
}

// awaitEmbedded waits for the server startEmbedded started and returns its
// start's error. The first call sets s.natsURL.
func (s *Service) awaitEmbedded() error {
	if s.embedDone == nil {
		s.startEmbedded()
	}
	<-s.embedDone
	if s.embedErr != nil {
		return s.embedErr
	}
	if s.embed != nil && s.natsURL == "" {
		s.natsURL = s.embed.ClientURL()
	}
	return nil
}

// runStandby waits for the lease and the slot, sets up and streams. A
// stop while waiting ends it without error.
func (s *Service) runStandby(ctx context.Context, db string) {
	err := s.acquire(ctx)
	if err == nil {
		err = s.setup(ctx, db)
	}
	if err != nil {
		if lost := s.lostLease(); lost != nil {
			err = lost
		} else if ctx.Err() != nil {
			err = nil // stopped while waiting
		}
		if err != nil {
			s.log.Error("capture stopped", "err", redactErr(err))
		}
		s.finish(err)
		return
	}
	s.activate(ctx)
	s.runLoop(ctx)
}

// setup checks and sets up the tables, the publication, the slot and the
// stream, and starts replication. The slot is created before the stream,
// so whoever sees the stream can rely on every delete committed from then
// on reaching it: the stream is read first (where to resume, whether a
// missing slot means a gap) and created last.
func (s *Service) setup(ctx context.Context, db string) (err error) {
	cfg := &s.cfg
	sel, err := selectTables(ctx, s.pool, cfg.PublicationName, cfg.Tables, cfg.SetReplicaIdentityFull, false)
	if err != nil {
		return err
	}
	if len(sel.madeFull) > 0 {
		s.log.Info("set REPLICA IDENTITY FULL (--set-replica-identity-full)", "tables", sel.madeFull)
		s.m.madeFull.Add(float64(len(sel.madeFull)))
	}
	s.warnSelection(sel)
	if cfg.RefuseKeyOnly && len(sel.keyOnly) > 0 {
		return &KeyOnlyError{Tables: sel.keyOnly}
	}
	if len(sel.keyOnly) > 0 {
		s.log.Warn("tables without REPLICA IDENTITY FULL: their delete events carry only the key (\"identity\":\"key\"); use --set-replica-identity-full to archive whole rows", "tables", sel.keyOnly)
	}
	s.m.withoutFull.Set(float64(len(sel.keyOnly)))
	changed, err := syncPublication(ctx, s.pool, cfg.PublicationName, sel)
	if err != nil {
		return err
	}
	if changed {
		s.log.Info("publication synced", "publication", cfg.PublicationName, "tables", sel.names())
	}
	if err := s.setupMoves(ctx, sel); err != nil {
		return err
	}
	pubTables, err := publicationTables(ctx, s.pool, cfg.PublicationName)
	if err != nil {
		return err
	}
	if len(pubTables) == 0 {
		s.log.Warn("publication has no tables: nothing will be captured", "publication", cfg.PublicationName)
	}
	s.mu.Lock()
	s.sel, s.pubTables = sel, pubTables
	s.mu.Unlock()
	if err := s.trackLeaves(ctx); err != nil {
		return err
	}
	s.cat = newCatalog(s.pool)
	s.cat.store = newFactsStore(ctx, s.pool, cfg.PublicationName, cfg.Standby, s.log)
	if err := s.cat.remember(ctx, sel.oids()); err != nil {
		return err
	}
	if cfg.InstallDDLGuard {
		if err := InstallDDLGuard(ctx, s.pool, cfg); err != nil {
			return err
		}
		if s.notifyGuard() {
			s.log.Info("DDL guard installed: DDL that can change what the publication may hold signals the capture, which checks the catalog at once",
				"event_trigger", guardTriggerName(cfg.PublicationName), "mode", cfg.DDLGuardMode, "channel", guardChannel(cfg.PublicationName))
		} else {
			s.log.Info("DDL guard installed: the publication rules apply at the end of every DDL command", "event_trigger", guardTriggerName(cfg.PublicationName),
				"mode", cfg.DDLGuardMode)
		}
	}

	// Broker.
	if cfg.NATSURL == "" {
		if err := s.awaitEmbedded(); err != nil {
			return err
		}
	}
	extra := s.links.natsHandlers()
	if s.embed != nil {
		// The capture's own connection to its embedded server needs no
		// socket: ~20% more rows/s in bench-capture. Other processes
		// (projectors) connect to its listen address. It authenticates as
		// the capture role all the same.
		extra = append(extra, nats.InProcessServer(s.embed), natsconn.UserCredentials(s.embed.CaptureCreds(), natsconn.WithLogger(s.log)))
	} else {
		auth, err := cfg.NATSAuth.Options(s.natsURL, natsconn.WithLogger(s.log))
		if err != nil {
			return configErr("%v", err)
		}
		extra = append(extra, auth...)
	}
	err = s.untilReachable(ctx, linkBroker, func() (err error) {
		s.nc, err = connectNATS(s.natsURL, cfg.ApplicationName, extra...)
		return err
	})
	if err != nil {
		return err
	}
	s.links.connected(linkBroker)
	js, err := s.publishJS()
	if err != nil {
		return err
	}
	objJS, err := jetstream.New(s.nc)
	if err != nil {
		return fmt.Errorf("jetstream: %w", err)
	}
	// The first JetStream request: a server that accepts connections may
	// not answer JetStream yet (the embedded one still starting it under
	// load: no responders), waited for like a broker that is down.
	var obs jetstream.ObjectStore
	err = s.untilReachable(ctx, linkBroker, func() (err error) {
		obs, err = ensureRowBucket(ctx, objJS, cfg)
		return err
	})
	if err != nil {
		return err
	}
	s.db, s.js, s.obs = db, js, obs
	return s.startSession(ctx, true)
}

// publishJS is a JetStream context for a session's publishes.
func (s *Service) publishJS() (jetstream.JetStream, error) {
	js, err := jetstream.New(s.nc,
		jetstream.WithPublishAsyncMaxPending(s.cfg.MaxInFlight+64),
		jetstream.WithPublishAsyncTimeout(time.Minute))
	if err != nil {
		return nil, fmt.Errorf("jetstream: %w", err)
	}
	return js, nil
}

// startSession reads where to resume, opens the replication connection,
// checks (or makes) the slot and the stream, and starts replication. A
// later session (after another writer got in the way, see runLoop) does the
// same from the slot's confirmed position.
func (s *Service) startSession(ctx context.Context, first bool) (err error) {
	cfg, js := &s.cfg, s.js
	// The stream is read now (where to resume, whether a missing slot means
	// a gap) but, on a first start, created only after the slot: once the
	// stream exists, so does the slot, and every delete committed from then
	// on reaches the stream.
	stream, err := openStream(ctx, js, cfg, s.startLimits)
	if err != nil {
		return err
	}
	rp, err := s.resumeFrom(ctx, stream)
	if err != nil {
		return err
	}
	t := tail{has: rp.has, pos: rp.pos, recorded: rp.slotLSN, timeline: rp.timeline}
	if err := s.connectReplication(ctx); err != nil {
		return err
	}
	tli, err := s.sourceTimeline(ctx)
	if err != nil {
		return err
	}
	fork, err := s.checkTimeline(ctx, t, tli)
	if err != nil {
		return err
	}
	s.timeline.Store(tli)
	plan, startLSN, err := s.prepareSlot(ctx, first, t)
	if err != nil {
		return err
	}
	s.setConfirmed(startLSN)
	s.received.Store(uint64(startLSN))
	if stream == nil {
		// A new stream numbers every partition from 1: the sequences
		// recorded for an earlier stream of the name (deleted by an
		// operator: neither role may) go first.
		if err := s.resetSeqRecords(ctx); err != nil {
			return err
		}
		if stream, err = ensureStream(ctx, js, cfg, s.startLimits); err != nil {
			if plan.create {
				// A first start that fails leaves no slot holding WAL.
				if derr := dropSlot(ctx, s.repl, cfg.SlotName); derr != nil {
					s.log.Warn("could not drop the slot this start created", "slot", cfg.SlotName, "err", redactErr(derr))
				}
			}
			return err
		}
	}
	st := s.newStreamer(rp, stream, first, startLSN)
	if plan.gap != "" {
		from := t.pos.lsn
		if err := st.publishGap(ctx, gapInfo{from: from, to: startLSN, reason: plan.gap}); err != nil {
			return err
		}
		s.log.Warn("gap recorded: deletes in this LSN range were lost upstream", "from", from.String(), "to", startLSN.String(), "reason", plan.gap)
	}
	if fork != nil {
		if err := st.publishGap(ctx, *fork); err != nil {
			return err
		}
		s.log.Warn("gap recorded: deletes in this LSN range were lost upstream", "from", fork.from.String(), "to", fork.to.String(), "reason", fork.reason)
	}
	// The timeline is recorded before anything is published on it.
	s.recordTimeline(ctx, startLSN)

	err = pglogrepl.StartReplication(ctx, s.repl, cfg.SlotName, 0, pglogrepl.StartReplicationOptions{
		Mode: pglogrepl.LogicalReplication,
		PluginArgs: []string{
			"proto_version '1'",
			"publication_names " + pgquote.Literal(s.publicationNames()),
			"messages 'true'",
		},
	})
	if err != nil {
		return fmt.Errorf("start replication on slot %s: %w", cfg.SlotName, slotErr(cfg.SlotName, err))
	}
	s.walsender = s.repl.PID()
	return nil
}

// warnSelection logs, at start, what the selection leaves out and what of
// the selected tables PostgreSQL does not send.
func (s *Service) warnSelection(sel *tableSelection) {
	for _, sk := range sel.skipped {
		s.log.Warn("table not captured", "table", sk)
		if strings.Contains(sk, unloggedPartition) {
			s.warnedOwner(sk) // said once: not again by the catalog poll
		}
	}
	if parts := sel.partitioned(); len(parts) > 0 {
		s.log.Warn(msgPartitionTruncate, "tables", parts)
	}
}

// setupMoves syncs the moves publication with sel; created now for a slot
// that exists, it is not read by this process (movesOff).
func (s *Service) setupMoves(ctx context.Context, sel *tableSelection) error {
	cfg := &s.cfg
	var slotExists bool
	if err := s.pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1)`, cfg.SlotName).Scan(&slotExists); err != nil {
		return fmt.Errorf("read replication slots: %w", err)
	}
	created, err := syncMovesPublication(ctx, s.pool, cfg.PublicationName, sel)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42501" {
		// A publication made by a DBA for a role without CREATE: capture
		// as before, moved rows archived as deletes, and say how to fix it.
		s.movesOff = true
		s.log.Warn("cannot create or change the moves publication: rows an UPDATE moves between partitions are archived as deletes",
			"publication", movesPublication(cfg.PublicationName), "err", pgErr.Message,
			"fix", "grant CREATE on the database, or have the tables' owner run CREATE PUBLICATION "+pgx.Identifier{movesPublication(cfg.PublicationName)}.Sanitize()+" FOR TABLE <the partitioned tables> WITH ("+movesOptions+")")
		return nil
	}
	if err != nil {
		return err
	}
	if created && slotExists {
		s.movesOff = true
		s.log.Warn("publication created for an existing slot: rows an UPDATE moves between partitions are recognised from the next start; until then they are archived as deletes",
			"publication", movesPublication(cfg.PublicationName))
	}
	return nil
}

// publicationNames is pgoutput's publication_names: the publication, and
// the moves publication when the sessions read it.
func (s *Service) publicationNames() string {
	names := quoteIdent(s.cfg.PublicationName)
	if !s.movesOff {
		names += "," + quoteIdent(movesPublication(s.cfg.PublicationName))
	}
	return names
}

// resumeFrom is where the session resumes in stream (nil: none yet, start
// from scratch).
func (s *Service) resumeFrom(ctx context.Context, stream jetstream.Stream) (resumePoint, error) {
	cfg := &s.cfg
	var rp resumePoint
	rp.partSeq = make([]uint64, cfg.Partitions)
	if stream == nil {
		return rp, nil
	}
	stored, err := settle(ctx, s.js, stream, cfg.SourceName)
	if err != nil {
		return rp, err
	}
	if stored && !s.settleStoredWarned.Swap(true) {
		s.log.Warn(settleStoredWarning, "subject", event.SettleSubject(cfg.SourceName))
	}
	current, err := sourceWALPosition(ctx, s.pool)
	if err != nil {
		return rp, err
	}
	if rp, err = s.findResume(ctx, stream, cfg.Partitions, current); err != nil {
		return rp, fmt.Errorf("find where to resume in stream %s: %w", event.StreamName(cfg.SourceName), err)
	}
	recs, err := s.readSeqRecords(ctx)
	if err != nil {
		return rp, err
	}
	s.raiseSeqs(rp.partSeq, recs)
	rp.recorded = recs.seqs(cfg.Partitions)
	rp.slotLSN, rp.timeline = recs.slotLSN, recs.timeline
	return rp, nil
}

// connectReplication opens the session's replication connection (s.repl).
func (s *Service) connectReplication(ctx context.Context) error {
	cfg := &s.cfg
	rcfg, err := pgconn.ParseConfig(cfg.SourceURL)
	if err != nil {
		return configErr("source URL %s: %v", RedactURL(cfg.SourceURL), redactErr(err))
	}
	rcfg.RuntimeParams["replication"] = "database"
	rcfg.RuntimeParams["application_name"] = cfg.ApplicationName
	pgdial.Set(rcfg, cfg.SourceTCPTimeout)
	// Text output the inverse casts read back exactly.
	rcfg.RuntimeParams["DateStyle"] = "ISO, MDY"
	rcfg.RuntimeParams["IntervalStyle"] = "postgres"
	rcfg.RuntimeParams["TimeZone"] = "UTC"
	rcfg.RuntimeParams["extra_float_digits"] = "3"
	rcfg.RuntimeParams["bytea_output"] = "hex"
	rcfg.RuntimeParams["client_encoding"] = "UTF8"
	if s.repl, err = pgconn.ConnectConfig(ctx, rcfg); err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && (pgErr.Code == "28000" || pgErr.Code == "42501") {
			return configErr("open a replication connection to %s: %s (the role needs the REPLICATION privilege and pg_hba.conf a 'replication' entry for it)", RedactURL(cfg.SourceURL), pgErr.Message)
		}
		if ce := sourceLoginErr(cfg.SourceURL, err); ce != nil {
			return ce
		}
		return fmt.Errorf("open a replication connection to %s: %w", RedactURL(cfg.SourceURL), err)
	}
	return nil
}

// prepareSlot reads the slot (on a later session, ending this process's
// own stale walsender and waiting up to a minute for the slot to be let
// go of), drops or creates it as planSlot says for the stream's tail t,
// and returns the plan and the LSN replication starts from.
func (s *Service) prepareSlot(ctx context.Context, first bool, t tail) (slotPlan, event.LSN, error) {
	cfg := &s.cfg
	slot, err := readSlot(ctx, s.pool, cfg.SlotName)
	if err != nil {
		return slotPlan{}, 0, err
	}
	decided := false // whether to end the slot's walsender
	for deadline := s.now().Add(time.Minute); !first && slot.activePID != nil && s.now().Before(deadline); {
		// The previous session's walsender may not have gone yet: after
		// a silently dead path the source keeps it until
		// wal_sender_timeout. This process's own is ended at once.
		if !decided {
			decided = s.endOwnWalsender(ctx, *slot.activePID)
		}
		select {
		case <-ctx.Done():
			return slotPlan{}, 0, ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
		if slot, err = readSlot(ctx, s.pool, cfg.SlotName); err != nil {
			return slotPlan{}, 0, err
		}
	}
	if !first && slot.activePID != nil {
		// Still held after a minute: after a network loss the source may
		// keep the previous session's walsender until wal_sender_timeout
		// tells it the capture is gone. Retried as an outage.
		return slotPlan{}, 0, &slotBusyError{slot: cfg.SlotName, pid: *slot.activePID}
	}
	plan, err := planSlot(slot, cfg.SlotName, s.db, t, event.StreamName(cfg.SourceName), cfg.RecreateSlot)
	if err != nil {
		return plan, 0, err
	}
	var startLSN event.LSN
	if slot.confirmed != nil {
		startLSN, _ = event.ParseLSN(*slot.confirmed)
	}
	if plan.drop {
		s.log.Warn("dropping invalidated replication slot", "slot", cfg.SlotName)
		if err := dropSlot(ctx, s.repl, cfg.SlotName); err != nil {
			return plan, 0, err
		}
	}
	if plan.create {
		failover := s.slotFailover()
		stop := s.reportSlotWaits(ctx, cfg.SlotName, s.repl.PID())
		cp, err := createSlot(ctx, s.repl, cfg.SlotName, failover)
		stop()
		if err != nil {
			return plan, 0, err
		}
		startLSN = cp
		s.log.Info("replication slot created", "slot", cfg.SlotName, "consistent_point", cp.String(), "failover", failover)
	} else if err := s.syncSlotFailover(ctx, slot); err != nil {
		return plan, 0, err
	}
	return plan, startLSN, nil
}

// newStreamer makes the session's streamer (s.st), resuming after rp in
// stream from startLSN.
func (s *Service) newStreamer(rp resumePoint, stream jetstream.Stream, first bool, startLSN event.LSN) *streamer {
	cfg := &s.cfg
	st := &streamer{
		s: s, conn: s.repl, js: s.js, nc: s.nc, obs: s.obs, cat: s.cat,
		rels: map[uint32]*relation{}, tr: newTracker(cfg.BrokerSyncInterval, s.now()),
		src: cfg.SourceName, parts: cfg.Partitions, tables: map[string]int{},
		maxMsg:   int(s.nc.MaxPayload()) - payloadHeadroom,
		resuming: rp.has, resume: rp.pos,
		priv: s.priv, tagger: event.NewMsgIDTagger(s.priv), keyID: s.keyID, pubText: event.PublicKeyString(s.pub), partSeq: rp.partSeq, digest: event.NewDigestV2(),
	}
	if s.hooks != nil && s.hooks.untaggedIDs {
		st.tagger = nil
	}
	st.tr.startSeqs(rp.partSeq, rp.recorded)
	watch := leaderWatch(stream)
	st.tr.stalled = func() bool {
		err := watch()
		if err != nil {
			s.links.lost(linkBroker, err)
		}
		if errors.Is(err, errLeaderChanged) {
			st.tr.abandon = err
		}
		return err != nil
	}
	st.tr.unstalled = func() { s.links.connected(linkBroker) }
	if rp.adoptFrom != 0 {
		st.adopt = &adopter{s: s, st: stream, next: rp.adoptFrom, to: rp.adoptTo}
	}
	if !first || rp.adoptFrom != 0 {
		// Another writer got in the way, or the stream holds messages
		// after the proven ones: one of them may hold the id of a message
		// about to be published (trust.go).
		st.careful = carefulMsgs
	}
	st.tr.safe, st.flushed = startLSN, startLSN
	st.tr.reportLagTo(&s.m.unconfirmedSince)
	s.st = st
	if rp.has {
		var after uint64
		if rp.adoptFrom != 0 {
			after = rp.adoptTo - rp.adoptFrom + 1
		}
		s.log.Info("resuming after the last message this capture can prove it published", "position", rp.pos.String(),
			"stored_after_it", after, "slot_confirmed_lsn", startLSN.String())
	}
	return st
}

// sourceWALPosition is where the source's WAL ends now: no message the
// capture published can stand for a later position.
func sourceWALPosition(ctx context.Context, pool *pgxpool.Pool) (event.LSN, error) {
	var text string
	err := pool.QueryRow(ctx, `SELECT (CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_lsn() END)::text`).Scan(&text)
	if err != nil {
		return 0, fmt.Errorf("read the source's current WAL position: %w", err)
	}
	return event.ParseLSN(text)
}

// activate marks the capture active and starts its background work.
func (s *Service) activate(ctx context.Context) {
	s.activeState.Store(true)
	s.setRole(RoleActive, nil)
	s.m.active.Set(1)
	s.bgWG.Add(4)
	go s.heartbeats(ctx)
	go s.pollSlot(ctx)
	go s.watchCatalog(ctx)
	go s.watchLimits(ctx, s.st.js)
	if s.notifyGuard() {
		s.bgWG.Add(1)
		go s.listenDDL(ctx)
	}
	if s.cpu != nil {
		// The mode is decided before the first message is read: a start
		// with a backlog catches up from its first row.
		s.checkCPUs(ctx)
		s.bgWG.Add(1)
		go s.governCPUs(ctx)
	}
	s.log.Info("capture streaming", "slot", s.cfg.SlotName, "from", s.st.flushed.String(), "stream", event.StreamName(s.cfg.SourceName),
		"nats", RedactURL(s.natsURL), "tables", len(s.pubTables), "standby", s.cfg.Standby)
}

// runLoop streams until stopped or failed, then ends the service. When
// another writer got in the way of a session (a foreign message broke the
// chain, or took one of the capture's message ids), or the source or the
// broker went away (outage), the capture is not streaming until a new
// session, started here from the slot's confirmed position, resumes after
// what the stream proves (trust.go): nothing is lost or stored twice, as
// after a restart of the process. Outages are retried with backoff for as
// long as they last; what a restart cannot fix ends the service.
func (s *Service) runLoop(ctx context.Context) {
	backoff := 100 * time.Millisecond
	reconnect := newReconnectBackoff()
	for {
		err := s.st.run(ctx)
		s.activeState.Store(false)
		s.m.active.Set(0)
		restarted, reconnecting := false, false
		for err != nil && ctx.Err() == nil && s.lostLease() == nil {
			var wait time.Duration
			if to, ok := outage(err); ok {
				s.links.lost(to, err)
				if !reconnecting {
					reconnect.Reset()
					reconnecting = true
				}
				wait = reconnect.NextBackOff()
				s.log.Debug("capture not streaming: will start a new session", "link", to, "in", wait, "err", redactErr(err))
			} else if interference(err) {
				s.m.sessions.Inc()
				s.log.Warn("another writer got in the way of the capture's messages: starting a new session from the slot's confirmed position", "err", err)
				wait = backoff
				backoff = min(2*backoff, 5*time.Second)
			} else {
				break
			}
			err = s.restartSession(ctx, wait, err)
			restarted = true
		}
		if restarted && err == nil && ctx.Err() != nil {
			// Stopped between sessions: nothing in flight.
			if le := s.limitsErr.Load(); le != nil {
				err = le
			}
			s.finish(err)
			return
		}
		if restarted && err == nil && s.lostLease() == nil {
			s.activeState.Store(true)
			s.m.active.Set(1)
			if reconnecting {
				// The links' own lines say what came back.
				s.links.connected(linkSource)
				s.links.connected(linkBroker)
			} else {
				s.log.Info("capture streaming", "slot", s.cfg.SlotName, "from", s.st.flushed.String(), "stream", event.StreamName(s.cfg.SourceName), "session", "restarted")
			}
			continue
		}
		if lost := s.lostLease(); lost != nil {
			// Fail closed: no soft stop, nothing more confirmed.
			if err != nil {
				s.log.Error("capture loop ended after the lease was lost", "err", err)
			}
			err = lost
		} else if err == nil && s.hardCtx.Err() != nil {
			s.log.Info("capture stopped hard", "confirmed_lsn", s.st.flushed.String())
		} else if err == nil {
			err = s.softStop()
			if le := s.limitsErr.Load(); le != nil && err == nil {
				err = le
			}
		} else {
			if reconnecting {
				err = fmt.Errorf("reconnect after an outage: %w", err)
			}
			s.log.Error("capture stopped", "err", redactErr(err))
		}
		s.finish(err)
		return
	}
}

// restartSession ends the current session, which ended on cause (its
// publishes are answered or abandoned, the replication connection closed)
// and starts the next one after wait, once the broker is connected.
func (s *Service) restartSession(ctx context.Context, wait time.Duration, cause error) error {
	if errors.Is(cause, errLeaderChanged) {
		// The old leader answers none of them: they time out on the old
		// context, unseen, and take none of the next session's room.
		js, err := s.publishJS()
		if err != nil {
			return err
		}
		s.js = js
	} else {
		select {
		case <-s.js.PublishAsyncComplete():
		case <-time.After(30 * time.Second):
		case <-ctx.Done():
			return nil
		}
	}
	if s.repl != nil {
		cctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_ = s.repl.Close(cctx)
		cancel()
		s.repl = nil
	}
	select {
	case <-time.After(wait):
	case <-ctx.Done():
		return nil
	}
	if err := s.awaitBroker(ctx); err != nil {
		return err
	}
	if err := s.startSession(ctx, false); err != nil {
		if ctx.Err() != nil {
			return nil
		}
		if ce := sourceLoginErr(s.cfg.SourceURL, err); ce != nil {
			return ce // the password changed while the source was away
		}
		return err
	}
	return nil
}

// finish stops the background work, closes everything and ends the service
// with err.
func (s *Service) finish(err error) {
	s.cancel()
	s.bgWG.Wait()
	s.closeAll()
	s.setRole(RoleStopped, nil)
	s.ss.Finish(err)
}

// softStop waits for the in-flight publishes and confirms what is safe. An
// embedded broker is shut down first and its files fsynced, so every
// acknowledged position becomes safe. The hard stop cuts it short.
func (s *Service) softStop() error {
	ctx, cancel := context.WithTimeout(s.hardCtx, 30*time.Second)
	defer cancel()
	if err := s.st.finish(ctx); err != nil {
		return fmt.Errorf("stop: %w", err)
	}
	if s.embed != nil {
		s.nc.Close()
		s.embed.Shutdown()
		s.embed = nil
		// The server closes its files without fsync: sync them here, then
		// everything acknowledged is durable and may be confirmed.
		if err := syncTree(s.cfg.embeddedStoreDir()); err != nil {
			s.log.Warn("sync embedded JetStream files; confirming only what is older than the sync interval", "err", err)
		} else {
			s.st.tr.trustAll()
		}
	}
	if err := s.st.sendStatus(s.now(), s.st.tr.safeLSN(s.now())); err != nil {
		return fmt.Errorf("stop: %w", err)
	}
	if _, err := pglogrepl.SendStandbyCopyDone(ctx, s.repl); err != nil {
		s.log.Debug("end replication", "err", err)
	}
	s.log.Info("capture stopped", "confirmed_lsn", s.st.flushed.String())
	return nil
}

// Stop ends the service softly and waits for it; when ctx ends first, the
// stop turns hard and Stop returns an error wrapping ctx's. Safe to call
// more than once, and before or after Start.
func (s *Service) Stop(ctx context.Context) error { return s.ss.Stop(ctx) }

// Wait blocks until the stream loop ends and returns its error (nil after a
// stop).
func (s *Service) Wait() error { return s.ss.Wait() }

// closeAll closes the replication connection first, so the slot is free
// for a standby as soon as possible, and the endpoints last.
func (s *Service) closeAll() {
	if s.repl != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_ = s.repl.Close(ctx)
		cancel()
	}
	if s.nc != nil {
		s.nc.Close()
	}
	if s.embedDone != nil {
		_ = s.awaitEmbedded() // a start that failed before setup waited for it
	}
	if s.embed != nil {
		s.embed.Shutdown()
		s.embed = nil
	}
	if s.lease != nil {
		s.lease.close()
	}
	if s.pool != nil {
		s.pool.Close()
	}
	if s.obsrv != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_ = s.obsrv.Stop(ctx) // past the bound, requests in flight are cut off
		cancel()
	}
}

// publishGap publishes a gap event to every partition and waits for the
// acknowledgements, before any row of the new slot is published.
func (st *streamer) publishGap(ctx context.Context, g gapInfo) error {
	// A new slot: what the stream holds after the resume point was
	// published from the old one and is never replayed.
	st.adopt = nil
	n := 0
	for p := 0; p < st.parts; p++ {
		pos := position{lsn: endTrigger(g.to), n: n}
		n++
		e := &event.Event{Op: event.OpGap, Source: st.src, Partition: p, FromLSN: g.from, ToLSN: g.to, Reason: g.reason, Time: st.now().UTC(), LSN: g.to}
		body, err := event.Encode(e)
		if err != nil {
			return fmt.Errorf("encode gap: %w", err)
		}
		if err := st.publish(ctx, outMsg{subject: event.GapSubject(st.src, p), part: p, msgID: st.tag(event.GapMsgID(st.src, g.from, g.to, p)),
			pos: pos.String(), body: body, what: "gap", kind: kindSigned}); err != nil {
			return err
		}
		st.s.m.published.WithLabelValues("", "", string(event.OpGap)).Inc()
	}
	st.resuming, st.resume = true, position{lsn: endTrigger(g.to), n: n - 1}
	return st.tr.drain(ctx, st.now)
}

// heartbeats emits a heartbeat every HeartbeatInterval and, after a
// transaction with rows, one more once the source has been quiet for
// HeartbeatQuiet, so that a partition the last transactions of a burst
// did not reach has its watermark moved past them at once, not at the
// next interval. The stream loop only stores each such transaction's
// commit LSN (rowCommit); this goroutine polls it every half
// HeartbeatQuiet, so the heartbeat follows the last commit after one to
// one and a half HeartbeatQuiet. An idle source gets none: a heartbeat is
// no transaction with rows.
func (s *Service) heartbeats(ctx context.Context) {
	defer s.bgWG.Done()
	if s.cfg.HeartbeatInterval < 0 {
		return
	}
	t := time.NewTicker(s.cfg.HeartbeatInterval)
	defer t.Stop()
	var poll <-chan time.Time
	if s.cfg.HeartbeatQuiet > 0 {
		p := time.NewTicker(s.cfg.HeartbeatQuiet / 2)
		defer p.Stop()
		poll = p.C
	}
	var hb heartbeater
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			s.emitHeartbeat(ctx, &hb, false)
		case <-poll:
			if hb.quiet(s.rowCommit.Load()) {
				s.emitHeartbeat(ctx, &hb, true)
			}
		}
	}
}

// heartbeater is the heartbeats goroutine's state.
type heartbeater struct {
	seen    uint64 // rowCommit at the last poll
	still   int    // polls in a row that found rowCommit unchanged
	covered uint64 // rowCommit when the last heartbeat was emitted (or tried)
	warned  bool   // a failed emit was logged; cleared by the next success
}

// quiet reports, at a poll that read rowCommit c, whether a quiet
// heartbeat is due: no transaction with rows for two polls (one
// HeartbeatQuiet), and none since the last heartbeat, which covers every
// transaction the loop handled before it was emitted (its WAL record comes
// after their commits).
func (h *heartbeater) quiet(c uint64) bool {
	if c != h.seen {
		h.seen, h.still = c, 0
		return false
	}
	h.still++
	return h.still >= 2 && c != h.covered
}

// sqlQuietHeartbeat emits a heartbeat unless the source is in recovery: a
// read-only standby cannot write WAL, and the quiet heartbeat is not
// worth an error there (the interval's heartbeat reports it).
const sqlQuietHeartbeat = `SELECT pg_logical_emit_message(false, $1, '') WHERE NOT pg_is_in_recovery()`

// emitHeartbeat writes a heartbeat message into the source's WAL; the
// stream loop publishes it as a signed heartbeat mark on every partition
// (handleMessage). A failed emit is tried again at the next interval or,
// for a quiet heartbeat, after the next transaction with rows.
func (s *Service) emitHeartbeat(ctx context.Context, h *heartbeater, quiet bool) {
	h.covered = s.rowCommit.Load()
	sql := `SELECT pg_logical_emit_message(false, $1, '')`
	if quiet {
		sql = sqlQuietHeartbeat
	}
	_, err := s.pool.Exec(ctx, sql, event.PrefixHeartbeat)
	if err != nil && ctx.Err() == nil && !h.warned {
		if _, ok := outage(err); !ok { // else the outage's own line says it
			s.log.Warn("emit heartbeat", "err", err)
		}
		h.warned = true
	} else if err == nil {
		h.warned = false
	}
}

func (s *Service) heartbeatSeen(t time.Time) { s.lastHB.Store(s.now().UnixNano()) }

func (s *Service) heartbeatAge() float64 {
	n := s.lastHB.Load()
	if n == 0 {
		return -1
	}
	return s.now().Sub(time.Unix(0, n)).Seconds()
}

func (s *Service) setLag(d time.Duration) {
	if d < 0 {
		d = 0
	}
	s.m.lagSeconds.Set(d.Seconds())
	s.mu.Lock()
	s.lagSeconds = d.Seconds()
	s.mu.Unlock()
}

func (s *Service) setConfirmed(l event.LSN) {
	s.mu.Lock()
	if l > s.confirmed {
		s.confirmed = l
	}
	s.mu.Unlock()
	s.m.confirmedLSN.Set(float64(l))
}

// RedactURL hides the password of a connection URL or string; see
// redact.URL.
func RedactURL(s string) string { return redact.URL(s) }

// redactErr strips anything that looks like a password from an error text.
func redactErr(err error) string { return redact.Text(err.Error()) }

// syncTree fsyncs every file and directory under dir.
func syncTree(dir string) error {
	return filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() && !d.Type().IsRegular() {
			return nil
		}
		f, err := os.Open(path)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := f.Sync(); err != nil {
			return fmt.Errorf("fsync %s: %w", path, err)
		}
		return nil
	})
}
