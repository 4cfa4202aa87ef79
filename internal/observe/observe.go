// Package observe serves a process's operational endpoints: /metrics
// (Prometheus, from an explicit registry), /livez (the process runs its
// loops: a liveness probe), /readyz (its dependencies are reachable and it
// serves: a readiness probe), /healthz (kept for compatibility: the same
// check as /readyz unless Healthy says otherwise) and /status (JSON).
//
// Liveness is kept apart from readiness so that a dependency's outage makes
// pods unready (out of the load balancer) without getting them killed and
// restarted, which would not make the dependency come back any sooner.
package observe

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/epitaph-dev/epitaph/internal/startstop"
)

// Config of the endpoint server.
type Config struct {
	// Addr is host:port to listen on; empty disables the server.
	Addr string
	// Registry holds the process's metrics.
	Registry *prometheus.Registry
	// Status returns the JSON-encodable status document.
	Status func(ctx context.Context) (any, error)
	// Healthy returns nil when the process is healthy (/healthz; the
	// readiness check when Ready is nil).
	Healthy func(ctx context.Context) error
	// Live returns nil while the process runs its loops, also while it
	// retries an unreachable dependency (/livez; nil: always live).
	Live func(ctx context.Context) error
	// Ready returns nil when the dependencies are reachable and the process
	// does its work (/readyz; nil: Healthy).
	Ready  func(ctx context.Context) error
	Logger *slog.Logger
}

// Server serves the endpoints until stopped. It is a service
// (internal/startstop): Stop lets requests in flight finish, cancelling
// Start's ctx closes the connections at once.
type Server struct {
	cfg  Config
	mux  *http.ServeMux
	srv  *http.Server
	addr string
	ss   startstop.Base
}

// New builds a server; Handle adds more routes before Start.
func New(cfg Config) *Server {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	s := &Server{cfg: cfg, mux: http.NewServeMux()}
	if cfg.Registry != nil {
		s.mux.Handle("GET /metrics", promhttp.HandlerFor(cfg.Registry, promhttp.HandlerOpts{Registry: cfg.Registry}))
	}
	s.mux.HandleFunc("GET /healthz", probe(cfg.Healthy))
	s.mux.HandleFunc("GET /livez", probe(cfg.Live))
	ready := cfg.Ready
	if ready == nil {
		ready = cfg.Healthy
	}
	s.mux.HandleFunc("GET /readyz", probe(ready))
	s.mux.HandleFunc("GET /status", s.status)
	return s
}

// Handle registers an extra route (for example a human status page).
func (s *Server) Handle(pattern string, h http.Handler) { s.mux.Handle(pattern, h) }

// Start listens and serves in the background. It returns once listening.
// With an empty Config.Addr it serves nothing and returns nil.
func (s *Server) Start(ctx context.Context) error {
	soft, hard, ok := s.ss.StartInit(ctx)
	if !ok {
		return errors.New("endpoint server already started")
	}
	if s.cfg.Addr == "" {
		s.ss.Finish(nil)
		return nil
	}
	l, err := net.Listen("tcp", s.cfg.Addr)
	if err != nil {
		err = fmt.Errorf("listen for metrics on %s: %w", s.cfg.Addr, err)
		s.ss.Finish(err)
		return err
	}
	s.addr = l.Addr().String()
	s.srv = &http.Server{Handler: s.mux, ReadHeaderTimeout: 10 * time.Second}
	served := make(chan error, 1)
	go func() {
		err := s.srv.Serve(l)
		if errors.Is(err, http.ErrServerClosed) {
			err = nil
		} else {
			s.cfg.Logger.Error("metrics server stopped", "err", err)
		}
		served <- err
	}()
	go func() {
		var err error
		select {
		case err = <-served:
		case <-soft.Done():
			// Requests in flight finish, unless the stop turns hard.
			if err := s.srv.Shutdown(hard); err != nil {
				_ = s.srv.Close()
			}
			err = <-served
		}
		s.ss.Finish(err)
	}()
	return nil
}

// Addr is the address actually listened on (useful with port 0).
func (s *Server) Addr() string { return s.addr }

// Stop shuts the server down: requests in flight finish; when ctx ends
// first, their connections are closed. Safe before Start.
func (s *Server) Stop(ctx context.Context) error { return s.ss.Stop(ctx) }

// Wait blocks until the server has stopped and returns why it stopped
// serving on its own (nil after a stop).
func (s *Server) Wait() error { return s.ss.Wait() }

// probe answers 200 "ok" when check passes (or is nil), 503 with the
// reason otherwise. A probe never waits longer than 5 s for its check.
func probe(check func(ctx context.Context) error) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if check != nil {
			ctx, cancel := context.WithTimeout(r.Context(), 5*time.Second)
			defer cancel()
			if err := check(ctx); err != nil {
				http.Error(w, "unhealthy: "+err.Error(), http.StatusServiceUnavailable)
				return
			}
		}
		_, _ = w.Write([]byte("ok\n"))
	}
}

func (s *Server) status(w http.ResponseWriter, r *http.Request) {
	if s.cfg.Status == nil {
		http.Error(w, "no status", http.StatusNotFound)
		return
	}
	doc, err := s.cfg.Status(r.Context())
	if err != nil {
		http.Error(w, "status: "+err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(doc)
}
