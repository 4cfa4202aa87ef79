package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/progress"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// heartbeatAll publishes a heartbeat mark at lsn to every partition, as the
// capture does.
func heartbeatAll(t *testing.T, js jetstream.JetStream, lsn event.LSN, partitions int) {
	t.Helper()
	for p := 0; p < partitions; p++ {
		b, err := event.Encode(&event.Event{Op: event.OpMark, Source: "main", Partition: p, LSN: lsn, Kind: event.MarkHeartbeat, Time: time.Now()})
		require.NoError(t, err)
		m := nats.NewMsg(event.MarkSubject("main", p))
		m.Data = b
		m.Header.Set(event.HeaderMsgID, event.MarkMsgID("main", lsn, p))
		signerFor(js).Sign(m)
		_, err = js.PublishMsg(context.Background(), m)
		require.NoError(t, err)
	}
}

// source publishes delete transactions by hand, one row each, with
// increasing LSNs.
type source struct {
	t          *testing.T
	js         jetstream.JetStream
	partitions int
	mu         sync.Mutex
	lsn        event.LSN
	rows       int
}

func (s *source) delete() event.LSN {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.lsn += 0x100
	s.rows++
	publishTx(s.t, s.js, event.Partition(s.lsn, s.partitions), s.lsn, s.rows)
	return s.lsn
}

func (s *source) heartbeat() event.LSN {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.lsn += 0x100
	heartbeatAll(s.t, s.js, s.lsn, s.partitions)
	return s.lsn
}

func (s *source) published() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.rows
}

// metric reads one series of a counter from a worker's /metrics.
func metric(t *testing.T, addr, name, labels string) float64 {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		return -1
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, name+"{") && strings.Contains(line, labels) {
			f, err := strconv.ParseFloat(line[strings.LastIndex(line, " ")+1:], 64)
			require.NoError(t, err)
			return f
		}
	}
	return 0
}

// Rebuild, compare and promote with the real binary, under continuous delete
// traffic: `rebuild --wait` of v2 with a changed TTL policy (the worker is
// SIGKILLed during the rebuild and resumes from its cursors), `compare`
// (equal except the intended expires_at difference), `promote` while a
// reader queries archive.rows in a loop, `wait --lsn` and GET /wait,
// `rollback`, roll forward, `retire 1 --drop`, and the archive complete.
func TestBinaryRebuildPromoteRollbackRetire(t *testing.T) {
	t.Parallel()
	const partitions = 4
	bin, url, n, js := startTarget(t, partitions)
	ctx := context.Background()
	port, err := testenv.FreePort()
	require.NoError(t, err)
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	base := append(os.Environ(), "EPITAPH_TARGET_URL="+url, "EPITAPH_NATS_URL="+n.URL,
		"EPITAPH_WORKER_ID=w1", "EPITAPH_LEASE_TTL=2s", "EPITAPH_METRICS_ADDR="+addr, "EPITAPH_ARCHIVE_TTL=")
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
	eventually := func(timeout time.Duration, cond func() bool, msg string, args ...any) {
		t.Helper()
		deadline := time.Now().Add(timeout)
		for !cond() {
			require.True(t, time.Now().Before(deadline), append([]any{msg}, args...)...)
			time.Sleep(50 * time.Millisecond)
		}
	}
	start := func(env []string) (*exec.Cmd, *bytes.Buffer) {
		cmd := exec.Command(bin, "run")
		cmd.Env = env
		logs := &bytes.Buffer{}
		cmd.Stdout, cmd.Stderr = logs, logs
		require.NoError(t, cmd.Start())
		t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
		return cmd, logs
	}

	src := &source{t: t, js: js, partitions: partitions, lsn: 0x7000000}
	w, _ := start(base)
	for i := 0; i < 3000; i++ {
		src.delete()
	}
	src.heartbeat()
	eventually(60*time.Second, func() bool { return q(`SELECT count(*) FROM archive.rows`) == 3000 }, "v1 archived %d", q(`SELECT count(*) FROM archive.rows`))
	require.NoError(t, w.Process.Signal(syscall.SIGTERM))
	require.NoError(t, w.Wait())

	// New configuration: orders are kept 24h; small pages so the rebuild
	// takes long enough to be killed in the middle.
	env := append(append([]string{}, base...), "EPITAPH_ARCHIVE_TTL=public.orders=24h", "EPITAPH_BATCH_SIZE=10")
	w, _ = start(env)
	trafficCtx, stopTraffic := context.WithCancel(ctx)
	trafficDone := make(chan struct{})
	go func() {
		defer close(trafficDone)
		for i := 0; trafficCtx.Err() == nil; i++ {
			src.delete()
			if i%5 == 4 {
				src.heartbeat()
			}
			time.Sleep(20 * time.Millisecond)
		}
	}()
	defer func() { stopTraffic(); <-trafficDone }()

	rebuild := exec.Command(bin, "rebuild", "archive", "--wait", "--note", "ttl change")
	rebuild.Env = env
	var rebuildOut bytes.Buffer
	rebuild.Stdout, rebuild.Stderr = &rebuildOut, &rebuildOut
	require.NoError(t, rebuild.Start())
	rebuildDone := make(chan error, 1)
	go func() { rebuildDone <- rebuild.Wait() }()

	// SIGKILL the worker during the rebuild; restart it: it resumes v2
	// from its cursors.
	eventually(30*time.Second, func() bool { return q(`SELECT count(*) FROM archive_v2.rows`) > 200 }, "v2 started")
	follow := exec.Command(bin, "status", "--wait")
	follow.Env = env
	var followOut bytes.Buffer
	follow.Stdout, follow.Stderr = &followOut, &followOut
	require.NoError(t, follow.Start())
	followDone := make(chan error, 1)
	go func() { followDone <- follow.Wait() }()
	require.NoError(t, w.Process.Signal(syscall.SIGKILL))
	_ = w.Wait()
	atKill := q(`SELECT count(*) FROM archive_v2.rows`)
	var stateAtKill string
	require.NoError(t, conn.QueryRow(ctx, `SELECT state FROM epitaph.projection_versions WHERE version = 2`).Scan(&stateAtKill))
	require.Equal(t, "building", stateAtKill, "killed during the rebuild")
	require.Less(t, atKill, 3000)
	var boundary int64
	require.NoError(t, conn.QueryRow(ctx, `SELECT boundary_seq FROM epitaph.projection_versions WHERE version = 2`).Scan(&boundary))
	w, wlogs := start(env)

	select {
	case err := <-rebuildDone:
		require.NoError(t, err, rebuildOut.String())
	case <-time.After(3 * time.Minute):
		t.Fatalf("rebuild --wait did not finish: %s\nworker: %s", rebuildOut.String(), wlogs.String())
	}
	select {
	case err := <-followDone:
		require.NoError(t, err, followOut.String())
	case <-time.After(time.Minute):
		t.Fatalf("status --wait did not finish: %s", followOut.String())
	}
	require.Contains(t, followOut.String(), "archive v2 is ready")
	out := rebuildOut.String()
	t.Logf("rebuild --wait:\n%s", out)
	require.Contains(t, out, "created archive v2 (schema archive_v2, state building")
	require.Regexp(t, `boundary reached: \d+ events in .*: \d+ events/s`, out)
	require.Contains(t, out, "archive v2 is ready")
	// Resumed from the cursors: after the restart, the worker applied at
	// most what v2 had not applied at the kill (messages to the boundary
	// plus traffic since, minus the rows applied before the kill).
	eventually(10*time.Second, func() bool { return metric(t, addr, "epitaph_projector_applied_events_total", `version="2"`) > 0 }, "metrics")
	applied := metric(t, addr, "epitaph_projector_applied_events_total", `version="2"`)
	var last uint64
	stream, err := js.Stream(ctx, event.StreamName("main"))
	require.NoError(t, err)
	info, err := stream.Info(ctx)
	require.NoError(t, err)
	last = info.State.LastSeq
	require.LessOrEqual(t, applied, float64(int(last)-atKill), "resumed from the cursor, not the start (killed at %d rows)", atKill)

	// compare: the TTL change is the only difference.
	cmpOut, err := runBin(bin, env, "compare", "archive", "1", "2")
	require.Equal(t, 3, exitCode(err), "expires_at differs: exit status 3: %s", cmpOut)
	require.Contains(t, cmpOut, "EQUAL content, but DIFFERENT; expires_at differs on")
	cmpOut, err = runBin(bin, env, "compare", "archive", "1", "2", "--ignore", "expires_at")
	require.NoError(t, err, cmpOut)
	require.Contains(t, cmpOut, "EQUAL content; expires_at differs on")
	t.Logf("compare:\n%s", cmpOut)
	require.Regexp(t, `public\.orders\s+\d+\s+\d+\s+\S+\s+\S+\s+0\s+0\s+0\s+[1-9]`, cmpOut)

	// promote: refused without accepting the difference; then, with a
	// reader in a loop, the views switch atomically.
	pout, err := runBin(bin, env, "promote", "archive", "2")
	require.Equal(t, 3, exitCode(err), pout)
	require.Contains(t, pout, "refusing to promote")
	var upTo string
	require.NoError(t, conn.QueryRow(ctx, `SELECT min(source_lsn)::text FROM epitaph.progress`).Scan(&upTo))
	want := q(`SELECT count(*) FROM archive_v1.rows WHERE commit_lsn <= $1::pg_lsn`, upTo)
	require.Equal(t, want, q(`SELECT count(*) FROM archive_v2.rows WHERE commit_lsn <= $1::pg_lsn`, upTo))
	readerCtx, stopReader := context.WithCancel(ctx)
	var reads atomic.Int64
	readerErr := make(chan error, 1)
	go func() {
		rc, err := pgx.Connect(ctx, url)
		if err != nil {
			readerErr <- err
			return
		}
		defer rc.Close(ctx)
		for readerCtx.Err() == nil {
			var c int
			if err := rc.QueryRow(ctx, `SELECT count(*) FROM archive.rows WHERE commit_lsn <= $1::pg_lsn`, upTo).Scan(&c); err != nil {
				readerErr <- err
				return
			}
			if c != want {
				readerErr <- fmt.Errorf("reader saw %d rows, want %d", c, want)
				return
			}
			reads.Add(1)
		}
		readerErr <- nil
	}()
	pout, err = runBin(bin, env, "promote", "archive", "2", "--ignore", "expires_at")
	require.NoError(t, err, pout)
	require.Contains(t, pout, "archive v2 is live")
	view := func() string {
		var def string
		require.NoError(t, conn.QueryRow(ctx, `SELECT definition FROM pg_views WHERE schemaname = 'archive' AND viewname = 'rows'`).Scan(&def))
		return def
	}
	require.Contains(t, view(), "archive_v2.rows")

	// Read your deletes: delete, take the current LSN, wait, read.
	deleted := src.delete()
	current := src.heartbeat()
	wout, err := runBin(bin, env, "wait", "--lsn", current.String(), "--timeout", "30s")
	require.NoError(t, err, wout)
	require.Equal(t, 1, q(`SELECT count(*) FROM archive.rows WHERE commit_lsn = $1::pg_lsn`, deleted.String()))
	resp, err := http.Get(fmt.Sprintf("http://%s/wait?lsn=%s&timeout=10s", addr, src.heartbeat()))
	require.NoError(t, err)
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode, string(body))
	require.Contains(t, string(body), `"done":true`)
	resp, err = http.Get(fmt.Sprintf("http://%s/wait?lsn=%s&timeout=200ms", addr, (current + 0x10000000).String()))
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusGatewayTimeout, resp.StatusCode)

	// rollback and roll forward.
	rout, err := runBin(bin, env, "rollback", "archive")
	require.NoError(t, err, rout)
	require.Contains(t, rout, "archive v1 is live again")
	require.Contains(t, view(), "archive_v1.rows")
	pout, err = runBin(bin, env, "promote", "archive", "2", "--ignore", "expires_at")
	require.NoError(t, err, pout)
	require.Contains(t, view(), "archive_v2.rows")
	eventually(10*time.Second, func() bool { return reads.Load() > 10 }, "reader ran")
	stopReader()
	require.NoError(t, <-readerErr)

	// status shows both versions with their lifecycle.
	sout, err := runBin(bin, env, "status")
	require.NoError(t, err, sout)
	t.Logf("status:\n%s", sout)
	require.Contains(t, sout, "archive v1 ready: boundary seq 0")
	require.Contains(t, sout, fmt.Sprintf("archive v2 live: boundary seq %d", boundary))

	// retire: never the live one; v1 with its schema.
	rout, err = runBin(bin, env, "retire", "archive", "2")
	require.Error(t, err, rout)
	stopTraffic()
	<-trafficDone
	// --drop asks for confirmation; without a terminal it needs --yes.
	rout, err = runBin(bin, env, "retire", "archive", "1", "--drop")
	require.Equal(t, 2, exitCode(err), rout)
	require.Contains(t, rout, "pass --yes")
	require.Equal(t, 1, q(`SELECT count(*) FROM pg_namespace WHERE nspname = 'archive_v1'`))
	group, err := version.DefaultGroup(ctx, conn)
	require.NoError(t, err)
	var consumer string
	require.NoError(t, conn.QueryRow(ctx, `SELECT consumer FROM epitaph.progress WHERE projection = 'archive' AND version = 1 AND partition = 0`).Scan(&consumer))
	require.True(t, version.IsUnitConsumer(consumer, progress.Key{Projection: "archive", Version: 1}, group), "recorded consumer %s", consumer)
	_, err = stream.Consumer(ctx, consumer)
	require.NoError(t, err, "the consumer recorded on the progress row exists before retire")
	rout, err = runBin(bin, env, "retire", "archive", "1", "--drop", "--yes")
	require.NoError(t, err, rout)
	require.Contains(t, rout, "archive v1 retired")
	require.Equal(t, 0, q(`SELECT count(*) FROM pg_namespace WHERE nspname = 'archive_v1'`))
	_, err = stream.Consumer(ctx, consumer)
	require.ErrorIs(t, err, jetstream.ErrConsumerNotFound)

	// The archive is complete: every deleted row, once, orders expiring.
	total := src.published()
	eventually(60*time.Second, func() bool { return q(`SELECT count(*) FROM archive.rows`) == total },
		"archive has %d rows, want %d", q(`SELECT count(*) FROM archive.rows`), total)
	require.Equal(t, total, q(`SELECT count(DISTINCT (source, commit_lsn, seq)) FROM archive.rows`))
	require.Equal(t, total, q(`SELECT count(*) FROM archive.rows WHERE expires_at = commit_time + interval '24 hours'`))
	require.True(t, regexp.MustCompile(`archive v2 building`).MatchString(out) || strings.Contains(out, "archive v2 catching_up"), out)
	require.NoError(t, w.Process.Signal(syscall.SIGTERM))
	require.NoError(t, w.Wait())
}
