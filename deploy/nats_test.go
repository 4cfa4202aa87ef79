package deploy_test

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/broker"
	"github.com/epitaph-dev/epitaph/internal/natsconn"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/progress"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// requireRolePermissions: the config's users are the embedded broker's
// roles with the same permissions (the capture's for every source), each
// subscribing to its own inboxes only; with the example target user
// enabled (withTarget), projector_crm is the projector with its own inboxes
// (what capture creds --target crm writes).
func requireRolePermissions(t *testing.T, opts *server.Options, withTarget bool) {
	t.Helper()
	users := map[string]*server.User{}
	for _, u := range opts.Users {
		users[u.Username] = u
		require.Equal(t, "EPITAPH", u.Account.Name, "user %s", u.Username)
	}
	want := map[string]jwt.Permissions{
		"capture":   broker.CapturePermissions("main", "capture"),
		"projector": broker.ProjectorPermissions("main", "projector"),
		"erase":     broker.ErasePermissions("main", "erase"),
	}
	if withTarget {
		want[broker.TargetUser("crm")] = broker.ProjectorPermissions("main", broker.TargetUser("crm"))
	}
	require.Len(t, users, len(want), "the capture, projector and erase roles (and the example target's user)")
	for name, w := range want {
		require.Contains(t, users, name)
		require.Equal(t, []string(w.Pub.Allow), users[name].Permissions.Publish.Allow, name)
		require.Equal(t, []string(w.Pub.Deny), users[name].Permissions.Publish.Deny, name)
		require.Equal(t, []string(w.Sub.Allow), users[name].Permissions.Subscribe.Allow, name)
		require.Equal(t, []string{"_INBOX." + name + ".>"}, users[name].Permissions.Subscribe.Allow, name)
	}
	require.NotContains(t, users["projector"].Permissions.Publish.Allow, "$JS.API.STREAM.MSG.DELETE.*", "running projectors delete nothing")
	require.Equal(t, "SYS", opts.SystemAccount)
}

// withExampleTarget writes nats.conf with its commented example user of
// target "crm" enabled, and returns the file's path.
func withExampleTarget(t *testing.T) string {
	t.Helper()
	raw, err := os.ReadFile("nats/nats.conf")
	require.NoError(t, err)
	lines := strings.Split(string(raw), "\n")
	var example []string
	start := -1
	for i, l := range lines {
		if strings.Contains(l, "EPITAPH_NATS_USER=projector_crm") {
			start = i + 1
		}
		if start >= 0 && i >= start {
			if l == "#" {
				continue
			}
			if !strings.HasPrefix(l, "#      ") {
				break
			}
			example = append(example, strings.TrimPrefix(l, "#"))
		}
	}
	require.NotEmpty(t, example, "nats.conf has the example user of target crm")
	conf := strings.Replace(string(raw), "    users: [\n", "    users: [\n"+strings.Join(example, "\n")+"\n", 1)
	path := filepath.Join(t.TempDir(), "nats.conf")
	require.NoError(t, os.WriteFile(path, []byte(conf), 0o600))
	return path
}

var natsServerModuleRe = regexp.MustCompile(`(?m)^\s*github\.com/nats-io/nats-server/v2 v(\S+)`)

// TestNATSImageMatchesServerModule: the compose cluster runs the NATS
// version the code is built and tested against (and that loads nats.conf in
// the test below).
func TestNATSImageMatchesServerModule(t *testing.T) {
	t.Parallel()
	gomod, err := os.ReadFile("../go.mod")
	require.NoError(t, err)
	m := natsServerModuleRe.FindStringSubmatch(string(gomod))
	require.NotNil(t, m, "go.mod requires nats-server/v2")
	c := loadCompose(t)
	for _, name := range []string{"nats-1", "nats-2", "nats-3"} {
		image := c.Services[name].Image
		tag := strings.TrimPrefix(image, "nats:")
		require.Equal(t, m[1], strings.TrimSuffix(tag, "-alpine"), "%s image %s vs go.mod nats-server v%s", name, image, m[1])
	}
}

// TestNATSConfigFormsJetStreamCluster loads deploy/nats/nats.conf with the
// real nats-server once per compose node, checks what compose relies on,
// then starts the three nodes (moved to loopback ports and temporary
// stores), makes a three-replica stream as the capture does, and reads it
// back after the stream leader's node is shut down.
func TestNATSConfigFormsJetStreamCluster(t *testing.T) {
	// Not parallel: the config reads SERVER_NAME from the environment.
	c := loadCompose(t)
	nodes := []string{"nats-1", "nats-2", "nats-3"}

	clusterPorts := map[string]int{}
	for _, n := range nodes {
		p, err := testenv.FreePort()
		require.NoError(t, err)
		clusterPorts[n] = p
	}

	// The roles' passwords, as compose gives them to every node.
	secrets := t.TempDir()
	passwords := map[string]string{"capture": "capture-pw-1", "projector": "projector-pw-2", "erase": "erase-pw-3", "projector_crm": "crm-pw-4"}
	for role, pw := range passwords {
		t.Setenv("EPITAPH_NATS_"+strings.ToUpper(role)+"_PASSWORD", pw)
		require.NoError(t, os.WriteFile(filepath.Join(secrets, role), []byte(pw+"\n"), 0o600))
	}

	var servers []*server.Server
	var clientURLs []string
	for _, n := range nodes {
		t.Setenv("SERVER_NAME", c.Services[n].Environment["SERVER_NAME"])
		opts, err := server.ProcessConfigFile("nats/nats.conf")
		require.NoError(t, err)
		requireRolePermissions(t, opts, false)
		// The nodes run it with the example target's user enabled.
		opts, err = server.ProcessConfigFile(withExampleTarget(t))
		require.NoError(t, err)
		requireRolePermissions(t, opts, true)

		require.Equal(t, n, opts.ServerName, "server_name from the node's SERVER_NAME")
		require.Equal(t, 4222, opts.Port, "clients use 4222 (EPITAPH_NATS_URL)")
		require.Equal(t, 8222, opts.HTTPPort, "the compose health check calls :8222/healthz")
		require.Equal(t, "127.0.0.1", opts.HTTPHost, "monitoring lists consumer names without authentication: loopback only")
		require.True(t, opts.JetStream)
		require.Equal(t, "/data", opts.StoreDir, "the compose volume is mounted at /data")
		require.Equal(t, int32(1<<20), opts.MaxPayload)
		require.Equal(t, "epitaph", opts.Cluster.Name)
		require.Equal(t, 6222, opts.Cluster.Port)
		var routeHosts []string
		for i, r := range opts.Routes {
			require.Equal(t, "6222", r.Port())
			routeHosts = append(routeHosts, r.Hostname())
			// Move the route to the loopback port of the node it names.
			port, ok := clusterPorts[r.Hostname()]
			require.True(t, ok, "route to %s, which is not a compose NATS node", r)
			opts.Routes[i] = &url.URL{Scheme: "nats", Host: fmt.Sprintf("127.0.0.1:%d", port)}
		}
		require.ElementsMatch(t, nodes, routeHosts, "every node routes to every node")

		port, err := testenv.FreePort()
		require.NoError(t, err)
		opts.Host, opts.Port = "127.0.0.1", port
		opts.HTTPPort = 0
		opts.Cluster.Host, opts.Cluster.Port = "127.0.0.1", clusterPorts[n]
		opts.StoreDir = t.TempDir()
		// The test machine's disk, not the production volume.
		opts.JetStreamMaxStore = 256 << 20
		opts.NoLog, opts.NoSigs = true, true

		s, err := server.NewServer(opts)
		require.NoError(t, err, n)
		go s.Start()
		t.Cleanup(s.Shutdown)
		require.True(t, s.ReadyForConnections(20*time.Second), "%s ready", n)
		servers = append(servers, s)
		clientURLs = append(clientURLs, s.ClientURL())
	}

	urls := strings.Join(clientURLs, ",")
	role := func(name string) []nats.Option {
		opts, err := natsconn.Auth{User: name, PasswordFile: filepath.Join(secrets, name)}.Options(urls)
		require.NoError(t, err)
		return opts
	}
	_, err := nats.Connect(urls)
	require.ErrorIs(t, err, nats.ErrAuthorization, "a client without credentials")
	nc, err := nats.Connect(urls, append(role("capture"), nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))...)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	// The meta leader is elected after the routes connect: retry until then.
	var stream jetstream.Stream
	require.Eventually(t, func() bool {
		cctx, ccancel := context.WithTimeout(ctx, 5*time.Second)
		defer ccancel()
		stream, err = js.CreateStream(cctx, jetstream.StreamConfig{
			Name:     "EPITAPH_MAIN",
			Subjects: []string{"epitaph.main.>"},
			Storage:  jetstream.FileStorage,
			Replicas: 3,
		})
		return err == nil
	}, time.Minute, 250*time.Millisecond, "three-replica stream on the cluster: %v", err)

	for i := range 10 {
		_, err := js.Publish(ctx, fmt.Sprintf("epitaph.main.%d.delete", i%3), fmt.Appendf(nil, `{"seq":%d}`, i))
		require.NoError(t, err)
	}

	// The projector's user reads the stream and is refused a publish to it.
	pnc, err := nats.Connect(urls, role("projector")...)
	require.NoError(t, err)
	t.Cleanup(pnc.Close)
	pjs, err := jetstream.New(pnc)
	require.NoError(t, err)
	pstream, err := pjs.Stream(ctx, "EPITAPH_MAIN")
	require.NoError(t, err)
	m, err := pstream.GetMsg(ctx, 1)
	require.NoError(t, err)
	require.Equal(t, `{"seq":0}`, string(m.Data))
	pctx, pcancel := context.WithTimeout(ctx, 3*time.Second)
	_, err = pjs.Publish(pctx, "epitaph.main.0.delete", []byte(`{"seq":"forged"}`))
	pcancel()
	require.Error(t, err, "the projector publishes to the stream")
	pctx, pcancel = context.WithTimeout(ctx, 3*time.Second)
	err = pjs.DeleteStream(pctx, "EPITAPH_MAIN")
	pcancel()
	require.Error(t, err, "the projector deletes the stream")
	pctx, pcancel = context.WithTimeout(ctx, 3*time.Second)
	err = pstream.SecureDeleteMsg(pctx, 10)
	pcancel()
	require.Error(t, err, "the projector deletes a message")

	// Holders of the capture's and the projector's real credentials try,
	// each at once, what the role may not do (another target's consumer is
	// the victim): the server refuses every attempt, and the stream and
	// the consumer stay as they were.
	// The victim is a partition worker's consumer of the target whose
	// projectors are the user projector: its name has a random part.
	unit := progress.Key{Projection: "archive", Version: 1, Partition: 0}
	victimName, err := version.NewUnitConsumer(unit, "other")
	require.NoError(t, err)
	victim, err := pstream.CreateConsumer(ctx, jetstream.ConsumerConfig{Durable: victimName, FilterSubject: "epitaph.main.0.>", AckPolicy: jetstream.AckAllPolicy})
	require.NoError(t, err)
	created := victim.CachedInfo().Created
	proj := testenv.NewAttacker(t, urls, role("projector")...)
	proj.RequireRefused(t, ctx, proj.ProjectorAttempts("main", victimName, 1))
	capt := testenv.NewAttacker(t, urls, role("capture")...)
	capt.RequireRefused(t, ctx, capt.CaptureAttempts("main", victimName, 1))
	// Holders of another target's user (projector_crm) and of the
	// capture's, answered on their own inboxes, cannot read the projector
	// user's inboxes (or any other), acknowledgements or advisories, list
	// the consumers, or find the victim under the names consumers had
	// before they carried a random part.
	crm := testenv.NewAttacker(t, urls, role("projector_crm")...)
	for who, att := range map[string]*testenv.Attacker{"projector_crm": crm, "capture": capt} {
		_, err := att.JS.AccountInfo(ctx)
		require.NoError(t, err, who)
		att.RequireRefused(t, ctx, append(att.SnoopAttempts("main", "projector"), att.ListConsumers("main")))
		for _, guess := range []string{unit.GroupConsumerName("other"), unit.ConsumerName()} {
			_, err := att.JS.Consumer(ctx, "EPITAPH_MAIN", guess)
			require.ErrorIs(t, err, jetstream.ErrConsumerNotFound, "%s finds %s", who, guess)
			require.ErrorIs(t, att.JS.DeleteConsumer(ctx, "EPITAPH_MAIN", guess), jetstream.ErrConsumerNotFound, "%s deletes %s", who, guess)
		}
	}
	vi, err := victim.Info(ctx)
	require.NoError(t, err)
	require.Equal(t, uint64(4), vi.NumPending, "the other target's consumer still has its partition's messages pending")
	require.False(t, vi.Paused, "not paused")
	require.Equal(t, created, vi.Created, "never made anew")
	require.NoError(t, pstream.DeleteConsumer(ctx, victimName))

	// The erase user (projector erase --purge-stream) securely deletes one
	// message, and may not purge.
	enc, err := nats.Connect(urls, role("erase")...)
	require.NoError(t, err)
	t.Cleanup(enc.Close)
	ejs, err := jetstream.New(enc)
	require.NoError(t, err)
	estream, err := ejs.Stream(ctx, "EPITAPH_MAIN")
	require.NoError(t, err)
	pctx, pcancel = context.WithTimeout(ctx, 3*time.Second)
	err = estream.Purge(pctx)
	pcancel()
	require.Error(t, err, "the erase user purges the stream")
	require.NoError(t, estream.SecureDeleteMsg(ctx, 10))
	_, err = estream.GetMsg(ctx, 10)
	require.ErrorIs(t, err, jetstream.ErrMsgNotFound)
	_, err = js.Publish(ctx, "epitaph.main.1.delete", []byte(`{"seq":10}`))
	require.NoError(t, err)

	info, err := stream.Info(ctx)
	require.NoError(t, err)
	require.NotNil(t, info.Cluster)
	require.Equal(t, "epitaph", info.Cluster.Name)
	require.NotEmpty(t, info.Cluster.Leader)
	require.Len(t, info.Cluster.Replicas, 2, "two followers besides the leader")
	require.Equal(t, uint64(10), info.State.Msgs)

	// Lose the leader's node: the other two still hold every message.
	leader := info.Cluster.Leader
	for _, s := range servers {
		if s.Name() == leader {
			s.Shutdown()
		}
	}
	require.Eventually(t, func() bool {
		cctx, ccancel := context.WithTimeout(ctx, 5*time.Second)
		defer ccancel()
		st, err := js.Stream(cctx, "EPITAPH_MAIN")
		if err != nil {
			return false
		}
		info, err := st.Info(cctx)
		if err != nil || info.Cluster == nil || info.Cluster.Leader == "" || info.Cluster.Leader == leader {
			return false
		}
		msg, err := st.GetMsg(cctx, 11)
		return err == nil && string(msg.Data) == `{"seq":10}` && info.State.Msgs == 10
	}, time.Minute, 250*time.Millisecond, "stream readable with a new leader after %s is gone", leader)
}

// TestComposeCaptureIsTheClusterTestsCapture: the compose capture runs as
// e2e/TestClusterLosesNodesUnderLoad runs it against the same nats.conf:
// three replicas, confirmations not trailing the acknowledgements, every
// node in its URL.
func TestComposeCaptureIsTheClusterTestsCapture(t *testing.T) {
	t.Parallel()
	c := loadCompose(t)
	env := c.Services["capture"].Environment
	require.Equal(t, "3", env["EPITAPH_REPLICAS"])
	require.Equal(t, "-1s", env["EPITAPH_BROKER_SYNC_INTERVAL"])
	require.Equal(t, "nats://nats-1:4222,nats://nats-2:4222,nats://nats-3:4222", env["EPITAPH_NATS_URL"])
	require.Equal(t, "capture", env["EPITAPH_NATS_USER"])
}
