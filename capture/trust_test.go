package capture

import (
	"context"
	"crypto/ed25519"
	"encoding/binary"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
)

// rawMsgs returns every stored message of source src, in stream order.
func (e *env) rawMsgs(t *testing.T, src string) []*jetstream.RawStreamMsg {
	t.Helper()
	ctx := context.Background()
	st, err := e.js.Stream(ctx, event.StreamName(src))
	require.NoError(t, err)
	info, err := st.Info(ctx)
	require.NoError(t, err)
	return storedMsgs(t, st, info.State.FirstSeq, info.State.LastSeq)
}

// verifiedTx is a transaction whose commit verifies with the key and whose
// digest is matched by a choice of its stored row messages.
type verifiedTx struct {
	commit *jetstream.RawStreamMsg
	rows   []*jetstream.RawStreamMsg // in seq order
}

// verifiedTransactions checks the stream as a projector would: for every
// commit signed with pub, among the stored row and truncate messages of its
// transaction (same commit LSN, same partition, any number of candidates
// per seq), one per seq whose digest is the signed one. It returns the
// verified transactions by commit LSN and fails on a signed commit no
// choice matches.
func verifiedTransactions(t *testing.T, ms []*jetstream.RawStreamMsg, pub ed25519.PublicKey) map[event.LSN]verifiedTx {
	t.Helper()
	type cand struct {
		m       *jetstream.RawStreamMsg
		partSeq uint64
	}
	rows := map[string]map[int][]cand{} // "<partition>/<commit lsn>" -> seq -> candidates
	var commits []*jetstream.RawStreamMsg
	for _, m := range ms {
		p, err := event.PartitionOf(m.Subject)
		if err != nil {
			continue
		}
		if strings.HasSuffix(m.Subject, ".commit") {
			if event.VerifyMessage(pub, m.Subject, m.Header, m.Data) == nil {
				commits = append(commits, m)
			}
			continue
		}
		if !strings.Contains(m.Subject, ".delete.") && !strings.Contains(m.Subject, ".truncate.") {
			continue
		}
		ev, err := event.Decode(m.Data)
		if err != nil {
			continue
		}
		ps, err := strconv.ParseUint(m.Header.Get(event.HeaderPartitionSeq), 10, 64)
		if err != nil {
			continue
		}
		k := fmt.Sprintf("%d/%s", p, ev.CommitLSN)
		if rows[k] == nil {
			rows[k] = map[int][]cand{}
		}
		rows[k][ev.Seq] = append(rows[k][ev.Seq], cand{m, ps})
	}
	out := map[event.LSN]verifiedTx{}
	for _, c := range commits {
		ev, err := event.Decode(c.Data)
		require.NoError(t, err)
		p, _ := event.PartitionOf(c.Subject)
		byseq := rows[fmt.Sprintf("%d/%s", p, ev.CommitLSN)]
		n := len(byseq)
		want := c.Header.Get(event.HeaderDigest)
		var chosen []*jetstream.RawStreamMsg
		budget := 1_000_000 // choices tried: duplicates must not make it exponential
		var try func(seq int, d *event.Digest) bool
		try = func(seq int, d *event.Digest) bool {
			if budget--; budget < 0 {
				return false
			}
			// The digest decides how many seqs there are: a forgery
			// with another seq must not hide the real transaction.
			if seq > 0 && d.Sum() == want {
				return true
			}
			state, err := d.MarshalBinary()
			require.NoError(t, err)
			for _, cd := range byseq[seq] {
				var next event.Digest
				require.NoError(t, next.UnmarshalBinary(state))
				next.Add(cd.partSeq, cd.m.Data)
				chosen = append(chosen, cd.m)
				if try(seq+1, &next) {
					return true
				}
				chosen = chosen[:len(chosen)-1]
			}
			return false
		}
		d := event.NewDigest()
		if c.Header.Get(event.HeaderDigestAlg) == event.DigestAlgV2 {
			d = event.NewDigestV2()
		}
		require.True(t, try(0, d), "signed commit %s (stream seq %d): no choice of its %d stored row messages matches its digest", ev.CommitLSN, c.Sequence, n)
		out[ev.CommitLSN] = verifiedTx{commit: c, rows: append([]*jetstream.RawStreamMsg(nil), chosen...)}
	}
	return out
}

// verifiedDeletes returns the keys of the deletes of verified transactions,
// with how often each is there, and the body of each.
func verifiedDeletes(t *testing.T, txs map[event.LSN]verifiedTx) (map[string]int, map[string]*event.Event) {
	t.Helper()
	counts, evs := map[string]int{}, map[string]*event.Event{}
	for _, tx := range txs {
		for _, m := range tx.rows {
			ev, err := event.Decode(m.Data)
			require.NoError(t, err)
			if ev.Op != event.OpDelete {
				continue
			}
			k := ev.QualifiedTable() + string(ev.Key)
			counts[k]++
			evs[k] = ev
		}
	}
	return counts, evs
}

// requireRealDeletes waits until the verified transactions of the stream
// hold exactly the ids of items in want, each once, with its real body
// (pad 'p' x id).
func (e *env) requireRealDeletes(t *testing.T, pub ed25519.PublicKey, want []int) {
	t.Helper()
	deadline := time.Now().Add(90 * time.Second)
	for {
		counts, evs := verifiedDeletes(t, verifiedTransactions(t, e.rawMsgs(t, "main"), pub))
		if len(counts) >= len(want) || time.Now().After(deadline) {
			require.Len(t, counts, len(want), "verified deletes")
			for _, id := range want {
				k := fmt.Sprintf(`public.items{"id":%d}`, id)
				require.Equal(t, 1, counts[k], "row %d once", id)
				require.JSONEq(t, fmt.Sprintf(`{"id":%d,"pad":"%s"}`, id, strings.Repeat("p", id%7+1)), string(evs[k].Row), "row %d's real values", id)
			}
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func itemsTable(t *testing.T, e *env, n int) {
	e.exec(t, fmt.Sprintf(`CREATE TABLE items (id int PRIMARY KEY, pad text); ALTER TABLE items REPLICA IDENTITY FULL;
		INSERT INTO items SELECT i, repeat('p', i %% 7 + 1) FROM generate_series(1, %d) i`, n))
}

func ids(from, to int) []int {
	var out []int
	for i := from; i <= to; i++ {
		out = append(out, i)
	}
	return out
}

func (e *env) publicKey(t *testing.T) ed25519.PublicKey {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(e.dir, "signing.pub"))
	require.NoError(t, err)
	pub, err := event.ParsePublicKey(data)
	require.NoError(t, err)
	return pub
}

// tagger is the message id tagger of the capture's signing key.
func (e *env) tagger(t *testing.T) *event.MsgIDTagger {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(e.dir, "signing.key"))
	require.NoError(t, err)
	priv, err := event.ParsePrivateKey(data)
	require.NoError(t, err)
	return event.NewMsgIDTagger(priv)
}

// requireStreaming waits until the capture streams (and /healthz says so).
func requireStreaming(t *testing.T, svc *Service) {
	t.Helper()
	require.Eventually(t, func() bool { return svc.CurrentStatus().Active }, 90*time.Second, 20*time.Millisecond, "the capture is streaming")
	resp, err := http.Get("http://" + svc.MetricsAddr() + "/healthz")
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
}

// hostile publishes like an outside client on a broker without auth.
func (e *env) hostile(t *testing.T, subject string, hdr map[string]string, body string) {
	t.Helper()
	nc, err := nats.Connect(e.nats.URL)
	require.NoError(t, err)
	defer nc.Close()
	m := nats.NewMsg(subject)
	for k, v := range hdr {
		m.Header.Set(k, v)
	}
	m.Data = []byte(body)
	// Through JetStream, acknowledged, so the message is stored before
	// the test goes on.
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	_, err = js.PublishMsg(context.Background(), m)
	require.NoError(t, err)
}

func counterValue(t *testing.T, c prometheus.Counter) float64 {
	t.Helper()
	var pb dto.Metric
	require.NoError(t, c.Write(&pb))
	return pb.GetCounter().GetValue()
}

func trustConfig(c *Config) {
	c.MetricsAddr = "127.0.0.1:0"
	c.HeartbeatInterval = 200 * time.Millisecond
}

// TestEveryMessageIsSignedOrDigested checks the trust headers: every
// message has the next partition sequence of its partition, rows and
// truncates are covered by their commit's digest, commits, marks and
// heartbeats verify with the key in <data-dir>/signing.pub, which /status
// names.
func TestEveryMessageIsSignedOrDigested(t *testing.T) {
	t.Parallel()
	e := setup(t)
	itemsTable(t, e, 50)
	e.exec(t, `CREATE TABLE other (id int PRIMARY KEY)`)
	svc := e.start(t, trustConfig)
	e.exec(t, `DELETE FROM items WHERE id <= 10`)
	e.exec(t, `SELECT pg_logical_emit_message(false, 'epitaph.mark', 'm1')`)
	e.exec(t, `BEGIN; DELETE FROM items WHERE id > 40; TRUNCATE other; COMMIT`)
	pub := e.publicKey(t)
	st := svc.CurrentStatus()
	require.Equal(t, event.KeyID(pub), st.SigningKeyID)
	require.Equal(t, event.PublicKeyString(pub), st.SigningPublicKey)
	e.requireRealDeletes(t, pub, append(ids(1, 10), ids(41, 50)...))

	ms := e.rawMsgs(t, "main")
	last := map[int]uint64{}
	signed := 0
	for _, m := range ms {
		p, err := event.PartitionOf(m.Subject)
		require.NoError(t, err)
		ps, err := strconv.ParseUint(m.Header.Get(event.HeaderPartitionSeq), 10, 64)
		require.NoError(t, err, "stream seq %d has a partition sequence", m.Sequence)
		require.Equal(t, last[p]+1, ps, "stream seq %d: partition %d counts +1", m.Sequence, p)
		last[p] = ps
		if strings.HasSuffix(m.Subject, ".commit") || strings.HasSuffix(m.Subject, ".mark") {
			require.NoError(t, event.VerifyMessage(pub, m.Subject, m.Header, m.Data), "stream seq %d", m.Sequence)
			require.Equal(t, event.KeyID(pub), m.Header.Get(event.HeaderKeyID))
			signed++
		} else {
			require.Empty(t, m.Header.Get(event.HeaderSignature), "rows are not signed one by one")
		}
		if strings.HasSuffix(m.Subject, ".commit") {
			require.Regexp(t, `^sha256:[0-9a-f]{64}$`, m.Header.Get(event.HeaderDigest))
		} else {
			require.Empty(t, m.Header.Get(event.HeaderDigest))
		}
		// Digest v2 on every message of a transaction: its rows,
		// truncates and commit; none on a non-transactional mark.
		if strings.HasSuffix(m.Subject, ".mark") {
			require.Empty(t, m.Header.Get(event.HeaderDigestAlg), "stream seq %d", m.Sequence)
		} else {
			require.Equal(t, event.DigestAlgV2, m.Header.Get(event.HeaderDigestAlg), "stream seq %d (%s)", m.Sequence, m.Subject)
		}
	}
	require.GreaterOrEqual(t, signed, 2+4, "two commits and a mark on each of 4 partitions")
	txs := verifiedTransactions(t, ms, pub)
	require.Len(t, txs, 2)
	for _, tx := range txs {
		ev, err := event.Decode(tx.commit.Data)
		require.NoError(t, err)
		if ev.Tables["public.items"] == 10 && ev.Rows == 10 {
			continue
		}
		require.Len(t, tx.rows, 11, "ten deletes and the truncate are in the digest")
	}

	// The key is kept across restarts: the restarted capture resumes after
	// its own messages and signs with the same key.
	require.NoError(t, svc.Stop(context.Background()))
	require.NoError(t, svc.Wait())
	fi, err := os.Stat(filepath.Join(e.dir, "signing.key"))
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), fi.Mode().Perm())
	svc = e.start(t, trustConfig)
	e.exec(t, `DELETE FROM items WHERE id BETWEEN 11 AND 20`)
	e.requireRealDeletes(t, pub, append(ids(1, 20), ids(41, 50)...))
	require.Equal(t, event.KeyID(pub), svc.CurrentStatus().SigningKeyID)
	require.Zero(t, counterValue(t, svc.m.foreign))
}

// TestForeignMessagesAreNeverBelieved plays the hostile writer on a broker
// without authentication: garbage on a row subject, a valid-shaped forged
// delete, a forged commit and a forged mark at a far-future position, each
// while the capture streams and across restarts. After each, every real
// delete is in the stream once, with its real values, as a member of its
// signed transaction, no forgery is, and the capture streams.
func TestForeignMessagesAreNeverBelieved(t *testing.T) {
	t.Parallel()
	e := setup(t)
	itemsTable(t, e, 100)
	svc := e.start(t, trustConfig)
	pub := e.publicKey(t)
	e.exec(t, `DELETE FROM items WHERE id <= 10`)
	e.requireRealDeletes(t, pub, ids(1, 10))

	// Garbage on a row subject while streaming: the capture's next message
	// no longer chains to its previous one; a new session starts.
	e.hostile(t, event.DeleteSubject("main", 0, "public", "items"), nil, "not json")
	e.exec(t, `DELETE FROM items WHERE id BETWEEN 11 AND 20`)
	e.requireRealDeletes(t, pub, ids(1, 20))
	requireStreaming(t, svc)
	// And a restart with the garbage in the stream.
	require.NoError(t, svc.Stop(context.Background()))
	require.NoError(t, svc.Wait())
	e.hostile(t, event.DeleteSubject("main", 1, "public", "items"), nil, "not json either")
	svc = e.start(t, trustConfig)
	requireStreaming(t, svc)
	e.exec(t, `DELETE FROM items WHERE id BETWEEN 21 AND 30`)
	e.requireRealDeletes(t, pub, ids(1, 30))
	require.GreaterOrEqual(t, counterValue(t, svc.m.foreign), 1.0, "the garbage was counted")

	// A valid-shaped forged delete (any key, plausible position), while
	// the capture is stopped and at the stream's end.
	require.NoError(t, svc.Stop(context.Background()))
	require.NoError(t, svc.Wait())
	lsn := event.LSN(0x7FFF0000)
	forged := fmt.Sprintf(`{"v":1,"op":"delete","source":"main","schema":"public","table":"items","xid":1,"commit_lsn":"%s","commit_time":"2026-01-01T00:00:00Z","seq":0,"identity":"full","columns":[{"name":"id","type":"integer","pk":true},{"name":"pad","type":"text"}],"key":{"id":99},"row":{"id":99,"pad":"FORGED"}}`, lsn)
	e.hostile(t, event.DeleteSubject("main", event.Partition(lsn, 4), "public", "items"), map[string]string{
		event.HeaderMsgID: event.MsgID("main", lsn, 0), event.HeaderPosition: lsn.String() + "#0", event.HeaderPartitionSeq: "1000", event.HeaderVersion: "1",
	}, forged)
	svc = e.start(t, trustConfig)
	requireStreaming(t, svc)
	e.exec(t, `DELETE FROM items WHERE id BETWEEN 31 AND 40`)
	e.requireRealDeletes(t, pub, ids(1, 40))

	// A crafted far-future position, unsigned on a commit and signed with
	// another key on a mark: neither is believed, and later deletes are
	// published, not skipped as "already sent".
	require.NoError(t, svc.Stop(context.Background()))
	require.NoError(t, svc.Wait())
	_, otherKey, err := ed25519.GenerateKey(nil)
	require.NoError(t, err)
	far := "FFFFFFFF/FFFFFFF0#0"
	e.hostile(t, event.CommitSubject("main", 2), map[string]string{event.HeaderMsgID: "main/FFFFFFFF/FFFFFFF0/commit", event.HeaderPosition: far, event.HeaderVersion: "1"},
		`{"v":1,"op":"commit","source":"main","xid":1,"commit_lsn":"FFFFFFFF/FFFFFFF0","commit_time":"2026-01-01T00:00:00Z","seq":0,"rows":1}`)
	markBody := `{"v":1,"op":"mark","source":"main","seq":0,"partition":3,"lsn":"FFFFFFFF/FFFFFFF1","kind":"mark"}`
	h := nats.Header{event.HeaderMsgID: {"main/FFFFFFFF/FFFFFFF1/mark/3"}, event.HeaderPosition: {far}, event.HeaderPartitionSeq: {"1"}, event.HeaderKeyID: {event.KeyID(otherKey.Public().(ed25519.PublicKey))}}
	h.Set(event.HeaderSignature, event.Sign(otherKey, event.MessageSigningInput(event.MarkSubject("main", 3), h, []byte(markBody))))
	e.hostile(t, event.MarkSubject("main", 3), map[string]string{event.HeaderMsgID: h.Get(event.HeaderMsgID), event.HeaderPosition: far,
		event.HeaderPartitionSeq: "1", event.HeaderKeyID: h.Get(event.HeaderKeyID), event.HeaderSignature: h.Get(event.HeaderSignature)}, markBody)
	svc = e.start(t, trustConfig)
	requireStreaming(t, svc)
	e.exec(t, `DELETE FROM items WHERE id BETWEEN 41 AND 50`)
	e.requireRealDeletes(t, pub, ids(1, 50))
	require.GreaterOrEqual(t, counterValue(t, svc.m.foreign), 2.0, "the far-future forgeries were counted")
	requireStreaming(t, svc)
}

// TestImplausiblePositionIsRefused: a message signed with the capture's own
// key (a leaked key, or a source restored from a backup) that stands for a
// position beyond the source's current WAL is refused as a resume position,
// loudly and counted, and the capture resumes from its last plausible
// message: later deletes are published.
func TestImplausiblePositionIsRefused(t *testing.T) {
	t.Parallel()
	e := setup(t)
	itemsTable(t, e, 30)
	svc := e.start(t, trustConfig)
	pub := e.publicKey(t)
	e.exec(t, `DELETE FROM items WHERE id <= 10`)
	e.requireRealDeletes(t, pub, ids(1, 10))
	require.NoError(t, svc.Stop(context.Background()))
	require.NoError(t, svc.Wait())

	data, err := os.ReadFile(filepath.Join(e.dir, "signing.key"))
	require.NoError(t, err)
	priv, err := event.ParsePrivateKey(data)
	require.NoError(t, err)
	for p := 0; p < 4; p++ {
		subject, body := event.MarkSubject("main", p), fmt.Sprintf(`{"v":1,"op":"mark","source":"main","seq":0,"partition":%d,"lsn":"FFFFFFFF/FFFFFFF1","kind":"heartbeat"}`, p)
		h := nats.Header{event.HeaderMsgID: {fmt.Sprintf("main/FFFFFFFF/FFFFFFF1/mark/%d", p)}, event.HeaderPosition: {"FFFFFFFF/FFFFFFF0#" + strconv.Itoa(p)},
			event.HeaderPartitionSeq: {"999999"}, event.HeaderKeyID: {event.KeyID(pub)}}
		h.Set(event.HeaderSignature, event.Sign(priv, event.MessageSigningInput(subject, h, []byte(body))))
		hdr := map[string]string{}
		for k := range h {
			hdr[k] = h.Get(k)
		}
		e.hostile(t, subject, hdr, body)
	}
	svc = e.start(t, trustConfig)
	requireStreaming(t, svc)
	require.Equal(t, 4.0, counterValue(t, svc.m.implausible), "each implausible message counted once")
	e.exec(t, `DELETE FROM items WHERE id BETWEEN 11 AND 30`)
	e.requireRealDeletes(t, pub, ids(1, 30))
}

// TestForgeryTakingAPendingDeletesIDIsNotBelieved: forgeries take every
// id of a real transaction the capture has not published yet that can be
// predicted (the commit LSN is read here from the slot): its rows' and its
// commit's ids in the plain form (every id the capture publishes carries a
// tag keyed by the signing key, event.MsgIDTagger, so the real one cannot
// be predicted). Nothing real is dropped as a duplicate, nothing is
// republished; the signed digest covers the real rows, not the forgeries.
// (The forgeries are inside the dedupe window: a long one here, as the
// default is short; past it, see
// TestForgedIDsOutsideTheWindowStayBesideTheRealOnes.)
func TestForgeryTakingAPendingDeletesIDIsNotBelieved(t *testing.T) {
	t.Parallel()
	e := setup(t)
	itemsTable(t, e, 20)
	trustConfig := func(c *Config) {
		trustConfig(c)
		c.DuplicateWindow = 10 * time.Minute
	}
	svc := e.start(t, trustConfig)
	pub := e.publicKey(t)
	e.exec(t, `DELETE FROM items WHERE id <= 5`)
	e.requireRealDeletes(t, pub, ids(1, 5))
	require.NoError(t, svc.Stop(context.Background()))
	require.NoError(t, svc.Wait())

	// A delete made while the capture is down: its commit LSN is in the
	// slot's next transaction (pgoutput's Begin carries it).
	e.exec(t, `DELETE FROM items WHERE id BETWEEN 6 AND 8`)
	var data []byte
	require.Eventually(t, func() bool {
		// (Once the stopped capture's walsender has let the slot go.)
		err := queryRow(t, e.db, `SELECT data FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL, 'proto_version', '1', 'publication_names', 'epitaph') WHERE get_byte(data, 0) = 66 LIMIT 1`, []any{e.slot}, &data)
		if err != nil {
			t.Logf("peek the slot: %v", err)
		}
		return err == nil
	}, 60*time.Second, 100*time.Millisecond)
	lsn := event.LSN(binary.BigEndian.Uint64(data[1:9]))
	p := event.Partition(lsn, 4)
	for seq := 0; seq < 3; seq++ {
		forged := fmt.Sprintf(`{"v":1,"op":"delete","source":"main","schema":"public","table":"items","xid":1,"commit_lsn":"%s","commit_time":"2026-01-01T00:00:00Z","seq":%d,"identity":"full","columns":[{"name":"id","type":"integer","pk":true},{"name":"pad","type":"text"}],"key":{"id":%d},"row":{"id":%d,"pad":"FORGED"}}`, lsn, seq, 6+seq, 6+seq)
		e.hostile(t, event.DeleteSubject("main", p, "public", "items"), map[string]string{
			event.HeaderMsgID: event.MsgID("main", lsn, seq), event.HeaderPosition: lsn.String() + "#" + strconv.Itoa(seq), event.HeaderVersion: "1", event.HeaderPartitionSeq: strconv.Itoa(100 + seq),
		}, forged)
	}
	e.hostile(t, event.CommitSubject("main", p), map[string]string{event.HeaderMsgID: event.CommitMsgID("main", lsn), event.HeaderVersion: "1"}, `{"v":1,"op":"commit"}`)

	svc = e.start(t, trustConfig)
	requireStreaming(t, svc)
	e.requireRealDeletes(t, pub, ids(1, 8))
	require.Zero(t, counterValue(t, svc.m.collisions), "no real message was answered as a duplicate")
	var republished, realRows, realCommits []string
	for _, m := range e.rawMsgs(t, "main") {
		id := m.Header.Get(event.HeaderMsgID)
		if _, n := event.BaseMsgID(id); n > 0 {
			republished = append(republished, id)
		}
		ev, err := event.Decode(m.Data)
		if err == nil && ev.Op == event.OpDelete && ev.CommitLSN == lsn && !strings.Contains(string(ev.Row), "FORGED") {
			realRows = append(realRows, id)
		}
		if err == nil && ev.Op == event.OpCommit && event.VerifyMessage(pub, m.Subject, m.Header, m.Data) == nil && ev.CommitLSN == lsn {
			realCommits = append(realCommits, id)
		}
	}
	require.Empty(t, republished)
	require.Equal(t, []string{e.tagger(t).CommitMsgID("main", lsn)}, realCommits, "the real commit, under its tagged id")
	require.Len(t, realRows, 3, "the real rows are stored, none dropped as a duplicate of a forgery")
	for seq, id := range realRows {
		require.Equal(t, event.MsgID("main", lsn, seq), event.UntaggedMsgID(id))
		require.NotEqual(t, event.MsgID("main", lsn, seq), id, "tagged")
	}

	// Later deletes, and a restart, leave it so.
	e.exec(t, `DELETE FROM items WHERE id BETWEEN 9 AND 12`)
	e.requireRealDeletes(t, pub, ids(1, 12))
	require.NoError(t, svc.Stop(context.Background()))
	require.NoError(t, svc.Wait())
	svc = e.start(t, trustConfig)
	requireStreaming(t, svc)
	e.exec(t, `DELETE FROM items WHERE id BETWEEN 13 AND 20`)
	e.requireRealDeletes(t, pub, ids(1, 20))
}

// TestHostileWriterAcrossSIGKILLs runs the real capture binary (restarted
// like a supervisor would) on a broker without authentication while an
// outside client publishes garbage, a forged far-future commit and a
// forgery of a pending delete's id, and the capture is SIGKILLed inside a
// big transaction. At the end every real delete is in the stream once, with
// its real values, as a member of its signed transaction, the capture
// streams, and it never exited by itself.
func TestHostileWriterAcrossSIGKILLs(t *testing.T) {
	t.Parallel()
	e := setup(t)
	itemsTable(t, e, 6000)
	p := startCapProc(t, "capture-hostile", buildCapture(t), map[string]string{
		"EPITAPH_SOURCE_URL":         e.db,
		"EPITAPH_NATS_URL":           e.nats.URL,
		"EPITAPH_DATA_DIR":           e.dir,
		"EPITAPH_SLOT":               e.slot,
		"EPITAPH_TABLES":             "public.items",
		"EPITAPH_PARTITIONS":         "4",
		"EPITAPH_HEARTBEAT_INTERVAL": "200ms",
	})
	streaming := func() {
		t.Helper()
		require.Eventually(t, func() bool { v, ok := p.active(); return ok && v == 1 && p.healthz() == http.StatusOK }, 90*time.Second, 50*time.Millisecond)
	}
	streaming()
	pub := e.publicKey(t)
	e.exec(t, `DELETE FROM items WHERE id <= 100`)
	e.requireRealDeletes(t, pub, ids(1, 100))

	e.hostile(t, event.DeleteSubject("main", 0, "public", "items"), nil, "not json")
	e.exec(t, `DELETE FROM items WHERE id BETWEEN 101 AND 200`)
	e.requireRealDeletes(t, pub, ids(1, 200))

	// SIGKILL inside a big transaction (nothing after it confirmed: the
	// external broker's 2m trail), a forged far-future commit while it is
	// down, then the restart adopts the stored rows and publishes the rest.
	ctx := context.Background()
	st, err := e.js.Stream(ctx, event.StreamName("main"))
	require.NoError(t, err)
	before, err := st.Info(ctx)
	require.NoError(t, err)
	e.exec(t, `DELETE FROM items WHERE id BETWEEN 201 AND 5000`)
	require.Eventually(t, func() bool {
		info, err := st.Info(ctx)
		return err == nil && info.State.Msgs > before.State.Msgs+1000
	}, 60*time.Second, 5*time.Millisecond)
	p.kill()
	e.hostile(t, event.CommitSubject("main", 1), map[string]string{event.HeaderMsgID: "main/FFFFFFFF/FFFFFFF0/commit", event.HeaderPosition: "FFFFFFFF/FFFFFFF0#0", event.HeaderVersion: "1"},
		`{"v":1,"op":"commit","source":"main","xid":1,"commit_lsn":"FFFFFFFF/FFFFFFF0","commit_time":"2026-01-01T00:00:00Z","seq":0,"rows":1}`)
	p.start()
	streaming()
	e.requireRealDeletes(t, pub, ids(1, 5000))

	// A forgery of a pending delete's id, then a SIGKILL right after the
	// capture republished it.
	p.kill()
	e.exec(t, `DELETE FROM items WHERE id BETWEEN 5001 AND 5003`)
	var data []byte
	require.Eventually(t, func() bool {
		return queryRow(t, e.db, `SELECT data FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL, 'proto_version', '1', 'publication_names', 'epitaph') WHERE get_byte(data, 0) = 66 ORDER BY lsn DESC LIMIT 1`, []any{e.slot}, &data) == nil
	}, 60*time.Second, 100*time.Millisecond)
	lsn := event.LSN(binary.BigEndian.Uint64(data[1:9]))
	e.hostile(t, event.DeleteSubject("main", event.Partition(lsn, 4), "public", "items"), map[string]string{
		event.HeaderMsgID: event.MsgID("main", lsn, 0), event.HeaderPosition: lsn.String() + "#0", event.HeaderVersion: "1", event.HeaderPartitionSeq: "1",
	}, fmt.Sprintf(`{"v":1,"op":"delete","source":"main","schema":"public","table":"items","xid":1,"commit_lsn":"%s","commit_time":"2026-01-01T00:00:00Z","seq":0,"identity":"full","columns":[{"name":"id","type":"integer","pk":true},{"name":"pad","type":"text"}],"key":{"id":5001},"row":{"id":5001,"pad":"FORGED"}}`, lsn))
	p.start()
	streaming()
	e.requireRealDeletes(t, pub, ids(1, 5003))
	p.kill()
	p.start()
	streaming()
	e.exec(t, `DELETE FROM items WHERE id > 5003`)
	e.requireRealDeletes(t, pub, ids(1, 6000))

	// Nothing was published twice either: the rows a killed capture left
	// were adopted, not sent again.
	real := map[string]int{}
	for _, m := range e.rawMsgs(t, "main") {
		if ev, err := event.Decode(m.Data); err == nil && ev.Op == event.OpDelete && !strings.Contains(string(ev.Row), "FORGED") {
			real[string(ev.Key)]++
		}
	}
	require.Len(t, real, 6000)
	for k, n := range real {
		require.Equal(t, 1, n, "row %s stored once", k)
	}

	p.mu.Lock()
	selfExit := p.selfExit
	p.mu.Unlock()
	require.Zero(t, selfExit, "the capture never stopped because of a foreign message")
}

// TestRestartInsideTransactionWithAMark stops the capture inside a big
// transaction after a transactional mark (signed, but not a transaction
// boundary) was published: the restarted capture resumes after the last
// boundary, adopts the stored rows and mark copies, and publishes the rest
// once; the commit's digest covers all the rows.
func TestRestartInsideTransactionWithAMark(t *testing.T) {
	t.Parallel()
	e := setup(t)
	itemsTable(t, e, 6000)
	cfg := func(c *Config) {
		trustConfig(c)
		c.HeartbeatInterval = -1         // the only marks are the transaction's
		c.BrokerSyncInterval = time.Hour // nothing confirmed: the restart replays it all
		c.MaxInFlight = 64
	}
	svc := e.start(t, cfg)
	pub := e.publicKey(t)
	e.exec(t, `DELETE FROM items WHERE id <= 10`)
	e.requireRealDeletes(t, pub, ids(1, 10))
	ctx := context.Background()
	st, err := e.js.Stream(ctx, event.StreamName("main"))
	require.NoError(t, err)
	e.exec(t, `BEGIN; DELETE FROM items WHERE id BETWEEN 11 AND 2000;
		SELECT pg_logical_emit_message(true, 'epitaph.mark', 'inside');
		DELETE FROM items WHERE id > 2000; COMMIT`)
	require.Eventually(t, func() bool {
		// The mark's last copy (partition 3) is in: stop there.
		m, err := st.GetLastMsgForSubject(ctx, event.MarkSubject("main", 3))
		if err != nil {
			return false
		}
		ev, err := event.Decode(m.Data)
		return err == nil && ev.Kind == event.MarkUser && ev.CommitLSN != 0
	}, 90*time.Second, 2*time.Millisecond)
	require.NoError(t, svc.Stop(context.Background()))
	require.NoError(t, svc.Wait())
	var commits int
	for _, m := range e.rawMsgs(t, "main") {
		if strings.HasSuffix(m.Subject, ".commit") {
			commits++
		}
	}
	require.Equal(t, 1, commits, "stopped inside the big transaction")
	info, err := st.Info(ctx)
	require.NoError(t, err)
	require.Greater(t, info.State.Msgs, uint64(11+1990+4), "stopped after the mark")

	svc = e.start(t, cfg)
	requireStreaming(t, svc)
	e.requireRealDeletes(t, pub, ids(1, 6000))
	marks, real := 0, map[string]int{}
	for _, m := range e.rawMsgs(t, "main") {
		ev, err := event.Decode(m.Data)
		require.NoError(t, err)
		switch {
		case ev.Op == event.OpMark && ev.Kind == event.MarkUser:
			marks++
		case ev.Op == event.OpDelete:
			real[string(ev.Key)]++
		}
	}
	require.Equal(t, 4, marks, "the mark copies were adopted, not published again")
	require.Len(t, real, 6000)
	for k, n := range real {
		require.Equal(t, 1, n, "row %s stored once", k)
	}
	require.Zero(t, counterValue(t, svc.m.foreign))
}

// TestRestartUpgradesDigestAfterAV1Transaction: a capture writing digest
// v1 (as one before digest v2) is stopped inside a big transaction; the
// restarted capture, writing v2, adopts the stored v1 rows and finishes
// that transaction in v1 (its commit's digest covers the stored rows the
// way they were hashed), then writes the next transaction in v2.
func TestRestartUpgradesDigestAfterAV1Transaction(t *testing.T) {
	t.Parallel()
	e := setup(t)
	itemsTable(t, e, 6000)
	cfg := func(v1 bool) func(c *Config) {
		return func(c *Config) {
			trustConfig(c)
			c.HeartbeatInterval = -1
			c.BrokerSyncInterval = time.Hour // nothing confirmed: the restart replays it all
			c.MaxInFlight = 64
			c.digestV1 = v1
		}
	}
	svc := e.start(t, cfg(true))
	pub := e.publicKey(t)
	ctx := context.Background()
	st, err := e.js.Stream(ctx, event.StreamName("main"))
	require.NoError(t, err)
	e.exec(t, `BEGIN; DELETE FROM items WHERE id <= 2000;
		SELECT pg_logical_emit_message(true, 'epitaph.mark', 'inside');
		DELETE FROM items WHERE id BETWEEN 2001 AND 5000; COMMIT`)
	require.Eventually(t, func() bool {
		m, err := st.GetLastMsgForSubject(ctx, event.MarkSubject("main", 3))
		return err == nil && m != nil
	}, 90*time.Second, 2*time.Millisecond)
	require.NoError(t, svc.Stop(context.Background()))
	require.NoError(t, svc.Wait())
	stored := 0
	for _, m := range e.rawMsgs(t, "main") {
		require.NotEqual(t, ".commit", m.Subject[len(m.Subject)-7:], "stopped inside the transaction")
		if strings.Contains(m.Subject, ".delete.") {
			require.Empty(t, m.Header.Get(event.HeaderDigestAlg), "a v1 capture's row")
			stored++
		}
	}
	require.GreaterOrEqual(t, stored, 2000, "the rows before the mark are stored")

	svc = e.start(t, cfg(false))
	requireStreaming(t, svc)
	e.requireRealDeletes(t, pub, ids(1, 5000))
	e.exec(t, `DELETE FROM items WHERE id > 5000`)
	e.requireRealDeletes(t, pub, ids(1, 6000))
	algs := map[string]map[string]int{} // commit LSN -> alg -> messages
	for _, m := range e.rawMsgs(t, "main") {
		ev, err := event.Decode(m.Data)
		require.NoError(t, err)
		if ev.Op != event.OpDelete && !strings.HasSuffix(m.Subject, ".commit") {
			continue
		}
		k := ev.CommitLSN.String()
		if algs[k] == nil {
			algs[k] = map[string]int{}
		}
		algs[k][m.Header.Get(event.HeaderDigestAlg)]++
	}
	require.Len(t, algs, 2, "two transactions")
	var sawV1, sawV2 bool
	for lsn, a := range algs {
		require.Len(t, a, 1, "transaction %s: one digest version for all its messages: %v", lsn, a)
		switch {
		case a[""] == 5000+1:
			sawV1 = true
		case a[event.DigestAlgV2] == 1000+1:
			sawV2 = true
		default:
			t.Fatalf("transaction %s: %v", lsn, a)
		}
	}
	require.True(t, sawV1 && sawV2, "the interrupted transaction stayed v1, the next one is v2: %v", algs)
	require.Zero(t, counterValue(t, svc.m.foreign))
}
