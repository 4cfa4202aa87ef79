package e2e_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/bench"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/internal/workload"
)

// TestForgedIDsPastTheWindowNeverDisplaceTheRealTransaction is the
// projector half of the short dedupe window, through the real
// binaries on a broker open to any writer: while the capture is down, a
// hostile client takes the ids of the commit of a transaction the capture
// has not published yet and of the next mark's copies (read from the slot,
// as predictable as they are), and waits until they are past the stream's
// dedupe window (the capture's default, 1 s). The restarted capture
// publishes the real messages beside the forgeries, under the same ids
// with the signing key's tag (event.MsgIDTagger);
// the projector archives the transaction exactly once, row by row,
// quarantines every forgery as unauthenticated, and the real marks (not
// the forged ones) move every partition's watermark.
func TestForgedIDsPastTheWindowNeverDisplaceTheRealTransaction(t *testing.T) {
	t.Parallel()
	bins := binaries(t)
	seed := testSeed(t)
	url := testenv.NewDatabase(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	require.NoError(t, workload.Setup(ctx, url))
	_, err := workload.Seed(ctx, url, workload.SeedConfig{Customers: 20, OrdersPerCustomer: 4})
	require.NoError(t, err)

	broker := testenv.NewNATS(t) // external, no auth: anyone may publish
	_, js := broker.Connect(t)
	metrics, err := bench.LocalAddr()
	require.NoError(t, err)
	const slot = "epitaph_e2e_window"
	// No heartbeats: the only marks are the test's, so a watermark at the
	// mark's LSN was moved by the real mark.
	dataDir := t.TempDir()
	cenv := joinEnv(bench.CaptureEnv(url, broker.URL, "", dataDir, metrics, "main", slot), "EPITAPH_HEARTBEAT_INTERVAL=-1s")
	capture := supervise(t, "capture", bins["capture"], cenv, seed)
	watch, err := bench.WatchStream(broker.URL, "main")
	require.NoError(t, err)
	defer watch.Close()
	require.NoError(t, bench.WaitCaptureReady(ctx, watch, url, slot, captureReadyTimeout, nil))
	workers := superviseProjectors(t, bins["projector"], url, broker.URL, 1, seed)
	require.NoError(t, workload.WaitFor(ctx, time.Minute, 100*time.Millisecond, func(ctx context.Context) (bool, error) {
		n, err := bench.Count(ctx, url, "SELECT count(*) FROM epitaph.progress")
		return n >= 8, err
	}))

	archived := func(want int) {
		t.Helper()
		err := workload.WaitFor(ctx, 3*time.Minute, 250*time.Millisecond, func(ctx context.Context) (bool, error) {
			n, err := bench.Count(ctx, url, "SELECT count(*) FROM archive.rows WHERE source = 'main'")
			return n >= int64(want), err
		})
		require.NoError(t, err, "%d rows archived\n%s", want, pipelineState(ctx, url, watch))
	}
	testenv.Exec(t, url, `DELETE FROM public.orders WHERE id <= 10`)
	expected, err := workload.Expected(ctx, url)
	require.NoError(t, err)
	archived(len(expected))

	// With the capture down: the transaction and the mark the forgeries
	// are for, their LSNs from the slot (pgoutput's Begin carries the
	// commit LSN).
	capture.Stop()
	testenv.Exec(t, url, `DELETE FROM public.orders WHERE id BETWEEN 11 AND 20`)
	testenv.Exec(t, url, `SELECT pg_logical_emit_message(false, 'epitaph.mark', 'pending')`)
	var commitLSN, markLSN event.LSN
	require.NoError(t, workload.WaitFor(ctx, time.Minute, 100*time.Millisecond, func(ctx context.Context) (bool, error) {
		// (Once the stopped capture's walsender has let the slot go.)
		conn, err := pgx.Connect(ctx, url)
		if err != nil {
			return false, err
		}
		defer conn.Close(ctx)
		rows, err := conn.Query(ctx, `SELECT data FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL, 'proto_version', '1', 'publication_names', $2, 'messages', 'true')`, slot, slot)
		if err != nil {
			t.Logf("peek the slot: %v", err)
			return false, nil
		}
		datas, err := pgx.CollectRows(rows, pgx.RowTo[[]byte])
		if err != nil {
			t.Logf("peek the slot: %v", err)
			return false, nil
		}
		for _, data := range datas {
			m, err := pglogrepl.Parse(data)
			if err != nil {
				return false, err
			}
			switch m := m.(type) {
			case *pglogrepl.BeginMessage:
				commitLSN = event.LSN(m.FinalLSN)
			case *pglogrepl.LogicalDecodingMessage:
				markLSN = event.LSN(m.LSN)
			}
		}
		return commitLSN != 0 && markLSN != 0, nil
	}))

	// The forgeries: unsigned, under the plain ids of the messages the
	// capture will publish (the best a writer without the key can do).
	forged := map[uint64]*nats.Msg{} // stream seq -> forgery
	forge := func(m *nats.Msg) {
		m.Header.Set(event.HeaderVersion, "1")
		ack, err := js.PublishMsg(ctx, m)
		require.NoError(t, err)
		require.False(t, ack.Duplicate)
		forged[ack.Sequence] = m
	}
	commitSubject := event.CommitSubject("main", event.Partition(commitLSN, 8))
	c := nats.NewMsg(commitSubject)
	c.Header.Set(event.HeaderMsgID, event.CommitMsgID("main", commitLSN))
	c.Data = fmt.Appendf(nil, `{"v":1,"op":"commit","source":"main","xid":1,"commit_lsn":"%s","commit_time":"2026-01-01T00:00:00Z","rows":1,"tables":{"public.orders":1}}`, commitLSN)
	forge(c)
	for p := range 8 {
		m := nats.NewMsg(event.MarkSubject("main", p))
		m.Header.Set(event.HeaderMsgID, event.MarkMsgID("main", markLSN, p))
		m.Data = fmt.Appendf(nil, `{"v":1,"op":"mark","source":"main","partition":%d,"lsn":"%s","kind":"mark","content":"FORGED"}`, p, markLSN)
		forge(m)
	}
	for _, m := range forged {
		waitPastDedupeWindow(ctx, t, js, m)
	}

	capture = supervise(t, "capture-2", bins["capture"], cenv, seed+100)
	expected, err = workload.Expected(ctx, url)
	require.NoError(t, err)
	archived(len(expected))
	require.NoError(t, workload.WaitFor(ctx, 3*time.Minute, 250*time.Millisecond, func(ctx context.Context) (bool, error) {
		q, err := bench.Count(ctx, url, "SELECT count(DISTINCT stream_seq) FROM epitaph.quarantine WHERE projection = 'archive' AND version = 1")
		return q >= int64(len(forged)), err
	}))
	rep, err := workload.VerifyArchive(ctx, url, expected)
	require.NoError(t, err)
	t.Logf("archive verification: %s", rep.String())
	require.True(t, rep.OK(), rep.String())

	conn, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer conn.Close(ctx)
	inQuarantine := map[uint64]string{}
	rows, err := conn.Query(ctx, `SELECT stream_seq, category FROM epitaph.quarantine WHERE projection = 'archive' AND version = 1`)
	require.NoError(t, err)
	var qseq int64
	var qcat string
	_, err = pgx.ForEachRow(rows, []any{&qseq, &qcat}, func() error {
		inQuarantine[uint64(qseq)] = qcat
		return nil
	})
	require.NoError(t, err)
	require.Len(t, inQuarantine, len(forged), "exactly the forgeries are in quarantine: %v", inQuarantine)
	for seq, m := range forged {
		require.Equal(t, "unauthenticated", inQuarantine[seq], "forgery %s (stream seq %d)", m.Header.Get(event.HeaderMsgID), seq)
	}

	// The real commit and marks are stored under the forged ids with the
	// keyed tag (no duplicate, no republished id).
	pubPEM, err := os.ReadFile(filepath.Join(dataDir, "signing.pub"))
	require.NoError(t, err)
	pub, err := event.ParsePublicKey(pubPEM)
	require.NoError(t, err)
	held := map[string]int{}
	st, err := js.Stream(ctx, event.StreamName("main"))
	require.NoError(t, err)
	info, err := st.Info(ctx)
	require.NoError(t, err)
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq; seq++ {
		m, err := st.GetMsg(ctx, seq)
		require.NoError(t, err)
		id := m.Header.Get(event.HeaderMsgID)
		require.NotRegexp(t, `/r[0-9]+$`, id, "stream seq %d: nothing republished", seq)
		held[event.UntaggedMsgID(id)]++
		if signed := strings.HasSuffix(m.Subject, ".commit") || strings.HasSuffix(m.Subject, ".mark"); signed && id != event.UntaggedMsgID(id) {
			require.NoError(t, event.VerifyMessage(pub, m.Subject, m.Header, m.Data), "stream seq %d: a tagged id is the capture's", seq)
		}
	}
	for _, m := range forged {
		id := m.Header.Get(event.HeaderMsgID)
		require.Equal(t, 2, held[id], "id %s: the forgery and the real message", id)
	}
	// Every partition's watermark reaches the mark: the real copies were
	// believed (a forged one never moves it, and nothing else reaches it).
	// The real marks are published after the forgeries and may be applied
	// a moment after the archive is complete, so this waits for them.
	behind := fmt.Sprintf(`SELECT count(*) FROM epitaph.progress WHERE projection = 'archive' AND version = 1 AND (source_lsn IS NULL OR source_lsn < '%s')`, markLSN)
	require.NoError(t, workload.WaitFor(ctx, time.Minute, 100*time.Millisecond, func(ctx context.Context) (bool, error) {
		n, err := bench.Count(ctx, url, behind)
		return n == 0, err
	}), "every partition's watermark moved to the real mark")
	require.Equal(t, 8, count(t, conn, `SELECT count(*) FROM epitaph.progress WHERE projection = 'archive' AND version = 1`))
	for _, w := range workers {
		require.Zero(t, w.LogCount("panic"))
	}
	require.False(t, strings.Contains(capture.logTail(3000), "panic"))
}

// waitPastDedupeWindow returns once the stream no longer holds m's id in
// its dedupe window, storing nothing: m is published again expecting a
// last message id no message has, which JetStream answers as a duplicate
// while the id is in the window (its dedupe check comes first) and refuses
// as a wrong last message id after.
func waitPastDedupeWindow(ctx context.Context, t *testing.T, js jetstream.JetStream, m *nats.Msg) {
	t.Helper()
	probe := nats.NewMsg(m.Subject)
	for k, v := range m.Header {
		probe.Header[k] = v
	}
	probe.Header.Set(jetstream.ExpectedLastMsgIDHeader, "epitaph-test/no-such-id")
	probe.Data = m.Data
	require.NoError(t, workload.WaitFor(ctx, 2*time.Minute, 50*time.Millisecond, func(ctx context.Context) (bool, error) {
		ack, err := js.PublishMsg(ctx, probe)
		var apiErr *jetstream.APIError
		if errors.As(err, &apiErr) && apiErr.ErrorCode == 10070 { // wrong last msg ID
			return true, nil
		}
		if err != nil {
			return false, err
		}
		if !ack.Duplicate {
			return false, fmt.Errorf("the probe of %s was stored (stream seq %d)", m.Header.Get(event.HeaderMsgID), ack.Sequence)
		}
		return false, nil
	}), "id %s past the dedupe window", m.Header.Get(event.HeaderMsgID))
}
