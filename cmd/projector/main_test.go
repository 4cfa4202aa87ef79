package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

// startTarget builds the real projector and gives it its own target
// database and a real JetStream server holding the stream of source main
// in partitions partitions.
func startTarget(t *testing.T, partitions int) (bin, url string, n *testenv.NATS, js jetstream.JetStream) {
	t.Helper()
	bin, url, n = build(t), testenv.NewDatabase(t), testenv.NewNATS(t)
	_, js = n.Connect(t)
	createMainStream(t, js, partitions)
	return bin, url, n, js
}

// createMainStream creates the file-stored stream of source main with the
// partition count the projector reads from its metadata.
func createMainStream(t *testing.T, js jetstream.JetStream, partitions int) {
	t.Helper()
	_, err := js.CreateStream(context.Background(), jetstream.StreamConfig{Name: event.StreamName("main"),
		Subjects: []string{event.StreamSubjects("main")}, Storage: jetstream.FileStorage,
		Metadata: map[string]string{event.MetaPartitions: strconv.Itoa(partitions)}})
	require.NoError(t, err)
}

func build(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "projector")
	out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput()
	require.NoError(t, err, string(out))
	return bin
}

// signers sign what the tests publish as the capture would, one signer
// (partition sequences, digests) per stream connection.
var signers sync.Map // jetstream.JetStream -> *testenv.Signer

func signerFor(js jetstream.JetStream) *testenv.Signer {
	s, _ := signers.LoadOrStore(js, testenv.NewSigner())
	return s.(*testenv.Signer)
}

func publishTx(t *testing.T, js jetstream.JetStream, p int, lsn event.LSN, orderID int) {
	t.Helper()
	ctx := context.Background()
	pub := func(subject, id string, ev *event.Event) {
		b, err := event.Encode(ev)
		require.NoError(t, err)
		m := nats.NewMsg(subject)
		m.Data = b
		m.Header.Set(event.HeaderMsgID, id)
		signerFor(js).Sign(m)
		_, err = js.PublishMsg(ctx, m)
		require.NoError(t, err)
	}
	now := time.Now().UTC()
	pub(event.DeleteSubject("main", p, "public", "orders"), event.MsgID("main", lsn, 0), &event.Event{
		Op: event.OpDelete, Source: "main", Schema: "public", Table: "orders", XID: int64(orderID), CommitLSN: lsn,
		CommitTime: now, Identity: event.IdentityFull, Key: json.RawMessage(fmt.Sprintf(`{"id":%d}`, orderID)),
		Row: json.RawMessage(fmt.Sprintf(`{"id":%d,"total":"1.50"}`, orderID))})
	pub(event.CommitSubject("main", p), event.CommitMsgID("main", lsn), &event.Event{
		Op: event.OpCommit, Source: "main", XID: int64(orderID), CommitLSN: lsn, CommitTime: now, Rows: 1,
		Tables: map[string]int{"public.orders": 1}})
}

// The real binary: migrate, run (SIGKILLed and restarted mid-stream), status.
func TestBinaryRunKillRestartStatus(t *testing.T) {
	t.Parallel()
	const partitions = 2
	bin, url, n, js := startTarget(t, partitions)
	ctx := context.Background()
	port, err := testenv.FreePort()
	require.NoError(t, err)
	env := append(os.Environ(), "EPITAPH_SOURCE_URL="+url, "EPITAPH_TARGET_URL=", "EPITAPH_NATS_URL="+n.URL,
		"EPITAPH_WORKER_ID=bin-1", "EPITAPH_LEASE_TTL=2s", fmt.Sprintf("EPITAPH_METRICS_ADDR=127.0.0.1:%d", port),
		"EPITAPH_ARCHIVE_TTL=public.orders=24h")

	out, err := runBin(bin, env, "migrate")
	require.NoError(t, err, out)
	require.Contains(t, out, "epitaph schema at version")

	start := func() *exec.Cmd {
		cmd := exec.Command(bin, "run")
		cmd.Env = env
		var logs bytes.Buffer
		cmd.Stdout, cmd.Stderr = &logs, &logs
		require.NoError(t, cmd.Start())
		t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
		return cmd
	}
	conn, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer conn.Close(ctx)
	archived := func() int {
		var c int
		if err := conn.QueryRow(ctx, `SELECT count(*) FROM archive.rows`).Scan(&c); err != nil {
			return -1
		}
		return c
	}
	wait := func(want int) {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for archived() != want {
			require.True(t, time.Now().Before(deadline), "archived %d, want %d", archived(), want)
			time.Sleep(50 * time.Millisecond)
		}
	}

	lsn := event.LSN(0x5000000)
	next := func(i int) {
		lsn += 0x100
		publishTx(t, js, event.Partition(lsn, partitions), lsn, i)
	}
	cmd := start()
	for i := 0; i < 20; i++ {
		next(i)
	}
	wait(20)
	// SIGKILL mid-stream, publish while it is down, restart.
	require.NoError(t, cmd.Process.Signal(syscall.SIGKILL))
	_ = cmd.Wait()
	for i := 20; i < 40; i++ {
		next(i)
	}
	cmd = start()
	wait(40)
	var expiring int
	require.NoError(t, conn.QueryRow(ctx, `SELECT count(*) FROM archive.rows WHERE expires_at = commit_time + interval '24 hours'`).Scan(&expiring))
	require.Equal(t, 40, expiring)

	out, err = runBin(bin, env, "status", "--json")
	require.NoError(t, err, out)
	var st struct {
		Versions []struct {
			State      string `json:"state"`
			LagEvents  uint64 `json:"lag_events"`
			Partitions []struct {
				Owner string `json:"owner"`
			} `json:"partitions"`
		} `json:"versions"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &st), out)
	require.Len(t, st.Versions, 1)
	require.Equal(t, "live", st.Versions[0].State)
	require.Zero(t, st.Versions[0].LagEvents)
	require.Len(t, st.Versions[0].Partitions, partitions)
	require.Equal(t, "bin-1", st.Versions[0].Partitions[0].Owner)
	out, err = runBin(bin, env, "status")
	require.NoError(t, err, out)
	require.Contains(t, out, "archive_v1")

	// SIGTERM is a soft stop: leases are released at once.
	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	require.NoError(t, cmd.Wait())
	var owned int
	require.NoError(t, conn.QueryRow(ctx, `SELECT count(*) FROM epitaph.progress WHERE owner IS NOT NULL`).Scan(&owned))
	require.Zero(t, owned)
}

// exitCode is the exit status of a finished command (0 for a nil error).
func exitCode(err error) int {
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return ee.ExitCode()
	}
	if err != nil {
		return -1
	}
	return 0
}

func runBin(bin string, env []string, args ...string) (string, error) {
	cmd := exec.Command(bin, args...)
	cmd.Env = env
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	if err != nil {
		return out.String() + errOut.String(), err
	}
	return out.String(), nil
}
