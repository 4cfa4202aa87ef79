// Package broker runs an embedded JetStream server: the real nats-server,
// in-process, with file storage. It is the single-machine default of both
// the capture and the tests.
package broker

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"sync"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// Config of an embedded server.
type Config struct {
	// StoreDir holds JetStream's file storage. Required.
	StoreDir string
	// Listen is host:port; default 127.0.0.1:4222. Port 0 picks a free one.
	Listen string
	// SyncInterval is how often the file store fsyncs. JetStream
	// acknowledges a publish before the fsync, so a power loss can drop up
	// to this much acknowledged data; the capture trails its confirmed LSN
	// by it. Zero keeps the server default (2 minutes).
	SyncInterval time.Duration
	// SyncAlways fsyncs every write (slowest, no acknowledged loss).
	SyncAlways bool
	// MaxPayload in bytes; zero keeps the server default (1 MiB).
	MaxPayload int32
	// ServerName; default "epitaph".
	ServerName string
	// Auth, when set, makes the server require credentials: the capture's
	// and the projector's roles (see Auth). Nil accepts any client (a test
	// stand-in for an external server; the capture always sets it).
	// With Auth, the running server reads Auth.Dir's revoked users every
	// two seconds and refuses the users revoked since its start
	// (RevokeTargetCreds), closing their connections.
	Auth *Auth
	// Logger receives what the running server reports: revocations
	// applied, a revoked users file it cannot read. Nil: slog.Default().
	Logger *slog.Logger
}

// Server is a running embedded JetStream server.
type Server struct {
	ns  *server.Server
	cfg Config
	// stop ends the revocations' watch; watched is closed when it ended
	// (nil without Auth).
	stop     chan struct{}
	stopOnce sync.Once
	watched  chan struct{}
}

// DefaultListen is where an embedded server listens unless told otherwise,
// so a projector on the same machine connects with no configuration.
const DefaultListen = "127.0.0.1:4222"

// Start starts the server and waits until it accepts connections.
func Start(cfg Config) (*Server, error) {
	if cfg.StoreDir == "" {
		return nil, errors.New("embedded jetstream: a store directory is required (--data-dir)")
	}
	if cfg.Listen == "" {
		cfg.Listen = DefaultListen
	}
	host, portStr, err := net.SplitHostPort(cfg.Listen)
	if err != nil {
		return nil, fmt.Errorf("embedded jetstream: listen address %q: %w", cfg.Listen, err)
	}
	port, err := strconv.Atoi(portStr)
	if err != nil {
		return nil, fmt.Errorf("embedded jetstream: listen port %q: %w", portStr, err)
	}
	if port == 0 {
		port = server.RANDOM_PORT
	}
	name := cfg.ServerName
	if name == "" {
		name = "epitaph"
	}
	opts := &server.Options{
		ServerName: name,
		Host:       host,
		Port:       port,
		JetStream:  true,
		StoreDir:   cfg.StoreDir,
		NoSigs:     true,
		NoLog:      true,
		MaxPayload: cfg.MaxPayload,
		SyncAlways: cfg.SyncAlways,
	}
	if cfg.SyncInterval > 0 {
		opts.SyncInterval = cfg.SyncInterval
	}
	var live *liveAuth
	if cfg.Auth != nil {
		if live, err = ensureAuth(*cfg.Auth, opts); err != nil {
			return nil, err
		}
		if err := migrateGlobalAccount(cfg.StoreDir, live.accPub); err != nil {
			return nil, err
		}
	}
	ns, err := server.NewServer(opts)
	if err != nil {
		return nil, fmt.Errorf("embedded jetstream: %w", err)
	}
	go ns.Start()
	if !ns.ReadyForConnections(15 * time.Second) {
		ns.Shutdown()
		return nil, fmt.Errorf("embedded jetstream: not ready on %s after 15s (is the port in use?)", cfg.Listen)
	}
	if !ns.JetStreamEnabled() {
		ns.Shutdown()
		return nil, errors.New("embedded jetstream: JetStream did not start (check the store directory)")
	}
	srv := &Server{ns: ns, cfg: cfg, stop: make(chan struct{})}
	if live != nil {
		log := cfg.Logger
		if log == nil {
			log = slog.Default()
		}
		srv.watched = make(chan struct{})
		go func() {
			defer close(srv.watched)
			live.watch(ns, log, srv.stop)
		}()
	}
	return srv, nil
}

// CaptureCreds and ProjectorCreds are the paths of the roles' credentials
// files (empty without Config.Auth).
func (s *Server) CaptureCreds() string {
	if s.cfg.Auth == nil {
		return ""
	}
	return CaptureCreds(s.cfg.Auth.Dir)
}

func (s *Server) ProjectorCreds() string {
	if s.cfg.Auth == nil {
		return ""
	}
	return ProjectorCreds(s.cfg.Auth.Dir)
}

// EraseCreds is the path of the erase role's credentials file (empty
// without Config.Auth).
func (s *Server) EraseCreds() string {
	if s.cfg.Auth == nil {
		return ""
	}
	return EraseCreds(s.cfg.Auth.Dir)
}

// ClientURL is the nats:// URL clients connect to.
func (s *Server) ClientURL() string { return s.ns.ClientURL() }

// Addr is the host:port the server listens on.
func (s *Server) Addr() string {
	if a, ok := s.ns.Addr().(*net.TCPAddr); ok {
		return a.String()
	}
	return s.cfg.Listen
}

// SyncInterval is the effective fsync interval of the file store.
func (s *Server) SyncInterval() time.Duration {
	if s.cfg.SyncAlways {
		return 0
	}
	if s.cfg.SyncInterval > 0 {
		return s.cfg.SyncInterval
	}
	return 2 * time.Minute
}

// Shutdown stops the server and waits for it.
func (s *Server) Shutdown() {
	s.stopOnce.Do(func() { close(s.stop) })
	if s.watched != nil {
		<-s.watched
	}
	s.ns.Shutdown()
	s.ns.WaitForShutdown()
}

// InProcessConn is a connection to the server without a socket (for
// nats.InProcessServer).
func (s *Server) InProcessConn() (net.Conn, error) { return s.ns.InProcessConn() }
