package main

import (
	"context"
	"encoding/json"
	"net/url"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
)

// migrate status|up [--dry-run], the guard against a newer schema, and
// --retry-for waiting out a target outage.
func TestMigrateCommands(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dbURL := testenv.NewDatabase(t)
	vars := map[string]string{"EPITAPH_TARGET_URL": dbURL}
	all, err := migrations.All()
	require.NoError(t, err)
	applied := func() int {
		conn, err := pgx.Connect(ctx, dbURL)
		require.NoError(t, err)
		defer conn.Close(ctx)
		vs, err := migrations.Applied(ctx, conn)
		require.NoError(t, err)
		return len(vs)
	}

	code, out, stderr := projector(t, vars, "migrate", "status", "--json")
	require.Equal(t, 0, code, stderr)
	var st struct {
		Applied []int `json:"applied"`
		Pending []struct {
			Version int    `json:"version"`
			Name    string `json:"name"`
		} `json:"pending"`
		Unknown []int `json:"unknown"`
		Latest  int   `json:"latest"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &st), out)
	require.Empty(t, st.Applied)
	require.Len(t, st.Pending, len(all))
	require.Equal(t, "progress", st.Pending[0].Name)
	code, _, _ = projector(t, vars, "migrate", "status", "--check")
	require.Equal(t, 3, code, "pending migrations: the check fails")

	code, out, stderr = projector(t, vars, "migrate", "up", "--dry-run")
	require.Equal(t, 0, code, stderr)
	require.Contains(t, out, "dry run: would apply 0001_progress")
	require.Zero(t, applied(), "a dry run changes nothing")

	code, out, stderr = projector(t, vars, "migrate")
	require.Equal(t, 0, code, stderr)
	require.Contains(t, out, "epitaph schema at version")
	require.Equal(t, len(all), applied())
	code, out, _ = projector(t, vars, "migrate", "status", "--check")
	require.Equal(t, 0, code, out)
	code, out, _ = projector(t, vars, "migrate", "up", "--dry-run")
	require.Equal(t, 0, code)
	require.Contains(t, out, "dry run: nothing to apply")

	testenv.Exec(t, dbURL, `INSERT INTO epitaph.schema_migrations (version, name) VALUES (9999, 'from_the_future')`)
	code, _, stderr = projector(t, vars, "migrate")
	require.Equal(t, 1, code)
	require.Contains(t, stderr, "newer than this binary")
	code, _, stderr = projector(t, vars, "migrate", "up", "--dry-run")
	require.Equal(t, 1, code, "a dry run refuses too")
	require.Contains(t, stderr, "newer than this binary")
	code, out, _ = projector(t, vars, "migrate", "status")
	require.Equal(t, 0, code)
	require.Contains(t, out, "unknown to this binary (the schema is newer): [9999]")
}

// The migrate step of a pod waits out a target outage (--retry-for)
// instead of failing.
func TestMigrateRetriesWhileTheTargetIsDown(t *testing.T) {
	t.Parallel()
	bin := build(t)
	dbURL := testenv.NewDatabase(t)
	u, err := url.Parse(dbURL)
	require.NoError(t, err)
	proxy := newOutageProxy(t, u.Host)
	u.Host = proxy.l.Addr().String()
	proxy.cut()

	// Without --retry-for: fails at once.
	env := append(os.Environ(), "EPITAPH_TARGET_URL="+u.String(), "EPITAPH_SOURCE_URL=")
	out, err := runBin(bin, env, "migrate")
	require.Equal(t, 1, exitCode(err), out)

	cmd := exec.Command(bin, "migrate")
	cmd.Env = append(env, "EPITAPH_MIGRATE_RETRY_FOR=90s")
	logs := &lockedBuffer{}
	cmd.Stdout, cmd.Stderr = logs, logs
	require.NoError(t, cmd.Start())
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	t.Cleanup(func() { _ = cmd.Process.Kill() })
	// It retries (and says so) while the target is down ...
	deadline := time.Now().Add(60 * time.Second)
	for !strings.Contains(logs.String(), "target not reachable, retrying") {
		require.True(t, time.Now().Before(deadline), logs.String())
		select {
		case err := <-done:
			t.Fatalf("migrate ended during the outage: %v\n%s", err, logs.String())
		case <-time.After(100 * time.Millisecond):
		}
	}
	// ... and succeeds once it is back.
	proxy.restore()
	select {
	case err := <-done:
		require.NoError(t, err, logs.String())
	case <-time.After(90 * time.Second):
		t.Fatalf("migrate did not finish after the target came back:\n%s", logs.String())
	}
	require.Contains(t, logs.String(), "epitaph schema at version")
}

// status --check exits 3 when there is no healthy live version, 1 when
// it cannot reach NATS.
func TestStatusCheck(t *testing.T) {
	t.Parallel()
	dbURL := testenv.NewDatabase(t)
	n := testenv.NewNATS(t)
	vars := map[string]string{"EPITAPH_TARGET_URL": dbURL, "EPITAPH_NATS_URL": n.URL}
	code, _, stderr := projector(t, vars, "migrate")
	require.Equal(t, 0, code, stderr)
	code, out, stderr := projector(t, vars, "status", "--check")
	require.Equal(t, 1, code, out)
	require.Contains(t, stderr, "status check cannot tell: stream: ")
	_, js := n.Connect(t)
	_, err := js.CreateStream(context.Background(), jetstream.StreamConfig{Name: event.StreamName("main"),
		Subjects: []string{event.StreamSubjects("main")}, Metadata: map[string]string{event.MetaPartitions: "2"}})
	require.NoError(t, err)
	code, out, stderr = projector(t, vars, "status", "--check")
	require.Equal(t, 3, code, out)
	require.Contains(t, stderr, "status check failed: no live version")
	vars["EPITAPH_NATS_URL"] = "nats://127.0.0.1:1"
	code, out, stderr = projector(t, vars, "status", "--check")
	require.Equal(t, 1, code, out)
	require.Contains(t, stderr, "NATS nats://127.0.0.1:1 unreachable")
	code, out, stderr = projector(t, vars, "status", "--json")
	require.Equal(t, 0, code, stderr)
	require.True(t, json.Valid([]byte(out)), out)
}
