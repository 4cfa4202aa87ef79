package projection_test

import (
	"bytes"
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection"
	"github.com/epitaph-dev/epitaph/projection/trust"
	"github.com/epitaph-dev/epitaph/quarantine"
)

// upgradedReplay replays the archive's quarantine entries of category
// with a decoder taught wire version 2 ("v":2 read as "v":1), as
// projectors upgraded to know it would (upgrade.md).
func upgradedReplay(t *testing.T, e *env, category string) quarantine.ReplayResult {
	t.Helper()
	apply := projection.ReplayFunc(projection.ReplayConfig{Logger: testLogger(t), Decoder: &event.Decoder{Upgraders: map[int]func([]byte) ([]byte, error){
		2: func(b []byte) ([]byte, error) { return bytes.Replace(b, []byte(`"v":2`), []byte(`"v":1`), 1), nil },
	}}})
	res, err := quarantine.Replay(context.Background(), newPool(t, e.url), quarantine.Selection{Filter: quarantine.Filter{Projection: "archive", Category: quarantine.Category(category)}}, apply)
	require.NoError(t, err)
	return res
}

// A row message this build cannot decode (a wire version it does not
// know) is quarantined as it arrives, under a category that replay takes
// once the projectors are upgraded (upgrade.md). A forger's such row,
// claiming a real transaction's commit LSN or one of its own, is covered
// by no signed commit: the boundary that closes its window refuses it,
// and its entry becomes unauthenticated, which replay never archives.
// Before, it kept its category, and the documented replay archived the
// forged row as verified.
func TestAnUndecodableForgedRowIsNeverReplayedAsVerified(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		ownLSN bool // the forgery claims a commit LSN no commit has
	}{{"a real transaction's LSN", false}, {"an LSN of its own", true}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, 1)
			e.start(e.config("w1"))
			c := e.conn()

			tx1 := e.nextTx(orderRows(1, 1)...)
			e.publish(tx1) // stream seqs 1-3

			msgs := e.messages(tx1)
			var ev event.Event
			require.NoError(t, json.Unmarshal(msgs[1].Data, &ev))
			ev.Seq = 2
			ev.Key, ev.Row = json.RawMessage(`{"id":666}`), json.RawMessage(`{"id":666,"order_id":1,"qty":666}`)
			if tc.ownLSN {
				ev.CommitLSN, ev.Seq = e.nextTx().lsn, 0
			}
			data, err := event.Encode(&ev)
			require.NoError(t, err)
			forged := nats.NewMsg(msgs[1].Subject)
			forged.Data = bytes.Replace(data, []byte(`"v":1`), []byte(`"v":2`), 1)
			forged.Header.Set(event.HeaderMsgID, "forged-666")
			e.foreign(forged) // stream seq 4
			// Applied (quarantined) in a page of its own: the window is
			// read back when it closes.
			eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == 4 })

			tx2 := e.nextTx(orderRows(2, 1)...)
			e.publish(tx2) // stream seqs 5-7: its commit closes the forgery's window
			eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == 7 })
			want := expected(t, c, tx1, tx2)
			require.Equal(t, want, archived(t, c, "archive.rows"))
			q := quarantined(t, c)
			require.Len(t, q, 1)
			require.Equal(t, trust.CategoryUnauthenticated, q[0].category, "refused by the commit that closed its window")

			res := upgradedReplay(t, e, "")
			require.Empty(t, res.Replayed)
			require.Equal(t, want, archived(t, c, "archive.rows"), "the forged row is never visible")
		})
	}
}

// Replay archives a row visible, as its signed commit would have, so it
// waits for that commit: a row quarantined in the partition's open window
// (its transaction's commit not applied yet) is not replayed. Once the
// signed commit covering it is applied, the same replay archives it.
func TestReplayWaitsForTheRowsSignedCommit(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	e.start(e.config("w1"))
	c := e.conn()
	ctx := context.Background()

	tx := e.nextTx(orderRows(1, 1)...) // order 1 (seq 0), its line (seq 1)
	msgs := e.messages(tx)
	msgs[1].Data = bytes.Replace(msgs[1].Data, []byte(`"v":1`), []byte(`"v":2`), 1)
	for _, m := range msgs[:2] { // the rows; the commit comes later
		_, err := e.pubMsg(ctx, m)
		require.NoError(t, err)
	}
	eventually(t, 20*time.Second, func() bool {
		return count(t, c, `SELECT cursor FROM epitaph.progress`) == 2 &&
			count(t, c, `SELECT count(*) FROM epitaph.quarantine WHERE category = 'unknown_version'`) == 1
	})
	res := upgradedReplay(t, e, "unknown_version")
	require.Empty(t, res.Replayed)
	require.Len(t, res.Failed, 1)
	var why, category string
	require.NoError(t, c.QueryRow(ctx, `SELECT error, category FROM epitaph.quarantine WHERE id = $1`, res.Failed[0]).Scan(&why, &category))
	require.Contains(t, why, "not replayed yet")
	require.Equal(t, "unknown_version", category, "the entry keeps its category for a later replay")
	require.Empty(t, archived(t, c, "archive.rows"), "nothing visible before the commit")

	_, err := e.pubMsg(ctx, msgs[2]) // the signed commit, over both rows
	require.NoError(t, err)
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == 3 })
	require.Equal(t, []string{expected(t, c, tx)[0]}, archived(t, c, "archive.rows"), "the order, verified; its line waits in quarantine")
	res = upgradedReplay(t, e, "unknown_version")
	require.Len(t, res.Replayed, 1)
	require.Equal(t, expected(t, c, tx), archived(t, c, "archive.rows"))
}

// Replaying a row of a transaction whose commit was applied makes the
// transaction's unverified rows visible with it (its deliveries are
// released as that commit's would have been). A forger's decodable row
// claiming that transaction, pending in the partition's open window,
// would be among them: the replay waits until the boundary that closes
// the window has refused it.
func TestReplayWaitsOutForgedRowsClaimingItsTransaction(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	e.start(e.config("w1"))
	c := e.conn()
	ctx := context.Background()

	tx := e.nextTx(orderRows(1, 1)...)
	msgs := e.messages(tx)
	msgs[1].Data = bytes.Replace(msgs[1].Data, []byte(`"v":1`), []byte(`"v":2`), 1)
	for _, m := range msgs {
		_, err := e.pubMsg(ctx, m)
		require.NoError(t, err)
	}
	// The forgery: another line of order 1 in the same transaction.
	var ev event.Event
	require.NoError(t, json.Unmarshal(e.messages(tx)[1].Data, &ev))
	ev.Seq = 5
	ev.Key, ev.Row = json.RawMessage(`{"id":666}`), json.RawMessage(`{"id":666,"order_id":1,"qty":666}`)
	data, err := event.Encode(&ev)
	require.NoError(t, err)
	forged := nats.NewMsg(msgs[1].Subject)
	forged.Data = data
	forged.Header.Set(event.HeaderMsgID, "forged-666")
	e.foreign(forged) // stream seq 4: pending, its window open
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == 4 })

	res := upgradedReplay(t, e, "unknown_version")
	require.Empty(t, res.Replayed)
	require.Len(t, res.Failed, 1)
	require.Equal(t, []string{expected(t, c, tx)[0]}, archived(t, c, "archive.rows"), "the forged row stays invisible")

	tx2 := e.nextTx(orderRows(2, 1)...)
	e.publish(tx2) // its commit closes the window: the forgery is refused
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT cursor FROM epitaph.progress`) == 7 })
	res = upgradedReplay(t, e, "unknown_version")
	require.Len(t, res.Replayed, 1)
	require.Equal(t, expected(t, c, tx, tx2), archived(t, c, "archive.rows"), "the replayed line; never the forged one")
}

// A gap message this build cannot decode is quarantined as it arrives
// (unknown_version), unverified: it is not a boundary to this build.
// Replayed after an upgrade, it is verified as at arrival: a forger's gap,
// unsigned or signed with a key the target does not trust, is refused as
// unauthenticated and records nothing. The capture's own is recorded
// (TestReplayGapRecordsIt), and so is an unsigned one at or before the
// partition's legacy boundary (written before signing).
func TestReplayVerifiesAnUndecodableGap(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		sign   func(m *nats.Msg)
		legacy bool // an operator vouched for the partition's unsigned messages up to the gap
	}{
		{"unsigned", func(*nats.Msg) {}, false},
		{"signed with an untrusted key", func(m *nats.Msg) { testenv.NewSigner().Sign(m) }, false},
		{"unsigned, before the legacy boundary", func(*nats.Msg) {}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, 1)
			ctx := context.Background()
			e.publish(e.nextTx(orderRows(1, 1)...)) // signed by the capture: its key is trusted
			from := e.heartbeat()
			to := event.LSN(e.lsn.Add(0x10000))
			ev := &event.Event{Op: event.OpGap, Source: src, Partition: 0, FromLSN: from, ToLSN: to, LSN: to,
				Reason: "slot recreated", Time: time.Now().UTC()}
			m := e.msg(event.GapSubject(src, 0), event.GapMsgID(src, from, to, 0), ev)
			m.Data = bytes.Replace(m.Data, []byte(`"v":1`), []byte(`"v":2`), 1)
			tc.sign(m)
			e.foreign(m) // stream seq 5
			c := e.conn()
			if tc.legacy {
				pool := newPool(t, e.url)
				require.NoError(t, migrations.Apply(ctx, pool))
				require.NoError(t, trust.RecordLegacyBoundary(ctx, pool, event.StreamName(src), 0, 5))
			}
			e.start(e.config("w1"))
			eventually(t, 20*time.Second, func() bool {
				return count(t, c, `SELECT count(*) FROM epitaph.quarantine WHERE category = 'unknown_version'`) == 1
			})

			res := upgradedReplay(t, e, "unknown_version")
			if tc.legacy {
				require.Len(t, res.Replayed, 1)
				require.Equal(t, []string{"lost_upstream " + from.String() + " " + to.String()},
					keysOf(t, c, `SELECT concat_ws(' ', kind, from_lsn::text, to_lsn::text) FROM archive.gaps`))
				return
			}
			require.Empty(t, res.Replayed)
			require.Len(t, res.Failed, 1)
			var why, category string
			require.NoError(t, c.QueryRow(ctx, `SELECT error, category FROM epitaph.quarantine WHERE id = $1`, res.Failed[0]).Scan(&why, &category))
			require.Equal(t, trust.CategoryUnauthenticated, category)
			require.Contains(t, why, "failed verification")
			require.Zero(t, count(t, c, `SELECT count(*) FROM archive.gaps`), "no gap recorded")
		})
	}
}
