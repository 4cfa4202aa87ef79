package main

import (
	"bufio"
	"context"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/bench"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

type lines struct {
	mu  sync.Mutex
	all []string
}

func (l *lines) add(s string) {
	l.mu.Lock()
	l.all = append(l.all, s)
	l.mu.Unlock()
}

func (l *lines) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Join(l.all, "\n")
}

// find is the first match of re in the output so far.
func (l *lines) find(re *regexp.Regexp) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, s := range l.all {
		if m := re.FindStringSubmatch(s); m != nil {
			return m
		}
	}
	return nil
}

// TestDemoRunsUntilInterrupted runs the real demo (and the real capture
// and projector it starts): it shows the archive, then keeps running with
// the status page's address (which answers), a psql line and three next
// steps, the second of which (a restore) works as printed; SIGINT stops
// everything it started and it exits 0.
func TestDemoRunsUntilInterrupted(t *testing.T) {
	t.Parallel()
	work := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	bins, err := bench.Build(ctx, filepath.Join(work, "bin"), "capture", "projector")
	require.NoError(t, err)
	require.Len(t, bins, 2)
	demo := filepath.Join(work, "demo")
	out, err := exec.CommandContext(ctx, "go", "build", "-o", demo, ".").CombinedOutput()
	require.NoError(t, err, string(out))

	cmd := exec.Command(demo)
	cmd.Dir = work
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "EPITAPH_") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	cmd.Stderr = cmd.Stdout
	require.NoError(t, cmd.Start())
	var printed lines
	read := make(chan struct{})
	go func() {
		defer close(read)
		sc := bufio.NewScanner(stdout)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			printed.add(sc.Text())
		}
		_, _ = io.Copy(io.Discard, stdout)
	}()
	exited := make(chan struct{})
	var waitErr error
	go func() { <-read; waitErr = cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(time.Minute):
			_ = cmd.Process.Kill()
		}
	})

	statusRE := regexp.MustCompile(`status page:\s+(http://127\.0\.0\.1:\d+/)`)
	var status []string
	for deadline := time.Now().Add(4 * time.Minute); status == nil; {
		select {
		case <-exited:
			t.Fatalf("the demo exited (%v) before it printed the status page:\n%s", waitErr, printed.String())
		case <-time.After(200 * time.Millisecond):
		}
		require.True(t, time.Now().Before(deadline), "no status page address after 4 minutes:\n%s", printed.String())
		status = printed.find(statusRE)
	}
	time.Sleep(500 * time.Millisecond) // the rest of the block
	text := printed.String()
	urlRE := regexp.MustCompile(`the archive:\s+psql '([^']+)' -c 'SELECT .* FROM archive\.rows`)
	psqlLine := printed.find(urlRE)
	require.NotNil(t, psqlLine, "a psql line to look at the archive:\n%s", text)
	for _, want := range []string{"1. ", "2. ", "3. ", "Ctrl-C stops everything"} {
		require.Contains(t, text, want)
	}

	resp, err := http.Get(status[1])
	require.NoError(t, err)
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode, string(body))
	require.Contains(t, string(body), "archive")

	// Next step 2, as printed: customer 3 is back in the shop.
	restoreRE := regexp.MustCompile(`^\s+(EPITAPH_TARGET_URL=.* bin/projector restore .*)$`)
	restore := printed.find(restoreRE)
	require.NotNil(t, restore, text)
	sh := exec.CommandContext(ctx, "bash", "-c", restore[1])
	sh.Dir = work
	sh.Env = cmd.Env
	shOut, err := sh.CombinedOutput()
	require.NoError(t, err, "%s\n%s", restore[1], shOut)
	conn, err := pgx.Connect(ctx, psqlLine[1])
	require.NoError(t, err)
	var customers int
	require.NoError(t, conn.QueryRow(ctx, `SELECT count(*) FROM customers WHERE id = 3`).Scan(&customers))
	require.Equal(t, 1, customers, "%s", shOut)
	conn.Close(ctx)

	require.NoError(t, cmd.Process.Signal(syscall.SIGINT))
	select {
	case <-exited:
		require.NoError(t, waitErr, "a clean exit after SIGINT:\n%s", printed.String())
	case <-time.After(2 * time.Minute):
		t.Fatalf("the demo still runs 2 minutes after SIGINT:\n%s", printed.String())
	}
	require.Contains(t, printed.String(), "capture and projector stopped, database removed")
	require.NotContains(t, printed.String(), "did not stop cleanly")
	_, err = http.Get(status[1])
	require.Error(t, err, "the projector is gone")
	_, err = pgx.Connect(ctx, psqlLine[1])
	require.Error(t, err, "the database is gone")
}
