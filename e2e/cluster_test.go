package e2e_test

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/bench"
	"github.com/epitaph-dev/epitaph/internal/natsconn"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/internal/workload"
)

// natsCluster is a three-node cluster loaded from deploy/nats/nats.conf
// (the configuration deploy/compose.yaml runs) with the roles' passwords
// in files, as compose gives them.
type natsCluster struct {
	*testenv.Cluster
	passwords map[string]string // role -> password file
}

func startNATSCluster(t *testing.T) *natsCluster {
	t.Helper()
	dir := t.TempDir()
	c := &natsCluster{passwords: map[string]string{}}
	env := map[string]string{}
	for _, role := range []string{"capture", "projector", "erase"} {
		pw := fmt.Sprintf("%s-%d", role, rand.Uint64())
		env["EPITAPH_NATS_"+strings.ToUpper(role)+"_PASSWORD"] = pw
		f := filepath.Join(dir, role)
		require.NoError(t, os.WriteFile(f, []byte(pw+"\n"), 0o600))
		c.passwords[role] = f
	}
	c.Cluster = testenv.StartCluster(t, testenv.ClusterConfig{ConfigFile: "../deploy/nats/nats.conf", Env: env, MaxStore: 2 << 30})
	return c
}

// health says how each node is.
func (c *natsCluster) health() string {
	var out []string
	for _, n := range c.Nodes {
		if err := n.Healthy(); err != nil {
			out = append(out, err.Error())
		} else {
			out = append(out, n.Name+" ok")
		}
	}
	return strings.Join(out, "; ")
}

// env is the environment a binary authenticates with as role.
func (c *natsCluster) env(role string) []string {
	return []string{"EPITAPH_NATS_USER=" + role, "EPITAPH_NATS_PASSWORD_FILE=" + c.passwords[role]}
}

// connect is a client of the cluster as role (reconnecting across nodes).
func (c *natsCluster) connect(t *testing.T, role string) []natsgo.Option {
	t.Helper()
	opts, err := natsconn.Auth{User: role, PasswordFile: c.passwords[role]}.Options(c.URL)
	require.NoError(t, err)
	return append(opts, natsgo.MaxReconnects(-1), natsgo.ReconnectWait(100*time.Millisecond))
}

// waitStreamHealthy waits until the stream has a leader and every replica
// but the node down (stopped on purpose; "" for none) is online and was heard from within 2s; it returns the leader and the
// followers.
func waitStreamHealthy(ctx context.Context, t *testing.T, js jetstream.JetStream, stream string, n int, down string) (string, []string) {
	t.Helper()
	leader, followers, last, err := streamHealthy(ctx, js, stream, n, down)
	require.NoError(t, err, "stream %s with a leader and %d live replicas; last seen: %s", stream, n-1, last)
	return leader, followers
}

// streamHealthy is waitStreamHealthy's wait, returning its error and what
// it saw last instead of failing the test.
func streamHealthy(ctx context.Context, js jetstream.JetStream, stream string, n int, down string) (string, []string, string, error) {
	var leader string
	var followers []string
	var last string
	err := workload.WaitFor(ctx, 90*time.Second, 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		l, rs, err := testenv.StreamCluster(cctx, js, stream)
		last = fmt.Sprintf("leader %q err %v", l, err)
		for _, r := range rs {
			last += fmt.Sprintf("; %s current=%v offline=%v active=%s lag=%d", r.Name, r.Current, r.Offline, r.Active, r.Lag)
		}
		if err != nil || l == "" || len(rs) != n-1 {
			return false, nil
		}
		followers = followers[:0]
		for _, r := range rs {
			if r.Name == down {
				continue // stopped on purpose
			}
			// Under a steady write load a follower is rarely exactly
			// current: online, heard from recently and close behind is
			// what the next fault needs (an electable quorum of two).
			if r.Offline || r.Active > 2*time.Second || (!r.Current && r.Lag > 1000) {
				return false, nil
			}
			followers = append(followers, r.Name)
		}
		leader = l
		return true, nil
	})
	return leader, followers, last, err
}

// restarts: EPITAPH_E2E_CLUSTER_RESTARTS=1 stops the stream's leader and
// followers in turn, five times, each node started again before the next.
// Off by default: a known, open nats-server defect (deploy/README, "The
// JetStream cluster"; internal/testenv TestNATSDefectPlainChainAfterLeaderRestart):
// a node stopped under the capture's load and started again can keep
// "stream write error: last msgid mismatch" for good (its replica is never
// current again), and the next loss of a node leaves the stream without a
// leader. By default the test stops the leader once and leaves it down.
func restarts() bool { return os.Getenv("EPITAPH_E2E_CLUSTER_RESTARTS") == "1" }

// clusterFaults is the order of the nodes stopped.
func clusterFaults() []string {
	if restarts() {
		return []string{"leader", "follower", "leader", "follower", "leader"}
	}
	return []string{"leader"}
}

// TestClusterLosesNodesUnderLoad runs the capture (--replicas 3,
// --broker-sync-interval=-1) and two projector processes against a real
// three-node JetStream cluster (routes, file storage in separate
// directories; deploy/nats/nats.conf) while a cascading-delete workload
// runs, and shuts down the stream's leader, which stays down: the stream
// goes on with a new leader on the two other nodes (see restarts for nodes
// stopped and started again, several times). At the end the stream and object
// store are on three replicas and the archive holds exactly the deleted
// rows, none missing, none twice, every value equal.
//
// nats-server sometimes wedges the stream when its leader is stopped: the
// surviving replicas refuse to apply ("last msgid mismatch") and elect no
// leader (deploy/README.md, "Known open defect"; about one run in ten on
// 2.15.2, none of six on 2.15.3). That run proves nothing about Epitaph either way, so it is
// dropped (its subtest skipped, naming the defect) and the whole run is
// repeated on a fresh cluster and database; the test fails if every one of
// three attempts wedges, and fails as before on anything else.
func TestClusterLosesNodesUnderLoad(t *testing.T) {
	t.Parallel()
	bins := binaries(t)
	seed := testSeed(t)
	const attempts = 3
	for attempt := 1; attempt <= attempts; attempt++ {
		wedged := false
		t.Run(fmt.Sprintf("attempt-%d", attempt), func(t *testing.T) {
			clusterLosesNodesUnderLoad(t, bins, seed+uint64(attempt-1), &wedged)
		})
		if !wedged || t.Failed() {
			return
		}
		t.Logf("attempt %d: the stream wedged on the nats-server defect; again on a fresh cluster", attempt)
	}
	t.Fatalf("the JetStream cluster wedged on the nats-server defect in all %d attempts", attempts)
}

func clusterLosesNodesUnderLoad(t *testing.T, bins map[string]string, seed uint64, wedged *bool) {
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 7))

	url := testenv.NewDatabase(t)
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	require.NoError(t, workload.Setup(ctx, url))
	_, err := workload.Seed(ctx, url, workload.SeedConfig{Customers: 400, OrdersPerCustomer: 10})
	require.NoError(t, err)

	cluster := startNATSCluster(t)
	nc, err := natsgo.Connect(cluster.URL, cluster.connect(t, "capture")...)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	// JetStream's meta leader is elected once the routes are up.
	require.NoError(t, workload.WaitFor(ctx, time.Minute, 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		_, err := js.AccountInfo(cctx)
		return err == nil, nil
	}), "the cluster elects its meta leader")

	metrics, err := bench.LocalAddr()
	require.NoError(t, err)
	cenv := joinEnv(bench.CaptureEnv(url, cluster.URL, "", t.TempDir(), metrics, "main", "epitaph_e2e_cluster"),
		"EPITAPH_HEARTBEAT_INTERVAL=1s", "EPITAPH_REPLICAS=3", "EPITAPH_BROKER_SYNC_INTERVAL=-1s")
	capture := supervise(t, "capture", bins["capture"], joinEnv(cenv, cluster.env("capture")...), seed)
	watch, err := bench.WatchStream(cluster.URL, "main", cluster.connect(t, "projector")...)
	require.NoError(t, err)
	defer watch.Close()
	require.NoError(t, bench.WaitCaptureReady(ctx, watch, url, "epitaph_e2e_cluster", captureReadyTimeout, nil))

	workers := superviseProjectors(t, bins["projector"], url, cluster.URL, 2, seed, cluster.env("projector")...)

	type outcome struct {
		res workload.Result
		err error
	}
	done := make(chan outcome, 1)
	go func() {
		res, err := workload.Run(ctx, url, workload.Plan{Seed: seed, Transactions: 500, MaxOrdersPerTx: 20, Reinserts: 3,
			Pause: 20 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))})
		done <- outcome{res, err}
	}()

	// Shut a node down, let the cluster run on two, bring it back; the
	// next only once every replica is current again (two nodes down would
	// lose the quorum, which is not a failure the cluster survives).
	stream := event.StreamName("main")
	// The first fault once the capture is publishing the workload's deletes.
	seq0, err := watch.LastSeq(ctx)
	require.NoError(t, err)
	require.NoError(t, watch.WaitProgress(ctx, seq0+3000, 2*time.Minute), "the workload reaches the stream")

	// Holders of the capture's and the projector's passwords (nats.conf's
	// users) try, while the workload runs, what their role may not do (a
	// running projector's consumer is the victim): every attempt is a
	// permissions violation, and the archive checked at the end is exact.
	victim := "archive-v1-p0"
	if err := workload.WaitFor(ctx, time.Minute, 200*time.Millisecond, func(ctx context.Context) (bool, error) {
		pool, err := pgx.Connect(ctx, url)
		if err != nil {
			return false, err
		}
		defer pool.Close(ctx)
		err = pool.QueryRow(ctx, `SELECT consumer FROM epitaph.progress WHERE consumer IS NOT NULL ORDER BY partition LIMIT 1`).Scan(&victim)
		return err == nil, nil
	}); err != nil {
		t.Logf("no consumer recorded yet; the attempts name %s", victim)
	}
	proj := testenv.NewAttacker(t, cluster.URL, cluster.connect(t, "projector")...)
	proj.RequireRefused(t, ctx, proj.ProjectorAttempts("main", victim, seq0))
	capt := testenv.NewAttacker(t, cluster.URL, cluster.connect(t, "capture")...)
	capt.RequireRefused(t, ctx, capt.CaptureAttempts("main", victim, seq0))
	var faults []string
	var seen string
	start := time.Now()
	for i, role := range clusterFaults() {
		last := i == len(clusterFaults())-1
		require.NoError(t, cluster.WaitHealthy(ctx, 2*time.Minute), "before stopping the %s (faults: %s)", role, summary(faults))
		leader, followers := waitStreamHealthy(ctx, t, js, stream, 3, "")
		victim := leader
		if role == "follower" {
			victim = followers[rng.IntN(len(followers))]
		}
		node := cluster.Node(victim)
		require.NotNil(t, node, "node %s", victim)
		node.Stop()
		faults = append(faults, fmt.Sprintf("%s %s@%.1fs", role, victim, time.Since(start).Seconds()))
		t.Logf("stopped the stream's %s %s at %.1fs", role, victim, time.Since(start).Seconds())
		if role == "leader" {
			err := workload.WaitFor(ctx, 90*time.Second, 200*time.Millisecond, func(ctx context.Context) (bool, error) {
				cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
				defer cancel()
				l, _, err := testenv.StreamCluster(cctx, js, stream)
				seen = fmt.Sprintf("leader %q, err %v; nodes: %s", l, err, cluster.health())
				return err == nil && l != "" && l != victim, nil
			})
			if err != nil && strings.Contains(seen, "last msgid mismatch") {
				*wedged = true
				t.Skipf("the stream wedged on the nats-server defect, not Epitaph's doing (deploy/README.md): no leader after %s (faults: %s; last seen: %s)",
					victim, summary(faults), seen)
			}
			require.NoError(t, err, "a new stream leader after %s (faults: %s; last seen: %s)", victim, summary(faults), seen)
		}
		select {
		case <-ctx.Done():
			t.Fatal(ctx.Err())
		case <-time.After(time.Duration(1000+rng.IntN(2000)) * time.Millisecond):
		}
		if last && !restarts() {
			// The last leader stays down: the rest runs on two nodes.
			t.Logf("%s stays down", victim)
			break
		}
		node.Start()
	}
	down := ""
	for _, n := range cluster.Nodes {
		if !n.Running() {
			down = n.Name
		}
	}
	// The defect can also leave the two survivors without a leader after
	// they elected one: the same skip, only with the defect's mark.
	if _, _, last, err := streamHealthy(ctx, js, stream, 3, down); err != nil {
		health := cluster.health()
		if strings.Contains(health, "last msgid mismatch") {
			*wedged = true
			t.Skipf("the stream wedged on the nats-server defect, not Epitaph's doing (deploy/README.md): no healthy stream on the two nodes left (faults: %s; last seen: %s; nodes: %s)",
				summary(faults), last, health)
		}
		require.NoError(t, err, "stream %s with a leader and 2 live replicas (faults: %s; last seen: %s; nodes: %s)", stream, summary(faults), last, health)
	}
	out := <-done
	require.NoError(t, out.err)
	t.Logf("faults: %s", summary(faults))
	t.Logf("workload: %+v", out.res)
	for _, s := range append([]*supervised{capture}, workers...) {
		t.Logf("%s", s.Stats())
	}

	// The stream and the object store were made on three replicas.
	st, err := js.Stream(ctx, stream)
	require.NoError(t, err)
	require.Equal(t, 3, st.CachedInfo().Config.Replicas)
	obs, err := js.Stream(ctx, "OBJ_epitaph_main_rows")
	require.NoError(t, err)
	require.Equal(t, 3, obs.CachedInfo().Config.Replicas)

	expected, err := workload.Expected(ctx, url)
	require.NoError(t, err)
	require.Equal(t, out.res.Deleted, int64(len(expected)))
	ended := time.Now()
	if _, err := watch.WaitDeletes(ctx, int64(len(expected)), 2*time.Minute, nil); err != nil {
		t.Fatalf("%v\n%s", err, pipelineState(ctx, url, watch))
	}
	var archived int64
	err = workload.WaitFor(ctx, 2*time.Minute, 250*time.Millisecond, func(ctx context.Context) (bool, error) {
		n, err := bench.Count(ctx, url, "SELECT count(*) FROM archive.rows WHERE source = 'main'")
		archived = n
		return n >= int64(len(expected)), err
	})
	t.Logf("archive complete %.1fs after the workload and the faults ended", time.Since(ended).Seconds())
	if err != nil {
		t.Fatalf("archive has %d of %d rows: %v\n%s", archived, len(expected), err, pipelineState(ctx, url, watch))
	}
	events, err := workload.StreamDeletes(ctx, cluster.URL, "main", cluster.connect(t, "projector")...)
	require.NoError(t, err)
	srep, err := workload.VerifyStream(ctx, url, expected, events)
	require.NoError(t, err)
	t.Logf("stream verification: %s", srep.String())
	require.True(t, srep.OK(), srep.String())
	rep, err := workload.VerifyArchive(ctx, url, expected)
	require.NoError(t, err)
	t.Logf("archive verification: %s", rep.String())
	require.True(t, rep.OK(), rep.String())
}
