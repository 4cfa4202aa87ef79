package projection_test

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/projection"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/status"
)

// statusRow is the reader's view of archive.status for the live version.
type statusRow struct {
	ready      bool
	complete   *string
	gapsOpen   int
	truncates  int
	quarantine int
	reasons    []string
}

func readStatus(t *testing.T, c *pgx.Conn) statusRow {
	t.Helper()
	s, err := tryStatus(c)
	require.NoError(t, err)
	return s
}

func tryStatus(c *pgx.Conn) (statusRow, error) {
	var s statusRow
	err := c.QueryRow(context.Background(), `SELECT ready, complete_up_to_lsn::text, gaps_unacknowledged,
		truncates, quarantine_open, not_ready_reasons FROM archive.status WHERE state = 'live'`).
		Scan(&s.ready, &s.complete, &s.gapsOpen, &s.truncates, &s.quarantine, &s.reasons)
	return s, err
}

// readyNow reports whether archive.status says ready (false while the
// view does not exist yet).
func readyNow(c *pgx.Conn) bool {
	s, err := tryStatus(c)
	return err == nil && s.ready
}

// gap publishes a gap event (deletes lost upstream between from and to) to
// every partition, as the capture does after --recreate-slot.
func (e *env) gap(from, to event.LSN) {
	e.t.Helper()
	for p := 0; p < e.partitions; p++ {
		ev := &event.Event{Op: event.OpGap, Source: src, Partition: p, FromLSN: from, ToLSN: to, LSN: to,
			Reason: "slot recreated", Time: time.Now().UTC()}
		_, err := e.pubMsg(context.Background(), e.msg(event.GapSubject(src, p), event.GapMsgID(src, from, to, p), ev))
		require.NoError(e.t, err)
	}
}

// A gap from a recreated slot is one lost_upstream row in archive.gaps; the
// archive is then not ready, complete only up to where the gap starts, and
// waiting for an LSN inside it fails at once naming the gap; acknowledging it
// makes the archive ready and complete again.
func TestGapMakesArchiveNotReadyUntilAcknowledged(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 3)
	s := e.start(e.config("w1"))
	c := e.conn()
	ctx := context.Background()

	e.publish(e.nextTx(orderRows(1, 2)...))
	before := e.heartbeat()
	eventually(t, 10*time.Second, func() bool { return readyNow(c) }, "ready before the gap")

	to := event.LSN(e.lsn.Add(0x10000))
	e.gap(before, to)
	e.publish(e.nextTx(orderRows(2, 1)...))
	after := e.heartbeat()

	// The three copies make one row (it concerns every partition).
	eventually(t, 10*time.Second, func() bool {
		return count(t, c, `SELECT count(*) FROM epitaph.progress WHERE source_lsn = $1::pg_lsn`, after.String()) == 3
	})
	type gapRow struct {
		Kind               string
		Schema, Table      *string
		Partition          *int
		From, To           string
		Acknowledged       bool
		DetectedAtRecently bool
	}
	rows, err := c.Query(ctx, `SELECT kind, schema_name, table_name, partition, from_lsn::text, to_lsn::text,
		acknowledged_at IS NOT NULL, detected_at > now() - interval '1 minute' FROM archive.gaps`)
	require.NoError(t, err)
	gaps, err := pgx.CollectRows(rows, pgx.RowToStructByPos[gapRow])
	require.NoError(t, err)
	require.Equal(t, []gapRow{{Kind: "lost_upstream", From: before.String(), To: to.String(), DetectedAtRecently: true}}, gaps)
	require.Equal(t, 5, count(t, c, `SELECT count(*) FROM archive.rows`), "rows on both sides of the gap are archived")

	st := readStatus(t, c)
	require.False(t, st.ready)
	require.Equal(t, 1, st.gapsOpen)
	require.Contains(t, st.reasons, "1 unacknowledged gaps")
	require.NotNil(t, st.complete)
	require.Equal(t, before.String(), *st.complete, "complete up to where the gap starts, not the watermark")

	// Up to the gap's start the archive is complete; inside it, it cannot be.
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	_, err = status.WaitComplete(wctx, s.Pool(), archive.Projection, before, 0)
	require.NoError(t, err)
	_, err = status.WaitComplete(wctx, s.Pool(), archive.Projection, before+0x100, 0)
	var ie *status.IncompleteError
	require.ErrorAs(t, err, &ie)
	require.Len(t, ie.Blockers, 1)
	require.NotNil(t, ie.Blockers[0].Gap)
	require.Contains(t, err.Error(), "lost_upstream")
	require.Contains(t, err.Error(), "after "+before.String()+" up to "+to.String())

	// Acknowledging needs a reason; then the archive is ready and complete.
	vg, err := status.ListGaps(ctx, s.Pool(), archive.Projection)
	require.NoError(t, err)
	require.Len(t, vg, 1)
	require.Len(t, vg[0].Gaps, 1)
	id := vg[0].Gaps[0].ID
	_, err = status.AckGap(ctx, s.Pool(), archive.Projection, 0, id, "  ")
	require.ErrorContains(t, err, "reason is required")
	g, err := status.AckGap(ctx, s.Pool(), archive.Projection, 0, id, "slot dropped by the DBA on purpose")
	require.NoError(t, err)
	require.NotNil(t, g.AcknowledgedAt)
	require.Equal(t, "slot dropped by the DBA on purpose", *g.AckReason)
	_, err = status.AckGap(ctx, s.Pool(), archive.Projection, 0, id, "again")
	require.ErrorContains(t, err, "already acknowledged")
	_, err = status.AckGap(ctx, s.Pool(), archive.Projection, 0, id+100, "no such")
	require.ErrorIs(t, err, status.ErrGapNotFound)

	eventually(t, 10*time.Second, func() bool { return readyNow(c) }, "ready after the ack")
	st = readStatus(t, c)
	require.Equal(t, after.String(), *st.complete)
	require.Zero(t, st.gapsOpen)
	r, err := status.WaitComplete(wctx, s.Pool(), archive.Projection, before+0x100, 0)
	require.NoError(t, err)
	require.Equal(t, after.String(), r.CompleteUpToLSN)

	// The status document and metrics say the same.
	sd, err := s.Status(ctx)
	require.NoError(t, err)
	require.Len(t, sd.Versions, 1)
	require.Len(t, sd.Versions[0].Gaps, 1)
	require.NotNil(t, sd.Versions[0].Gaps[0].AcknowledgedAt)
	eventually(t, 10*time.Second, func() bool {
		return gapMetric(t, s, "lost_upstream", "true") == 1 && gapMetric(t, s, "lost_upstream", "false") == 0
	})
}

// A TRUNCATE is recorded as an informational gap row of its table and
// partition; it does not make the archive not ready.
func TestTruncateIsAGapRowThatDoesNotBlock(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	e.start(e.config("w1"))
	c := e.conn()
	ctx := context.Background()

	tx := e.nextTx(orderRows(1, 1)...)
	msgs := e.messages(tx)
	trunc := &event.Event{Op: event.OpTruncate, Source: src, Schema: "public", Table: "order_lines", XID: tx.xid,
		CommitLSN: tx.lsn, CommitTime: tx.time, Seq: 2}
	commit := msgs[len(msgs)-1]
	msgs = append(msgs[:len(msgs)-1], e.msg(event.TruncateSubject(src, tx.partition, "public", "order_lines"),
		event.MsgID(src, tx.lsn, 2), trunc), commit)
	for _, m := range msgs {
		_, err := e.pubMsg(ctx, m)
		require.NoError(t, err)
	}
	hb := e.heartbeat()
	eventually(t, 10*time.Second, func() bool {
		st, err := tryStatus(c)
		return err == nil && st.ready && st.complete != nil && *st.complete == hb.String()
	})
	var kind, schema, table, from, to string
	var partition int
	require.NoError(t, c.QueryRow(ctx, `SELECT kind, schema_name, table_name, partition, from_lsn::text, to_lsn::text
		FROM archive.gaps`).Scan(&kind, &schema, &table, &partition, &from, &to))
	require.Equal(t, []any{"truncate", "public", "order_lines", tx.partition, tx.lsn.String(), tx.lsn.String()},
		[]any{kind, schema, table, partition, from, to})
	st := readStatus(t, c)
	require.Equal(t, 1, st.truncates)
	require.Zero(t, st.gapsOpen)
	require.Equal(t, 2, count(t, c, `SELECT count(*) FROM archive.rows`))
}

// While the projector lags (its apply blocked behind a lock, 1,200 events
// pending), archive.status is not ready and says why, though every
// partition is leased and had advanced; once caught up it is ready.
func TestNotReadyWhileLagging(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	cfg := e.config("w1")
	cfg.BatchSize = 20
	e.start(cfg)
	c := e.conn()
	ctx := context.Background()
	e.publish(e.nextTx(orderRows(1, 0)...))
	e.heartbeat()
	eventually(t, 10*time.Second, func() bool { return readyNow(c) }, "ready when caught up")

	// Hold the archive table so the apply waits, then publish 1,200 rows.
	lock, err := pgx.Connect(ctx, e.url)
	require.NoError(t, err)
	defer lock.Close(ctx)
	ltx, err := lock.Begin(ctx)
	require.NoError(t, err)
	_, err = ltx.Exec(ctx, `LOCK TABLE archive_v1.rows IN EXCLUSIVE MODE`)
	require.NoError(t, err)
	var msgs []*nats.Msg
	for i := 0; i < 120; i++ {
		msgs = append(msgs, e.messages(e.nextTx(orderRows(100+i, 9)...))...)
	}
	e.publishAll(msgs)
	// The lag is a reason; on a loaded machine the blocked apply may also
	// time out on the lock and add a transient reason of its own.
	eventually(t, 20*time.Second, func() bool {
		st := readStatus(t, c)
		if st.ready {
			return false
		}
		for _, r := range st.reasons {
			if strings.HasPrefix(r, "lag ") {
				return true
			}
		}
		return false
	}, "not ready, because of the lag")
	require.Less(t, count(t, c, `SELECT count(*) FROM archive.rows`), 1200, "still behind")
	require.NoError(t, ltx.Rollback(ctx))

	eventually(t, 60*time.Second, func() bool {
		return count(t, c, `SELECT count(*) FROM archive.rows`) == 1201 && readyNow(c)
	}, "ready once caught up")
}

// An open quarantined event makes waiting for an LSN after it fail at once
// (naming the entry), while an LSN before it is complete; a timeout names
// where the archive is (not 0/0).
func TestWaitQuarantineAndTimeout(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	s := e.start(e.config("w1"))
	c := e.conn()
	ctx := context.Background()
	e.publish(e.nextTx(orderRows(1, 1)...))
	hb := e.heartbeat()
	eventually(t, 10*time.Second, func() bool {
		st, err := tryStatus(c)
		return err == nil && st.complete != nil && *st.complete == hb.String()
	})

	// Timeout: an LSN far ahead; the error names where the archive is.
	wctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	defer cancel()
	_, err := status.WaitComplete(wctx, s.Pool(), archive.Projection, hb+0x100000, 0)
	var te *status.TimeoutError
	require.ErrorAs(t, err, &te)
	require.True(t, errors.Is(err, context.DeadlineExceeded))
	require.Contains(t, err.Error(), "complete up to "+hb.String())

	// Garbage in the partition, then more traffic.
	m := nats.NewMsg(event.CommitSubject(src, 0))
	m.Data = []byte("not json")
	_, err = e.js.PublishMsg(ctx, m)
	require.NoError(t, err)
	e.publish(e.nextTx(orderRows(2, 1)...))
	hb2 := e.heartbeat()
	eventually(t, 10*time.Second, func() bool {
		return count(t, c, `SELECT count(*) FROM epitaph.progress WHERE source_lsn = $1::pg_lsn`, hb2.String()) == 1
	})
	st := readStatus(t, c)
	require.False(t, st.ready)
	require.Equal(t, 1, st.quarantine)
	require.Equal(t, hb.String(), *st.complete, "complete only up to where the quarantined event was met")

	wctx2, cancel2 := context.WithTimeout(ctx, 30*time.Second)
	defer cancel2()
	_, err = status.WaitComplete(wctx2, s.Pool(), archive.Projection, hb, 0)
	require.NoError(t, err)
	_, err = status.WaitComplete(wctx2, s.Pool(), archive.Projection, hb2, 0)
	var ie *status.IncompleteError
	require.ErrorAs(t, err, &ie)
	require.Len(t, ie.Blockers, 1)
	require.NotZero(t, ie.Blockers[0].Quarantine)
	require.Contains(t, err.Error(), "malformed")
	require.Contains(t, err.Error(), "after "+hb.String())

	// GET /wait answers the same: 200 before the quarantined event, 409
	// after it naming it, 504 on a timeout naming where the archive is.
	srv := httptest.NewServer(status.WaitHandler(s.Pool(), archive.Projection))
	defer srv.Close()
	getWait := func(lsn event.LSN, timeout string) (int, map[string]any) {
		resp, err := http.Get(srv.URL + "?lsn=" + lsn.String() + "&timeout=" + timeout)
		require.NoError(t, err)
		defer resp.Body.Close()
		var body map[string]any
		require.NoError(t, json.NewDecoder(resp.Body).Decode(&body))
		return resp.StatusCode, body
	}
	code, body := getWait(hb, "10s")
	require.Equal(t, http.StatusOK, code, body)
	require.Equal(t, true, body["done"])
	require.Equal(t, hb.String(), body["complete_up_to"])
	code, body = getWait(hb2, "10s")
	require.Equal(t, http.StatusConflict, code, body)
	require.Len(t, body["blockers"], 1)
	require.Contains(t, body["blockers"].([]any)[0], "malformed")
	// Discarded, the entry no longer blocks: the same LSN is complete.
	_, err = c.Exec(ctx, `UPDATE epitaph.quarantine SET status = 'discarded', resolved_at = now(), resolution_reason = 'test'`)
	require.NoError(t, err)
	code, body = getWait(hb2, "10s")
	require.Equal(t, http.StatusOK, code, body)
	code, body = getWait(hb2+0x100000, "300ms")
	require.Equal(t, http.StatusGatewayTimeout, code, body)
	require.Contains(t, body["error"], "complete up to "+hb2.String())
}

// gapMetric reads epitaph_projector_gaps for the live version 1.
func gapMetric(t *testing.T, s *projection.Service, kind, acked string) float64 {
	t.Helper()
	mfs, err := s.Registry().Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != "epitaph_projector_gaps" {
			continue
		}
		for _, m := range mf.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			if labels["version"] == "1" && labels["kind"] == kind && labels["acknowledged"] == acked {
				return m.GetGauge().GetValue()
			}
		}
	}
	return 0
}

// Waiting on a target no projector has set up yet is a timeout (exit 2),
// not an error: the projector may be starting.
func TestWaitBeforeTheTargetIsSetUp(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, testenv.NewDatabase(t))
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	wctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	_, err = status.WaitComplete(wctx, pool, archive.Projection, 0x1000, 0)
	var te *status.TimeoutError
	require.ErrorAs(t, err, &te)
	require.Contains(t, err.Error(), "no live version")
}

// Lag the workers have not sampled is unknown, never "caught up": with no
// sample every partition is leased and started, yet the archive is not
// ready and says why.
func TestNotReadyWithoutALagSample(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	cfg := e.config("w1")
	cfg.StatusInterval = time.Hour // no sample during the test
	e.start(cfg)
	c := e.conn()
	e.publish(e.nextTx(orderRows(1, 1)...))
	hb := e.heartbeat()
	eventually(t, 10*time.Second, func() bool {
		return count(t, c, `SELECT count(*) FROM epitaph.progress WHERE source_lsn = $1::pg_lsn AND owner = 'w1'`, hb.String()) == 2
	})
	st := readStatus(t, c)
	require.False(t, st.ready)
	require.Equal(t, []string{"lag not sampled recently for 2 of 2 partitions"}, st.reasons)
	require.Equal(t, hb.String(), *st.complete, "completeness does not depend on the lag")
}

// A stream deleted and made anew under the same name starts its sequences
// again and holds nothing of the old one: what the old stream held past a
// partition's cursor was never applied. Each partition records a
// removed_from_stream gap (open-ended, from its watermark), so the archive
// is not ready until the gaps are acknowledged; the new stream's
// transactions are archived all the same.
func TestRecreatedStreamIsAGap(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	c := e.conn()
	ctx := context.Background()
	s := e.start(e.config("w1"))
	e.publish(e.nextTx(orderRows(1, 2)...))
	e.publish(e.nextTx(orderRows(2, 2)...))
	before := e.heartbeat()
	eventually(t, 20*time.Second, func() bool { return readyNow(c) }, "ready before the stream is made anew")
	require.Equal(t, 2, count(t, c, `SELECT count(*) FROM epitaph.progress WHERE stream_created IS NOT NULL`),
		"each partition recorded the stream its cursor counts in")
	require.NoError(t, s.Stop(ctx))

	require.NoError(t, e.js.DeleteStream(ctx, event.StreamName(src)))
	e.createStream()
	e.publish(e.nextTx(orderRows(3, 2)...))
	after := e.heartbeat()
	s = e.start(e.config("w2"))

	eventually(t, 30*time.Second, func() bool {
		return count(t, c, `SELECT count(*) FROM archive_v1.gaps WHERE kind = 'removed_from_stream'`) == 2
	}, "one gap per partition")
	eventually(t, 30*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 9 },
		"the new stream's transaction is archived")
	require.Equal(t, 2, count(t, c, `SELECT count(*) FROM archive_v1.gaps WHERE kind = 'removed_from_stream'
		AND from_lsn = $1::pg_lsn AND to_lsn IS NULL AND from_seq IS NULL AND acknowledged_at IS NULL`, before.String()))
	eventually(t, 20*time.Second, func() bool {
		return count(t, c, `SELECT count(*) FROM epitaph.progress WHERE source_lsn = $1::pg_lsn`, after.String()) == 2
	}, "both partitions reached the new stream's heartbeat")
	st := readStatus(t, c)
	require.False(t, st.ready, "a made-anew stream is not a ready archive")
	require.Equal(t, 2, st.gapsOpen)
	require.Equal(t, before.String(), *st.complete, "complete only up to where the old stream was left")

	// Acknowledged, the archive is ready again; a restart records no more.
	vg, err := status.ListGaps(ctx, s.Pool(), archive.Projection)
	require.NoError(t, err)
	require.Len(t, vg, 1)
	for _, g := range vg[0].Gaps {
		_, err := status.AckGap(ctx, s.Pool(), archive.Projection, 0, g.ID, "stream re-created on purpose in a test")
		require.NoError(t, err)
	}
	require.NoError(t, s.Stop(ctx))
	e.start(e.config("w3"))
	eventually(t, 20*time.Second, func() bool { return readyNow(c) }, "ready after the acks")
	require.Equal(t, 2, count(t, c, `SELECT count(*) FROM archive_v1.gaps`), "no new gap for the same stream")
}

// A truncate in a transaction that spans pages (its commit arrives in a
// later page) is recorded once its commit verifies, not dropped, and is
// not shown before.
func TestTruncateInATransactionSpanningPagesIsRecorded(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	cfg := e.config("w1")
	cfg.BatchSize = 5
	e.start(cfg)
	c := e.conn()
	ctx := context.Background()

	tx := e.nextTx(orderRows(1, 8)...) // 9 rows: the commit is two pages after the truncate
	msgs := e.messages(tx)
	trunc := &event.Event{Op: event.OpTruncate, Source: src, Schema: "public", Table: "order_lines", XID: tx.xid,
		CommitLSN: tx.lsn, CommitTime: tx.time, Seq: len(tx.rows)}
	commit := msgs[len(msgs)-1]
	msgs = append([]*nats.Msg{msgs[0], e.msg(event.TruncateSubject(src, tx.partition, "public", "order_lines"),
		event.MsgID(src, tx.lsn, len(tx.rows)), trunc)}, msgs[1:]...)
	for _, m := range msgs[:len(msgs)-1] {
		_, err := e.pubMsg(ctx, m)
		require.NoError(t, err)
	}
	eventually(t, 20*time.Second, func() bool {
		return count(t, c, `SELECT count(*) FROM archive_v1.pending_truncates`) == 1
	}, "the truncate waits for its commit")
	require.Zero(t, count(t, c, `SELECT count(*) FROM archive.gaps`), "not shown before it is verified")
	_, err := e.pubMsg(ctx, commit)
	require.NoError(t, err)
	hb := e.heartbeat()
	eventually(t, 20*time.Second, func() bool {
		st, err := tryStatus(c)
		return err == nil && st.ready && st.complete != nil && *st.complete == hb.String()
	})
	require.Equal(t, 1, count(t, c, `SELECT count(*) FROM archive.gaps WHERE kind = 'truncate'
		AND schema_name = 'public' AND table_name = 'order_lines' AND from_lsn = $1::pg_lsn`, tx.lsn.String()))
	require.Zero(t, count(t, c, `SELECT count(*) FROM archive_v1.pending_truncates`))
	require.Equal(t, 9, count(t, c, `SELECT count(*) FROM archive.rows`))
	require.Equal(t, 1, readStatus(t, c).truncates)
}

// A projector started over a backlog is not ready until its workers have
// measured the lag since they took their leases: the previous run's last
// sample ("caught up", still fresh when the restart is quick) says nothing
// of what arrived while no worker ran. Sampled every 20 ms while the new
// run catches up, archive.status is never ready while more rows are
// missing than ready's lag threshold allows.
func TestNotReadyOverABacklogAfterRestart(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	cfg := e.config("w1")
	cfg.StatusInterval = 2 * time.Second // a sample stays fresh for 6 s
	cfg.ReadyMaxLag = 100
	first, err := projection.New(cfg, projection.WithLogger(testLogger(t)), projection.WithRegistry(prometheus.NewRegistry()))
	require.NoError(t, err)
	ctx := context.Background()
	require.NoError(t, first.Start(ctx))
	c := e.conn()
	e.publish(e.nextTx(orderRows(1, 0)...))
	e.heartbeat()
	eventually(t, 20*time.Second, func() bool { return readyNow(c) }, "ready when caught up")
	require.NoError(t, first.Stop(ctx))

	// 5,000 rows deleted while no projector ran.
	var msgs []*nats.Msg
	for i := 0; i < 500; i++ {
		msgs = append(msgs, e.messages(e.nextTx(orderRows(100+i, 9)...))...)
	}
	e.publishAll(msgs)
	e.heartbeat()
	const want = 1 + 5000

	// The apply waits behind a lock at first, so the window in which the
	// stale sample would be believed cannot be missed.
	lock, err := pgx.Connect(ctx, e.url)
	require.NoError(t, err)
	defer lock.Close(ctx)
	ltx, err := lock.Begin(ctx)
	require.NoError(t, err)
	_, err = ltx.Exec(ctx, `LOCK TABLE archive_v1.rows IN EXCLUSIVE MODE`)
	require.NoError(t, err)
	e.start(cfg)
	released := false
	deadline := time.Now().Add(90 * time.Second)
	samples, readySamples := 0, 0
	for {
		require.True(t, time.Now().Before(deadline), "caught up and ready within 90 s")
		if !released && samples >= 100 { // 2 s under the lock
			require.NoError(t, ltx.Rollback(ctx))
			released = true
		}
		st, err := tryStatus(c)
		require.NoError(t, err)
		n := count(t, c, `SELECT count(*) FROM archive.rows`)
		samples++
		if st.ready {
			readySamples++
			require.LessOrEqual(t, want-n, int(cfg.ReadyMaxLag),
				"sample %d: ready while %d of %d rows are missing (reasons %v)", samples, want-n, want, st.reasons)
			if released && n == want {
				break
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	require.Positive(t, readySamples)
}
