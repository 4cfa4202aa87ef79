package main

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/projection"
)

// TestRestoreCommand: the command's plan, restore, conflict and usage
// answers and exit codes, against an archive the projector filled (the
// target is the source database here, as when EPITAPH_TARGET_URL is
// unset).
func TestRestoreCommand(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testenv.NewDatabase(t)
	testenv.Exec(t, url, `CREATE TABLE public.orders (id bigint PRIMARY KEY, total numeric(12,2), score float8)`)
	n := testenv.NewNATS(t)
	_, js := n.Connect(t)
	createMainStream(t, js, 1)
	lsn := event.LSN(0x1000100)
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
	cols := []event.Column{{Name: "id", Type: "bigint", PK: true}, {Name: "total", Type: "numeric(12,2)"}, {Name: "score", Type: "double precision"}}
	for seq, id := range []int{7, 8} {
		pub(event.DeleteSubject("main", 0, "public", "orders"), event.MsgID("main", lsn, seq), &event.Event{
			Op: event.OpDelete, Source: "main", Schema: "public", Table: "orders", XID: 99, CommitLSN: lsn, Seq: seq,
			CommitTime: time.Now().UTC(), Identity: event.IdentityFull, Columns: cols,
			Key: json.RawMessage(fmt.Sprintf(`{"id":%d}`, id)), Row: json.RawMessage(fmt.Sprintf(`{"id":%d,"total":"1.50","score":-0}`, id))})
	}
	pub(event.CommitSubject("main", 0), event.CommitMsgID("main", lsn), &event.Event{
		Op: event.OpCommit, Source: "main", XID: 99, CommitLSN: lsn, CommitTime: time.Now().UTC(), Rows: 2,
		Tables: map[string]int{"public.orders": 2}})
	svc, err := projection.New(projection.Config{TargetURL: url, NATSURL: n.URL, SourceName: "main", WorkerID: "w1",
		LeaseTTL: 3 * time.Second, FetchWait: 100 * time.Millisecond}, projection.WithLogger(slog.New(slog.DiscardHandler)),
		projection.WithRegistry(prometheus.NewRegistry()))
	require.NoError(t, err)
	require.NoError(t, svc.Start(ctx))
	t.Cleanup(func() { require.NoError(t, svc.Stop(context.Background())) })
	conn, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer conn.Close(ctx)
	corr := event.CorrelationID("main", 99, lsn)
	require.Eventually(t, func() bool {
		var c int
		return conn.QueryRow(ctx, `SELECT count(*) FROM archive.rows WHERE correlation_id = $1`, corr).Scan(&c) == nil && c == 2
	}, 60*time.Second, 50*time.Millisecond)

	vars := map[string]string{"EPITAPH_SOURCE_URL": url, "USER": "carol"}
	code, out, stderr := projector(t, vars, "restore", "--correlation", corr, "--dry-run")
	require.Equal(t, 0, code, stderr)
	require.Contains(t, out, "plan for "+corr+" (2 rows, on conflict: abort)")
	// --source-url on the command line is the target's default too, as
	// EPITAPH_SOURCE_URL is.
	code, flagOut, stderr := projector(t, map[string]string{"USER": "carol"}, "restore", "--source-url", url, "--correlation", corr, "--dry-run")
	require.Equal(t, 0, code, stderr)
	require.Equal(t, out, flagOut)
	require.Contains(t, out, "1. public.orders: 2 rows")
	require.Contains(t, out, "dry run: nothing written")
	orders := func() []string {
		rows, err := conn.Query(ctx, `SELECT t::text FROM public.orders t ORDER BY id`)
		require.NoError(t, err)
		out, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		return out
	}
	require.Empty(t, orders())

	code, out, stderr = projector(t, vars, "restore", "--correlation", corr, "--table", "public.orders", "--key", `{"id": 8}`, "--actor", "dave", "--json")
	require.Equal(t, 0, code, stderr)
	var res map[string]any
	require.NoError(t, json.Unmarshal([]byte(out), &res), out)
	require.Equal(t, "restored", res["outcome"])
	require.EqualValues(t, 1, res["restored"])
	require.Equal(t, []string{"(8,1.50,-0)"}, orders())

	code, out, stderr = projector(t, vars, "restore", "--correlation", corr)
	require.Equal(t, 3, code, out)
	require.Contains(t, stderr, `restore aborted: 1 rows exist in the source (public.orders {"id":8})`)
	require.Equal(t, []string{"(8,1.50,-0)"}, orders(), "the abort wrote nothing")
	code, out, stderr = projector(t, vars, "restore", "--correlation", corr, "--on-conflict", "skip")
	require.Equal(t, 0, code, stderr)
	require.Contains(t, out, "restored 1 rows, skipped 1")
	require.Equal(t, []string{"(7,1.50,-0)", "(8,1.50,-0)"}, orders())

	var actors []string
	rows, err := conn.Query(ctx, `SELECT actor || ' ' || outcome || ' ' || rows_restored FROM epitaph.restores ORDER BY id`)
	require.NoError(t, err)
	actors, err = pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Len(t, actors, 3)
	require.Equal(t, "dave restored 1", actors[0])
	require.Contains(t, actors[1], " conflict 0")
	require.Contains(t, actors[2], " restored 1")

	code, _, stderr = projector(t, vars, "restore", "--correlation", "main:1:0/0")
	require.Equal(t, 3, code)
	require.Contains(t, stderr, "cannot restore: no archived rows of main:1:0/0 match")

	for _, tc := range []struct {
		args []string
		msg  string
	}{
		{[]string{"restore"}, "restore needs --correlation ID"},
		{[]string{"restore", "--correlation", corr, "--on-conflict", "replace"}, `--on-conflict "replace": want abort or skip`},
		{[]string{"restore", "--correlation", corr, "--key", `{"id":1}`}, "--key needs --table schema.table"},
		{[]string{"restore", "--correlation", corr, "--table", "public.orders", "--key", `[1]`}, `--key "[1]": want a JSON object`},
		{[]string{"restore", "--correlation", corr, "--table", "orders", "--key", `{"id":1}`}, `--table "orders": want schema.table`},
		{[]string{"restore", "--correlation", corr, "--root-key", `{"id":1}`, "--key", `{"id":1}`}, "--root-key and --key exclude each other"},
		{[]string{"restore", "--correlation", corr, "--source-tcp-timeout", "500ms"}, "--source-tcp-timeout 500ms: use 1s to 24h"},
	} {
		code, _, stderr := projector(t, vars, tc.args...)
		require.Equal(t, 2, code, "%v: %s", tc.args, stderr)
		require.Contains(t, stderr, tc.msg, strconv.Quote(stderr))
	}

	// A path to the source that dies silently while the restore waits for
	// an answer (its read of the existing keys waits behind a lock; the
	// lock is released once every path through the proxy is dead): with
	// --source-tcp-timeout 2s the restore fails within seconds, nothing
	// written, instead of waiting for TCP keepalive to give up (about two
	// and a half minutes; this test's bound is 20 s).
	if runtime.GOOS != "linux" {
		return // TCP_USER_TIMEOUT and the proxy's socket filters are Linux's
	}
	proxy, viaProxy := testenv.ProxiedURL(t, url)
	lock, err := conn.Begin(ctx)
	require.NoError(t, err)
	_, err = lock.Exec(ctx, `LOCK TABLE public.orders IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)
	err = testenv.AnswerLostOnADeadPath(t, url, "%orders%", proxy, lock, func() error {
		code, out, stderr := projector(t, map[string]string{"EPITAPH_TARGET_URL": url, "EPITAPH_SOURCE_URL": testenv.NoSearchPath(viaProxy),
			"EPITAPH_SOURCE_TCP_TIMEOUT": "2s", "USER": "erin"}, "restore", "--correlation", corr, "--on-conflict", "skip")
		if code == 0 {
			return nil
		}
		return fmt.Errorf("exit %d: %s%s", code, out, stderr)
	})
	require.Error(t, err, "the answer was lost with the path")
	require.Contains(t, err.Error(), "timed out")
	require.Equal(t, []string{"(7,1.50,-0)", "(8,1.50,-0)"}, orders(), "nothing written")
}
