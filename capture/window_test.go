package capture

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
)

// The dedupe window: no guarantee rests on it. A forgery under
// the plain id of a message the capture is about to publish (a commit's, a
// mark's, a gap's: the best a writer without the signing key can predict)
// sits beside the real message, inside the window or past it, since the
// real id carries a keyed tag (event.MsgIDTagger). Only a writer holding
// the key could take the real id: inside the window JetStream then answers
// the real message as a duplicate, which the capture republishes under
// another id. Every real message is stored and verifies, and every row is
// stored once.

// forgedIDs are the ids of messages the capture is about to publish, and
// the forgeries that took them.
type forgedIDs struct {
	commitLSN, markLSN, gapLSN event.LSN
	forged                     []*nats.Msg
}

// forgePendingIDs stops nothing: with the capture down, it makes a delete
// transaction, a mark and a table gap message in the source, reads their
// LSNs from the slot (the capture's next output), and publishes, like an
// outside client, a forgery under idOf of the plain id of each message the
// capture will publish for them: the commit, and the mark's and the gap's
// copy to every partition (unsigned, so believed by nobody).
func (e *env) forgePendingIDs(t *testing.T, parts int, idOf func(plain string) string) forgedIDs {
	t.Helper()
	e.exec(t, `DELETE FROM items WHERE id BETWEEN 6 AND 8`)
	e.exec(t, `SELECT pg_logical_emit_message(false, 'epitaph.mark', 'pending mark')`)
	e.exec(t, `SELECT pg_logical_emit_message(false, 'epitaph.gap', '{"schema":"public","table":"gone","reason":"test"}')`)
	var f forgedIDs
	require.Eventually(t, func() bool {
		// (Once the stopped capture's walsender has let the slot go.)
		rows, err := queryAll(t, e.db, `SELECT data FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL, 'proto_version', '1', 'publication_names', 'epitaph', 'messages', 'true')`, e.slot)
		if err != nil {
			t.Logf("peek the slot: %v", err)
			return false
		}
		f = forgedIDs{}
		for _, data := range rows {
			m, err := pglogrepl.Parse(data)
			require.NoError(t, err)
			switch m := m.(type) {
			case *pglogrepl.BeginMessage:
				f.commitLSN = event.LSN(m.FinalLSN)
			case *pglogrepl.LogicalDecodingMessage:
				switch m.Prefix {
				case event.PrefixMark:
					f.markLSN = event.LSN(m.LSN)
				case event.PrefixGap:
					f.gapLSN = event.LSN(m.LSN)
				}
			}
		}
		return f.commitLSN != 0 && f.markLSN != 0 && f.gapLSN != 0
	}, 60*time.Second, 100*time.Millisecond)

	forge := func(subject, id, body string) {
		hdr := map[string]string{event.HeaderMsgID: id, event.HeaderVersion: "1", event.HeaderSignature: "ed25519:AAAA"}
		e.hostile(t, subject, hdr, body)
		m := nats.NewMsg(subject)
		for k, v := range hdr {
			m.Header.Set(k, v)
		}
		m.Data = []byte(body)
		f.forged = append(f.forged, m)
	}
	forge(event.CommitSubject("main", event.Partition(f.commitLSN, parts)), idOf(event.CommitMsgID("main", f.commitLSN)),
		fmt.Sprintf(`{"v":1,"op":"commit","source":"main","xid":1,"commit_lsn":"%s","commit_time":"2026-01-01T00:00:00Z","rows":0}`, f.commitLSN))
	for p := 0; p < parts; p++ {
		forge(event.MarkSubject("main", p), idOf(event.MarkMsgID("main", f.markLSN, p)),
			fmt.Sprintf(`{"v":1,"op":"mark","source":"main","partition":%d,"lsn":"%s","kind":"mark","content":"FORGED"}`, p, f.markLSN))
		forge(event.GapSubject("main", p), idOf(event.TableGapMsgID("main", "public", "gone", f.gapLSN, f.gapLSN, p)),
			fmt.Sprintf(`{"v":1,"op":"gap","source":"main","partition":%d,"kind":"lost_upstream","schema":"public","table":"gone","from_lsn":"%s","to_lsn":"%s","lsn":"%s"}`, p, f.gapLSN, f.gapLSN, f.gapLSN))
	}
	return f
}

// queryAll returns the first column of every row of sql.
func queryAll(t *testing.T, url, sql string, args ...any) ([][]byte, error) {
	t.Helper()
	var out [][]byte
	conn, err := pgx.Connect(context.Background(), url)
	if err != nil {
		return nil, err
	}
	defer conn.Close(context.Background())
	rows, err := conn.Query(context.Background(), sql, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	for rows.Next() {
		var b []byte
		if err := rows.Scan(&b); err != nil {
			return nil, err
		}
		out = append(out, b)
	}
	return out, rows.Err()
}

// waitOutOfWindow returns once JetStream no longer holds m's id in its
// dedupe window, without storing anything: m is published again expecting
// a last message id no message has, which JetStream answers as a
// duplicate while the id is in the window (the dedupe check comes first)
// and refuses as "wrong last msg ID" after.
func (e *env) waitOutOfWindow(t *testing.T, m *nats.Msg) {
	t.Helper()
	nc, err := nats.Connect(e.nats.URL)
	require.NoError(t, err)
	defer nc.Close()
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	probe := nats.NewMsg(m.Subject)
	for k, v := range m.Header {
		probe.Header[k] = v
	}
	probe.Header.Set(jetstream.ExpectedLastMsgIDHeader, "epitaph-test/no-such-id")
	probe.Data = m.Data
	deadline := time.Now().Add(120 * time.Second)
	for {
		ack, err := js.PublishMsg(context.Background(), probe)
		var apiErr *jetstream.APIError
		if errors.As(err, &apiErr) && apiErr.ErrorCode == jsErrCodeWrongLastMsgID {
			return // past the window, and not stored
		}
		require.NoError(t, err)
		require.True(t, ack.Duplicate, "the probe is never stored")
		require.True(t, time.Now().Before(deadline), "id %s still in the dedupe window after 120 s", m.Header.Get(event.HeaderMsgID))
		time.Sleep(50 * time.Millisecond) // polling the server's window
	}
}

// forgedIDsCase runs the forgery of pending ids with the stream's dedupe
// window set to window; outside says whether the capture publishes only
// after the forgeries left the window; withKey, whether the forger holds
// the signing key (a leaked key: it forges the real, tagged ids; without
// it, a forger can only use the plain ids).
func forgedIDsCase(t *testing.T, window time.Duration, outside, withKey bool) {
	e := setup(t)
	itemsTable(t, e, 20)
	cfg := func(c *Config) {
		trustConfig(c)
		c.HeartbeatInterval = -1 // the only marks are the test's
		c.DuplicateWindow = window
	}
	svc := e.start(t, cfg)
	pub := e.publicKey(t)
	tagger := e.tagger(t)
	e.exec(t, `DELETE FROM items WHERE id <= 5`)
	e.requireRealDeletes(t, pub, ids(1, 5))
	require.NoError(t, svc.Stop(context.Background()))
	require.NoError(t, svc.Wait())

	idOf := func(plain string) string { return plain }
	if withKey {
		idOf = tagger.Tag
	}
	f := e.forgePendingIDs(t, 4, idOf)
	if outside {
		for _, m := range f.forged {
			e.waitOutOfWindow(t, m)
		}
	}
	svc = e.start(t, cfg)
	requireStreaming(t, svc)
	e.requireRealDeletes(t, pub, ids(1, 8))

	// Every forged id is held twice (read without tags): by the forgery,
	// and by the real message, which verifies; the forgery does not. The
	// real message is under its tagged id, or, when a forger with the key
	// took that inside the window, under <id>/r1.
	byID := map[string][]*jetstream.RawStreamMsg{}
	require.Eventually(t, func() bool {
		clear(byID)
		for _, m := range e.rawMsgs(t, "main") {
			base, _ := event.BaseMsgID(m.Header.Get(event.HeaderMsgID))
			byID[idOf(event.UntaggedMsgID(base))] = append(byID[idOf(event.UntaggedMsgID(base))], m)
		}
		for _, fm := range f.forged {
			if len(byID[fm.Header.Get(event.HeaderMsgID)]) < 2 {
				return false
			}
		}
		return true
	}, 90*time.Second, 100*time.Millisecond, "the real commit, mark and gap copies are published")
	for _, fm := range f.forged {
		id := fm.Header.Get(event.HeaderMsgID)
		ms := byID[id]
		require.Len(t, ms, 2, "id %s: the forgery and the real message", id)
		require.Equal(t, fm.Subject, ms[0].Subject)
		require.Equal(t, string(fm.Data), string(ms[0].Data), "id %s: the forgery came first", id)
		require.Error(t, event.VerifyMessage(pub, ms[0].Subject, ms[0].Header, ms[0].Data), "id %s: the forgery does not verify", id)
		require.Equal(t, fm.Subject, ms[1].Subject, "id %s", id)
		require.NoError(t, event.VerifyMessage(pub, ms[1].Subject, ms[1].Header, ms[1].Data), "id %s: the real message verifies", id)
		ev, err := event.Decode(ms[1].Data)
		require.NoError(t, err)
		switch plain := event.UntaggedMsgID(id); {
		case strings.HasSuffix(plain, "/commit"):
			require.Equal(t, event.OpCommit, ev.Op)
			require.Equal(t, f.commitLSN, ev.CommitLSN)
			require.Equal(t, 3, ev.Rows)
		case strings.Contains(plain, "/mark/"):
			require.Equal(t, event.OpMark, ev.Op)
			require.Equal(t, "pending mark", ev.Content)
		default:
			require.Equal(t, event.OpGap, ev.Op)
			require.Equal(t, "gone", ev.Table)
		}
		want := tagger.Tag(event.UntaggedMsgID(id))
		if withKey && !outside {
			want = event.RepublishedMsgID(want, 1)
		}
		require.Equal(t, want, ms[1].Header.Get(event.HeaderMsgID), "id %s", id)
	}
	if withKey && !outside {
		require.Equal(t, float64(len(f.forged)), counterValue(t, svc.m.collisions), "inside the window each real message whose id a forger with the key took is republished once")
	} else {
		require.Zero(t, counterValue(t, svc.m.collisions), "no real message is answered as a duplicate")
	}
	require.GreaterOrEqual(t, counterValue(t, svc.m.foreign), 1.0, "the forgeries were noticed")

	// Later deletes, and a restart, leave it so: each row once.
	e.exec(t, `DELETE FROM items WHERE id BETWEEN 9 AND 12`)
	e.requireRealDeletes(t, pub, ids(1, 12))
	require.NoError(t, svc.Stop(context.Background()))
	require.NoError(t, svc.Wait())
	svc = e.start(t, cfg)
	requireStreaming(t, svc)
	e.exec(t, `DELETE FROM items WHERE id > 12`)
	e.requireRealDeletes(t, pub, ids(1, 20))
	real := map[string]int{}
	for _, m := range e.rawMsgs(t, "main") {
		if ev, err := event.Decode(m.Data); err == nil && ev.Op == event.OpDelete {
			real[string(ev.Key)]++
		}
	}
	require.Len(t, real, 20)
	for k, n := range real {
		require.Equal(t, 1, n, "row %s stored once", k)
	}
}

// TestForgedIDsOutsideTheWindowStayBesideTheRealOnes: forgeries of a
// pending commit's, mark's and gap's plain ids, published longer ago than
// the (default, short) dedupe window, are stored beside the real messages;
// those are published under their own tagged ids, no collision, and verify.
func TestForgedIDsOutsideTheWindowStayBesideTheRealOnes(t *testing.T) {
	t.Parallel()
	forgedIDsCase(t, DefaultDuplicateWindow, true, false)
}

// TestForgedIDsInsideTheWindowNeverTakeTheRealOnes: the same forgeries
// inside a long window are stored beside the real messages all the same:
// the real ids carry the keyed tag, so no forgery holds one and nothing is
// answered as a duplicate.
func TestForgedIDsInsideTheWindowNeverTakeTheRealOnes(t *testing.T) {
	t.Parallel()
	forgedIDsCase(t, 10*time.Minute, false, false)
}

// TestForgedIDsWithTheKeyInsideTheWindowAreRepublished: a forger holding
// the signing key (leaked) takes the real, tagged ids inside a long window;
// JetStream answers the real messages as duplicates and the capture
// republishes each under <id>/r1.
func TestForgedIDsWithTheKeyInsideTheWindowAreRepublished(t *testing.T) {
	t.Parallel()
	forgedIDsCase(t, 10*time.Minute, false, true)
}

// TestExistingStreamGetsTheConfiguredWindow: a stream made with the old
// two-minute window gets the configured one (the short default) when the
// capture starts on it, and the capture goes on where it stopped.
func TestExistingStreamGetsTheConfiguredWindow(t *testing.T) {
	t.Parallel()
	e := setup(t)
	itemsTable(t, e, 20)
	windowOf := func() time.Duration {
		st, err := e.js.Stream(context.Background(), event.StreamName("main"))
		require.NoError(t, err)
		info, err := st.Info(context.Background())
		require.NoError(t, err)
		return info.Config.Duplicates
	}
	svc := e.start(t, func(c *Config) { trustConfig(c); c.DuplicateWindow = 2 * time.Minute })
	pub := e.publicKey(t)
	e.exec(t, `DELETE FROM items WHERE id <= 10`)
	e.requireRealDeletes(t, pub, ids(1, 10))
	require.Equal(t, 2*time.Minute, windowOf())
	require.NoError(t, svc.Stop(context.Background()))
	require.NoError(t, svc.Wait())

	e.exec(t, `DELETE FROM items WHERE id BETWEEN 11 AND 15`)
	svc = e.start(t, trustConfig)
	requireStreaming(t, svc)
	require.Equal(t, DefaultDuplicateWindow, windowOf())
	e.exec(t, `DELETE FROM items WHERE id > 15`)
	e.requireRealDeletes(t, pub, ids(1, 20))
	require.Zero(t, counterValue(t, svc.m.collisions))
}
