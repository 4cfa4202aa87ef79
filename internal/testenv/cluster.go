package testenv

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go/jetstream"
)

// ClusterConfig says how StartCluster makes its nodes.
type ClusterConfig struct {
	// Nodes is the number of nodes, named nats-1 .. nats-N; default 3.
	Nodes int
	// ConfigFile is a nats-server configuration loaded once per node with
	// SERVER_NAME set to the node's name (deploy/nats/nats.conf, so the
	// tests run the cluster that deploy/compose.yaml runs). Its client and
	// cluster ports move to free loopback ports, each route to the cluster
	// port of the node its host names (nats-1 ..), its store to a
	// directory of the node's own, monitoring off. Empty: a plain
	// configuration (cluster "epitaph", JetStream with file storage, full
	// routes, no authentication).
	ConfigFile string
	// Env are the variables the configuration reads besides SERVER_NAME
	// (the roles' passwords of deploy/nats/nats.conf).
	Env map[string]string
	// MaxStore bounds each node's file store; default 1 GiB.
	MaxStore int64
}

// Cluster is a JetStream cluster of in-process nats-server nodes with
// routes between them, each with file storage in its own directory. Nodes
// can be stopped and started again (same ports, same store) while the
// others run; all are stopped when the test ends.
type Cluster struct {
	tb    testing.TB
	Nodes []*ClusterNode
	// URL lists every node's client URL, comma-separated (the form
	// EPITAPH_NATS_URL takes).
	URL string
}

// ClusterNode is one node of a Cluster.
type ClusterNode struct {
	Name string
	URL  string
	tb   testing.TB
	opts *server.Options
	mu   sync.Mutex
	srv  *server.Server
}

// envMu serializes the environment changes that parsing a configuration
// file with variables needs.
var envMu sync.Mutex

// StartCluster starts the nodes and waits until each accepts clients
// (JetStream's meta leader may be elected a little later: retry the first
// stream creation).
func StartCluster(tb testing.TB, cfg ClusterConfig) *Cluster {
	tb.Helper()
	if cfg.Nodes == 0 {
		cfg.Nodes = 3
	}
	if cfg.MaxStore == 0 {
		cfg.MaxStore = 1 << 30
	}
	names := make([]string, cfg.Nodes)
	clusterPorts := map[string]int{}
	for i := range names {
		names[i] = fmt.Sprintf("nats-%d", i+1)
		clusterPorts[names[i]] = mustFreePort(tb)
	}
	c := &Cluster{tb: tb}
	var urls []string
	for _, name := range names {
		opts, err := nodeOptions(cfg, name, clusterPorts)
		if err != nil {
			tb.Fatalf("testenv: cluster node %s: %v", name, err)
		}
		opts.Host, opts.Port = "127.0.0.1", mustFreePort(tb)
		opts.HTTPPort = 0
		opts.Cluster.Host, opts.Cluster.Port = "127.0.0.1", clusterPorts[name]
		opts.StoreDir = tb.TempDir()
		opts.JetStreamMaxStore = cfg.MaxStore
		opts.NoLog, opts.NoSigs = true, true
		n := &ClusterNode{Name: name, URL: fmt.Sprintf("nats://127.0.0.1:%d", opts.Port), tb: tb, opts: opts}
		c.Nodes = append(c.Nodes, n)
		urls = append(urls, n.URL)
	}
	c.URL = strings.Join(urls, ",")
	for _, n := range c.Nodes {
		n.Start()
		tb.Cleanup(n.Stop)
	}
	return c
}

func mustFreePort(tb testing.TB) int {
	tb.Helper()
	p, err := FreePort()
	if err != nil {
		tb.Fatalf("testenv: free port: %v", err)
	}
	return p
}

// nodeOptions are a node's options from the configuration file (or the
// plain configuration), routes moved to the nodes' loopback ports.
func nodeOptions(cfg ClusterConfig, name string, clusterPorts map[string]int) (*server.Options, error) {
	if cfg.ConfigFile == "" {
		opts := &server.Options{ServerName: name, JetStream: true}
		opts.Cluster.Name = "epitaph"
		for n := range clusterPorts {
			opts.Routes = append(opts.Routes, &url.URL{Scheme: "nats", Host: n + ":6222"})
		}
		return opts, moveRoutes(opts, clusterPorts)
	}
	opts, err := parseWithEnv(cfg.ConfigFile, name, cfg.Env)
	if err != nil {
		return nil, err
	}
	if opts.ServerName != name {
		return nil, fmt.Errorf("server_name is %q, want %q (from SERVER_NAME)", opts.ServerName, name)
	}
	if !opts.JetStream || opts.Cluster.Name == "" {
		return nil, fmt.Errorf("%s: want JetStream and a named cluster", cfg.ConfigFile)
	}
	return opts, moveRoutes(opts, clusterPorts)
}

func parseWithEnv(file, name string, env map[string]string) (*server.Options, error) {
	envMu.Lock()
	defer envMu.Unlock()
	vars := map[string]string{"SERVER_NAME": name}
	for k, v := range env {
		vars[k] = v
	}
	type saved struct {
		value string
		had   bool
	}
	olds := map[string]saved{}
	defer func() {
		for k, o := range olds {
			if o.had {
				_ = os.Setenv(k, o.value)
			} else {
				_ = os.Unsetenv(k)
			}
		}
	}()
	for k, v := range vars {
		old, had := os.LookupEnv(k)
		olds[k] = saved{old, had}
		if err := os.Setenv(k, v); err != nil {
			return nil, err
		}
	}
	opts, err := server.ProcessConfigFile(file)
	if err != nil {
		return nil, fmt.Errorf("load %s: %w", file, err)
	}
	return opts, nil
}

func moveRoutes(opts *server.Options, clusterPorts map[string]int) error {
	for i, r := range opts.Routes {
		port, ok := clusterPorts[r.Hostname()]
		if !ok {
			return fmt.Errorf("route %s names no node of the cluster", r)
		}
		opts.Routes[i] = &url.URL{Scheme: r.Scheme, Host: fmt.Sprintf("127.0.0.1:%d", port)}
	}
	return nil
}

// Start starts the node if it is stopped, with its port and store.
//
// A node restarts on the ports it had, so another process may hold one of
// them (a test binary of an earlier, killed run): nats-server then never
// becomes ready and says why only to a logger the test does not have. Start
// therefore binds both ports itself first, retrying for a few seconds
// while a port lingers after a stop, and fails with the bind error; then it
// waits once for the server to accept connections.
func (n *ClusterNode) Start() {
	n.tb.Helper()
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.srv != nil {
		return
	}
	client := net.JoinHostPort(n.opts.Host, strconv.Itoa(n.opts.Port))
	route := net.JoinHostPort(n.opts.Cluster.Host, strconv.Itoa(n.opts.Cluster.Port))
	if err := waitPortsFree(10*time.Second, client, route); err != nil {
		n.tb.Fatalf("testenv: start cluster node %s: %v", n.Name, err)
	}
	s, err := server.NewServer(n.opts.Clone())
	if err != nil {
		n.tb.Fatalf("testenv: start cluster node %s: %v", n.Name, err)
	}
	go s.Start()
	if !s.ReadyForConnections(60 * time.Second) {
		s.Shutdown()
		n.tb.Fatalf("testenv: start cluster node %s: not ready for connections on %s within 60s", n.Name, client)
	}
	n.srv = s
}

// waitPortsFree binds each address (and lets it go) until all bind at
// once or the timeout passes, and then returns the last bind error.
func waitPortsFree(timeout time.Duration, addrs ...string) error {
	deadline := time.Now().Add(timeout)
	for {
		err := bindAll(addrs)
		if err == nil || time.Now().After(deadline) {
			return err
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func bindAll(addrs []string) error {
	for _, addr := range addrs {
		l, err := net.Listen("tcp", addr)
		if err != nil {
			return fmt.Errorf("port %s is held (by another process?): %w", addr, err)
		}
		if err := l.Close(); err != nil {
			return fmt.Errorf("release %s: %w", addr, err)
		}
	}
	return nil
}

// Stop shuts the node down: its clients' connections drop, the other
// nodes elect new leaders for what it led.
func (n *ClusterNode) Stop() {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.srv != nil {
		n.srv.Shutdown()
		n.srv.WaitForShutdown()
		n.srv = nil
	}
}

// Running reports whether the node is started.
func (n *ClusterNode) Running() bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.srv != nil
}

// Node is the node named name, nil if there is none.
func (c *Cluster) Node(name string) *ClusterNode {
	for _, n := range c.Nodes {
		if n.Name == name {
			return n
		}
	}
	return nil
}

// StreamCluster is the leader and the replicas of a stream as the
// cluster reports them now ("" when it has no leader).
func StreamCluster(ctx context.Context, js jetstream.JetStream, stream string) (leader string, replicas []*jetstream.PeerInfo, err error) {
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return "", nil, err
	}
	info, err := s.Info(ctx)
	if err != nil {
		return "", nil, err
	}
	if info.Cluster == nil {
		return "", nil, fmt.Errorf("stream %s: no cluster information", stream)
	}
	return info.Cluster.Leader, info.Cluster.Replicas, nil
}

// Healthy is the node's /healthz: nil once its JetStream is current, its
// meta state, streams and consumers caught up (what a restarted node needs
// before it can stand in for another).
func (n *ClusterNode) Healthy() error {
	n.mu.Lock()
	s := n.srv
	n.mu.Unlock()
	if s == nil {
		return fmt.Errorf("node %s is stopped", n.Name)
	}
	if st := s.Healthz(&server.HealthzOptions{}); st.Status != "ok" {
		return fmt.Errorf("node %s: %s %s", n.Name, st.Status, st.Error)
	}
	return nil
}

// WaitHealthy waits until every running node is Healthy.
func (c *Cluster) WaitHealthy(ctx context.Context, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		var err error
		for _, n := range c.Nodes {
			if n.Running() {
				if err = n.Healthy(); err != nil {
					break
				}
			}
		}
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("cluster not healthy after %s: %w", timeout, err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}
