package testenv

import (
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/epitaph-dev/epitaph/internal/broker"
)

// NATS is a real in-process JetStream server for one test, stopped when the
// test ends. It keeps its port and store across Restart.
type NATS struct {
	tb     testing.TB
	cfg    broker.Config
	srv    *broker.Server
	URL    string
	Listen string
	// Opts are added to Connect's options (credentials for a server that
	// requires them, such as a capture's embedded broker).
	Opts []nats.Option
}

// NewNATS starts a JetStream server with file storage in a temp dir on a
// free loopback port.
func NewNATS(tb testing.TB) *NATS {
	tb.Helper()
	return NewNATSWith(tb, broker.Config{})
}

// NewNATSWith starts a server with cfg; StoreDir and Listen default to a
// temp dir and a free loopback port.
func NewNATSWith(tb testing.TB, cfg broker.Config) *NATS {
	tb.Helper()
	if cfg.StoreDir == "" {
		cfg.StoreDir = tb.TempDir()
	}
	if cfg.Listen == "" {
		port, err := FreePort()
		if err != nil {
			tb.Fatalf("testenv: free port: %v", err)
		}
		cfg.Listen = fmt.Sprintf("127.0.0.1:%d", port)
	}
	n := &NATS{tb: tb, cfg: cfg, Listen: cfg.Listen, URL: "nats://" + cfg.Listen}
	n.Start()
	tb.Cleanup(n.Stop)
	return n
}

// Start starts the server if it is stopped.
func (n *NATS) Start() {
	n.tb.Helper()
	if n.srv != nil {
		return
	}
	var err error
	for i := 0; i < 50; i++ { // the port may linger briefly after a stop
		n.srv, err = broker.Start(n.cfg)
		if err == nil {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	n.tb.Fatalf("testenv: start jetstream: %v", err)
}

// Stop shuts the server down (abruptly for clients: connections drop).
func (n *NATS) Stop() {
	if n.srv != nil {
		n.srv.Shutdown()
		n.srv = nil
	}
}

// Restart stops and starts the server with the same port and store.
func (n *NATS) Restart() {
	n.tb.Helper()
	n.Stop()
	n.Start()
}

// StoreDir is the server's JetStream storage directory.
func (n *NATS) StoreDir() string { return n.cfg.StoreDir }

// Connect returns a client connection and JetStream context, closed when the
// test ends.
func (n *NATS) Connect(tb testing.TB) (*nats.Conn, jetstream.JetStream) {
	tb.Helper()
	nc, err := nats.Connect(n.URL, append([]nats.Option{nats.MaxReconnects(-1), nats.ReconnectWait(100 * time.Millisecond)}, n.Opts...)...)
	if err != nil {
		tb.Fatalf("testenv: connect nats: %v", err)
	}
	tb.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		tb.Fatalf("testenv: jetstream: %v", err)
	}
	return nc, js
}
