package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// syncBuffer is a process's output, read while the process writes it.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// SIGTERM while a page is being applied is the soft stop: the page is
// committed (not rolled back), its cursor advanced, the lease released and
// the process exits 0. The page is held inside its transaction by a lock
// the test takes on the archive table, and let go only after the signal.
func TestSIGTERMDuringAPageCommitsThePage(t *testing.T) {
	t.Parallel()
	bin := build(t)
	url := testenv.NewDatabase(t)
	n := testenv.NewNATS(t)
	_, js := n.Connect(t)
	ctx := context.Background()
	const partitions = 1
	_, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: event.StreamName("main"),
		Subjects: []string{event.StreamSubjects("main")}, Storage: jetstream.FileStorage,
		Metadata: map[string]string{"epitaph.partitions": strconv.Itoa(partitions)}})
	require.NoError(t, err)
	port, err := testenv.FreePort()
	require.NoError(t, err)
	cmd := exec.Command(bin, "run")
	cmd.Env = append(os.Environ(), "EPITAPH_TARGET_URL="+url, "EPITAPH_NATS_URL="+n.URL,
		"EPITAPH_WORKER_ID=w1", "EPITAPH_LEASE_TTL=2s", fmt.Sprintf("EPITAPH_METRICS_ADDR=127.0.0.1:%d", port),
		"EPITAPH_ARCHIVE_TTL=")
	logs := &syncBuffer{}
	cmd.Stdout, cmd.Stderr = logs, logs
	require.NoError(t, cmd.Start())
	exited, reaped := make(chan error, 1), make(chan struct{})
	go func() { exited <- cmd.Wait(); close(reaped) }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-reaped
	})

	conn, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer conn.Close(ctx)
	q := func(sql string, args ...any) int {
		var c int
		if err := conn.QueryRow(ctx, sql, args...).Scan(&c); err != nil {
			return -1
		}
		return c
	}
	eventually := func(timeout time.Duration, cond func() bool, msg string) {
		t.Helper()
		deadline := time.Now().Add(timeout)
		for !cond() {
			require.True(t, time.Now().Before(deadline), "%s\nprojector log:\n%s", msg, logs.String())
			time.Sleep(20 * time.Millisecond)
		}
	}

	// A first transaction: the archive exists and the partition is idle.
	lsn := event.LSN(0x6000000)
	publishTx(t, js, 0, lsn, 1)
	eventually(60*time.Second, func() bool { return q(`SELECT count(*) FROM archive.rows`) == 1 }, "first transaction archived")
	eventually(60*time.Second, func() bool { return q(`SELECT cursor FROM epitaph.progress WHERE owner = 'w1'`) == 2 }, "cursor after the first commit")

	// Hold the next page inside its transaction: its insert waits for the
	// test's lock on the table.
	holder, err := conn.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = holder.Rollback(context.Background()) }()
	_, err = holder.Exec(ctx, `LOCK TABLE archive_v1.rows IN SHARE MODE`)
	require.NoError(t, err)
	other, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer other.Close(ctx)
	waiting := func() bool {
		var n int
		err := other.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE relation = 'archive_v1.rows'::regclass AND NOT granted`).Scan(&n)
		return err == nil && n > 0
	}
	publishTx(t, js, 0, lsn+0x100, 2)
	eventually(60*time.Second, waiting, "the page waits for the lock")

	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	eventually(60*time.Second, func() bool { return strings.Contains(logs.String(), "stopping: finishing the current batches") }, "the signal is received")
	select {
	case err := <-exited:
		t.Fatalf("the projector exited while its page was held (%v):\n%s", err, logs.String())
	default:
	}
	require.True(t, waiting(), "the page is still in flight, not rolled back")

	require.NoError(t, holder.Rollback(ctx)) // let the page go
	select {
	case err := <-exited:
		require.NoError(t, err, "exit status after the soft stop:\n%s", logs.String())
	case <-time.After(120 * time.Second):
		t.Fatalf("the projector did not stop:\n%s", logs.String())
	}
	require.Contains(t, logs.String(), "projector stopped")
	require.Equal(t, 2, q(`SELECT count(*) FROM archive.rows`), "the page in flight at SIGTERM was committed")
	require.Equal(t, 1, q(`SELECT count(*) FROM archive.rows WHERE key = '{"id":2}'`))
	require.Equal(t, 4, q(`SELECT cursor FROM epitaph.progress WHERE version = 1 AND partition = 0`), "its cursor advanced with it")
	require.Zero(t, q(`SELECT count(*) FROM epitaph.progress WHERE owner IS NOT NULL`), "the lease was released")
	require.Zero(t, q(`SELECT count(*) FROM epitaph.workers WHERE worker_id = 'w1'`), "the worker deregistered")
}
