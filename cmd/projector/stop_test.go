package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
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

// heldPage is a projector process whose second page is held inside its
// transaction by a lock the test takes on the archive table.
type heldPage struct {
	cmd     *exec.Cmd
	logs    *syncBuffer
	exited  chan error
	holder  pgx.Tx
	q       func(sql string, args ...any) int
	waiting func() bool
	until   func(timeout time.Duration, cond func() bool, msg string)
}

func startHeldPage(t *testing.T) *heldPage {
	t.Helper()
	const partitions = 1
	bin, url, n, js := startTarget(t, partitions)
	ctx := context.Background()
	port, err := testenv.FreePort()
	require.NoError(t, err)
	h := &heldPage{cmd: exec.Command(bin, "run"), logs: &syncBuffer{}, exited: make(chan error, 1)}
	h.cmd.Env = append(os.Environ(), "EPITAPH_TARGET_URL="+url, "EPITAPH_NATS_URL="+n.URL,
		"EPITAPH_WORKER_ID=w1", "EPITAPH_LEASE_TTL=2s", fmt.Sprintf("EPITAPH_METRICS_ADDR=127.0.0.1:%d", port),
		"EPITAPH_ARCHIVE_TTL=")
	h.cmd.Stdout, h.cmd.Stderr = h.logs, h.logs
	require.NoError(t, h.cmd.Start())
	reaped := make(chan struct{})
	go func() { h.exited <- h.cmd.Wait(); close(reaped) }()
	t.Cleanup(func() {
		_ = h.cmd.Process.Kill()
		<-reaped
	})

	conn, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	h.q = func(sql string, args ...any) int {
		var c int
		if err := conn.QueryRow(ctx, sql, args...).Scan(&c); err != nil {
			return -1
		}
		return c
	}
	h.until = func(timeout time.Duration, cond func() bool, msg string) {
		t.Helper()
		deadline := time.Now().Add(timeout)
		for !cond() {
			require.True(t, time.Now().Before(deadline), "%s\nprojector log:\n%s", msg, h.logs.String())
			time.Sleep(20 * time.Millisecond)
		}
	}

	// A first transaction: the archive exists and the partition is idle.
	lsn := event.LSN(0x6000000)
	publishTx(t, js, 0, lsn, 1)
	h.until(60*time.Second, func() bool { return h.q(`SELECT count(*) FROM archive.rows`) == 1 }, "first transaction archived")
	h.until(60*time.Second, func() bool { return h.q(`SELECT cursor FROM epitaph.progress WHERE owner = 'w1'`) == 2 }, "cursor after the first commit")

	// Hold the next page inside its transaction: its insert waits for the
	// test's lock on the table.
	h.holder, err = conn.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = h.holder.Rollback(context.Background()) })
	_, err = h.holder.Exec(ctx, `LOCK TABLE archive_v1.rows IN SHARE MODE`)
	require.NoError(t, err)
	other, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	t.Cleanup(func() { _ = other.Close(context.Background()) })
	h.waiting = func() bool {
		var n int
		err := other.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE relation = 'archive_v1.rows'::regclass AND NOT granted`).Scan(&n)
		return err == nil && n > 0
	}
	publishTx(t, js, 0, lsn+0x100, 2)
	h.until(60*time.Second, h.waiting, "the page waits for the lock")

	require.NoError(t, h.cmd.Process.Signal(syscall.SIGTERM))
	h.until(60*time.Second, func() bool { return strings.Contains(h.logs.String(), "stopping: finishing the current batches") }, "the signal is received")
	select {
	case err := <-h.exited:
		t.Fatalf("the projector exited while its page was held (%v):\n%s", err, h.logs.String())
	default:
	}
	require.True(t, h.waiting(), "the page is still in flight, not rolled back")
	return h
}

// SIGTERM while a page is being applied is the soft stop: the page is
// committed (not rolled back), its cursor advanced, the lease released and
// the process exits 0. The page is held inside its transaction by a lock
// the test takes on the archive table, and let go only after the signal.
func TestSIGTERMDuringAPageCommitsThePage(t *testing.T) {
	t.Parallel()
	h := startHeldPage(t)
	require.NoError(t, h.holder.Rollback(context.Background())) // let the page go
	select {
	case err := <-h.exited:
		require.NoError(t, err, "exit status after the soft stop:\n%s", h.logs.String())
	case <-time.After(120 * time.Second):
		t.Fatalf("the projector did not stop:\n%s", h.logs.String())
	}
	q := h.q
	require.Contains(t, h.logs.String(), "projector stopped")
	require.Equal(t, 2, q(`SELECT count(*) FROM archive.rows`), "the page in flight at SIGTERM was committed")
	require.Equal(t, 1, q(`SELECT count(*) FROM archive.rows WHERE key = '{"id":2}'`))
	require.Equal(t, 4, q(`SELECT cursor FROM epitaph.progress WHERE version = 1 AND partition = 0`), "its cursor advanced with it")
	require.Zero(t, q(`SELECT count(*) FROM epitaph.progress WHERE owner IS NOT NULL`), "the lease was released")
	require.Zero(t, q(`SELECT count(*) FROM epitaph.workers WHERE worker_id = 'w1'`), "the worker deregistered")
}

// A second SIGTERM during the soft stop kills at once, as with the capture
// (and as operators expect of Ctrl-C twice): the page in flight is not
// committed, and nothing is lost, since its cursor did not advance.
func TestSecondSIGTERMStopsAtOnce(t *testing.T) {
	t.Parallel()
	h := startHeldPage(t)
	require.NoError(t, h.cmd.Process.Signal(syscall.SIGTERM))
	select {
	case err := <-h.exited:
		require.Error(t, err, "the second signal ends the process, not a clean stop:\n%s", h.logs.String())
	case <-time.After(30 * time.Second): // the soft stop would wait 50 s on the held page
		t.Fatalf("the second SIGTERM did not stop the projector:\n%s", h.logs.String())
	}
	require.NoError(t, h.holder.Rollback(context.Background()))
	require.Equal(t, 1, h.q(`SELECT count(*) FROM archive.rows`), "the held page was not committed")
	require.Equal(t, 2, h.q(`SELECT cursor FROM epitaph.progress WHERE version = 1 AND partition = 0`), "its cursor did not advance")
}
