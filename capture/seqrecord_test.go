package capture

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// A deleted tail is a jump, never renumbered: a transaction's messages
// deleted from the end of the stream while the capture is stopped
// (JetStream's STREAM.MSG.DELETE, which the erase credential may use) leave
// the next transaction's partition sequences above the deleted ones, with
// both records, with the source's record alone (data dir lost) and with
// the data dir's alone.
func TestDeletedTailIsNotRenumbered(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE items (id int PRIMARY KEY); ALTER TABLE items REPLICA IDENTITY FULL;
		INSERT INTO items SELECT generate_series(1, 40)`)
	ctx := context.Background()
	mod := func(c *Config) { c.Partitions = 1; c.Tables = []string{"items"} }
	name := event.StreamName("main")
	file := seqFile(e.dir, "main")

	// lastSeq is the stream's last sequence; partSeq a stored message's
	// partition sequence.
	lastSeq := func() uint64 {
		st, err := e.js.Stream(ctx, name)
		require.NoError(t, err)
		info, err := st.Info(ctx)
		require.NoError(t, err)
		return info.State.LastSeq
	}
	partSeq := func(seq uint64) uint64 {
		st, err := e.js.Stream(ctx, name)
		require.NoError(t, err)
		m, err := st.GetMsg(ctx, seq)
		require.NoError(t, err)
		ps, err := strconv.ParseUint(m.Header.Get(event.HeaderPartitionSeq), 10, 64)
		require.NoError(t, err, "message %d", seq)
		return ps
	}
	sourceRecord := func() int64 {
		var n int64
		require.NoError(t, queryRow(t, e.db, `SELECT seq FROM epitaph.capture_partition_seqs WHERE stream = $1 AND partition = 0`, []any{name}, &n))
		return n
	}
	// deleteTail deletes the stream's last n messages, returning the
	// highest partition sequence deleted.
	deleteTail := func(n int) uint64 {
		last := lastSeq()
		st, err := e.js.Stream(ctx, name)
		require.NoError(t, err)
		var top uint64
		for seq := last; seq > last-uint64(n); seq-- {
			top = max(top, partSeq(seq))
			require.NoError(t, st.DeleteMsg(ctx, seq))
		}
		return top
	}
	stop := func(svc *Service) {
		require.NoError(t, svc.Stop(ctx))
		require.NoError(t, svc.Wait())
	}
	// round deletes ids from and from+1 in one transaction and returns
	// the partition sequences of its three messages (two rows, a commit).
	round := func(from int) []uint64 {
		before := lastSeq()
		e.exec(t, `DELETE FROM items WHERE id IN ($1, $2)`, from, from+1)
		require.Eventually(t, func() bool { return lastSeq() >= before+3 }, 60*time.Second, 20*time.Millisecond)
		st, err := e.js.Stream(ctx, name)
		require.NoError(t, err)
		ms := storedMsgs(t, st, before+1, before+3)
		require.Len(t, ms, 3)
		var out []uint64
		for i, m := range ms {
			ev, err := event.Decode(m.Data)
			require.NoError(t, err)
			if i < 2 {
				require.Equal(t, event.OpDelete, ev.Op)
				require.Contains(t, string(ev.Row), strconv.Itoa(from+i))
			} else {
				require.Equal(t, event.OpCommit, ev.Op)
			}
			ps, err := strconv.ParseUint(m.Header.Get(event.HeaderPartitionSeq), 10, 64)
			require.NoError(t, err)
			out = append(out, ps)
		}
		return out
	}

	svc := e.start(t, mod)
	require.Equal(t, []uint64{1, 2, 3}, round(1))
	require.Equal(t, []uint64{4, 5, 6}, round(3))
	require.Equal(t, []uint64{7, 8, 9}, round(5))
	stop(svc)
	require.EqualValues(t, 9, sourceRecord(), "the source's record after a clean stop")
	b, err := os.ReadFile(file)
	require.NoError(t, err)
	var body seqFileBody
	require.NoError(t, json.Unmarshal(b, &body))
	require.Equal(t, "EPITAPH_MAIN", body.Stream)
	require.Equal(t, []uint64{9}, body.Seqs)
	_, err = event.ParseLSN(body.ConfirmedLSN)
	require.NoError(t, err)
	fi, err := os.Stat(file)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), fi.Mode().Perm())

	// Both records: the next transaction continues after the deleted one.
	require.EqualValues(t, 9, deleteTail(3))
	svc = e.start(t, mod)
	require.Equal(t, []uint64{10, 11, 12}, round(7), "not 7, 8, 9 again")
	require.Equal(t, 1.0, counterValue(t, svc.m.tailRemoved))
	stop(svc)

	// The data dir lost: the source's record alone.
	require.NoError(t, os.Remove(file))
	require.EqualValues(t, 12, deleteTail(3))
	svc = e.start(t, mod)
	require.Equal(t, []uint64{13, 14, 15}, round(9), "not 10, 11, 12 again")
	stop(svc)

	// The source's record lost: the data dir's alone.
	e.exec(t, `DELETE FROM epitaph.capture_partition_seqs`)
	require.EqualValues(t, 15, deleteTail(3))
	svc = e.start(t, mod)
	require.Equal(t, []uint64{16, 17, 18}, round(11), "not 13, 14, 15 again")
	stop(svc)

	// Nothing deleted: a restart continues exactly, counting nothing.
	svc = e.start(t, mod)
	require.Equal(t, []uint64{19, 20, 21}, round(13))
	require.Zero(t, counterValue(t, svc.m.tailRemoved))
}

// The partition sequences the tracker hands to the records are those of
// the confirmable position: only signed messages acknowledged before it,
// and only once it is synced.
func TestTrackerSafeSeqsFollowTheSafePosition(t *testing.T) {
	t.Parallel()
	t0 := time.Date(2026, 12, 6, 4, 0, 0, 0, time.UTC)
	tr := newTracker(10*time.Second, t0)
	tr.startSeqs([]uint64{5, 7}, []uint64{5, 7})

	row, commit1, commit2 := newFake(), newFake(), newFake()
	tr.add(row, 10, "row")                      // partition 0, seq 6: not signed
	tr.addSigned(commit1, 10, "commit 1", 0, 7) // partition 0
	tr.mark(200, t0)                            // end of tx 1
	tr.addSigned(commit2, 10, "commit 2", 1, 9) // partition 1 (a mark at 8 adopted)
	tr.mark(300, t0)                            // end of tx 2
	require.Equal(t, []uint64{5, 7}, tr.safeSeqs)

	row.ack()
	commit1.ack()
	require.NoError(t, tr.poll(t0.Add(time.Second)))
	require.Equal(t, []uint64{7, 7}, tr.acked)
	require.Equal(t, []uint64{5, 7}, tr.safeSeqs, "acknowledged, not synced")
	require.Equal(t, event.LSN(200), tr.safeLSN(t0.Add(12*time.Second)))
	require.Equal(t, []uint64{7, 7}, tr.safeSeqs)

	commit2.ack()
	require.NoError(t, tr.poll(t0.Add(5*time.Second)))
	require.Equal(t, event.LSN(200), tr.safeLSN(t0.Add(12*time.Second)), "tx 2's ack is not synced yet")
	require.Equal(t, []uint64{7, 7}, tr.safeSeqs)
	require.Equal(t, event.LSN(300), tr.safeLSN(t0.Add(16*time.Second)))
	require.Equal(t, []uint64{7, 9}, tr.safeSeqs)

	// An acknowledgement after a position never reaches it.
	late := newFake()
	tr.mark(400, t0.Add(20*time.Second))
	tr.addSigned(late, 1, "mark", 0, 8)
	late.ack()
	require.NoError(t, tr.poll(t0.Add(21*time.Second)))
	require.Equal(t, event.LSN(400), tr.safeLSN(t0.Add(time.Hour)))
	require.Equal(t, []uint64{7, 9}, tr.safeSeqs, "the mark after 400 is not in 400's sequences")
}

// A source's record made by another role (a first run as a superuser) that
// the capture's role may not write: the capture streams all the same, on
// the data dir's record, and uses the table once granted.
func TestSeqTableOfAnotherRole(t *testing.T) {
	t.Parallel()
	e := setup(t)
	db := dbName(t, e.db)
	pg := testenv.SharedPostgres(t)
	app, capRole := db+"_app", db+"_capture"
	e.exec(t, `CREATE ROLE `+app+` LOGIN;
		GRANT CREATE ON SCHEMA public TO `+app+`;
		CREATE ROLE `+capRole+` LOGIN REPLICATION;
		GRANT CREATE ON DATABASE `+db+` TO `+capRole+`;
		GRANT `+app+` TO `+capRole+`;
		CREATE SCHEMA epitaph; `+sqlSeqTable)
	t.Cleanup(func() {
		testenv.Exec(t, pg.URL("postgres"), `DROP OWNED BY `+app+`, `+capRole+` CASCADE`)
	})
	testenv.Exec(t, pg.UserURL(app, db), `CREATE TABLE items (id int PRIMARY KEY); ALTER TABLE items REPLICA IDENTITY FULL;
		INSERT INTO items SELECT generate_series(1, 10)`)
	mod := func(c *Config) { c.SourceURL = pg.UserURL(capRole, db); c.Tables = []string{"items"}; c.Partitions = 1 }

	svc := e.start(t, mod)
	require.False(t, svc.seqTableOK.Load(), "the table is not the capture role's to write")
	testenv.Exec(t, pg.UserURL(app, db), `DELETE FROM items WHERE id = 1`)
	require.Len(t, e.deletes(t, "main", 1), 1)
	require.NoError(t, svc.Stop(context.Background()))
	require.NoError(t, svc.Wait())
	b, err := os.ReadFile(seqFile(e.dir, "main"))
	require.NoError(t, err)
	var body seqFileBody
	require.NoError(t, json.Unmarshal(b, &body))
	require.Equal(t, []uint64{2}, body.Seqs, "the data dir's record: a row and its commit")
	require.Equal(t, "0", queryString(t, e.db, `SELECT count(*)::text FROM epitaph.capture_partition_seqs`))

	e.exec(t, `GRANT USAGE ON SCHEMA epitaph TO `+capRole+`; GRANT SELECT, INSERT, UPDATE, DELETE ON epitaph.capture_partition_seqs TO `+capRole)
	svc = e.start(t, mod)
	require.True(t, svc.seqTableOK.Load())
	testenv.Exec(t, pg.UserURL(app, db), `DELETE FROM items WHERE id = 2`)
	require.Len(t, e.deletes(t, "main", 2), 2)
	require.NoError(t, svc.Stop(context.Background()))
	require.NoError(t, svc.Wait())
	require.Equal(t, "4", queryString(t, e.db, `SELECT seq::text FROM epitaph.capture_partition_seqs WHERE stream = 'EPITAPH_MAIN' AND partition = 0`))
}

// A data dir that does not exist yet, beside an external broker and a
// signing key kept elsewhere: the capture makes it, writes the public key
// there and records the partition sequences in it at its confirmations
// (it used to log "cannot record the partition sequences" at every one).
func TestDataDirMadeForAnExternalBroker(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE items (id int PRIMARY KEY); ALTER TABLE items REPLICA IDENTITY FULL;
		INSERT INTO items SELECT generate_series(1, 4)`)
	dir := filepath.Join(t.TempDir(), "not", "yet")
	key := filepath.Join(t.TempDir(), "signing.key")
	e.start(t, func(c *Config) { c.Partitions = 1; c.Tables = []string{"items"}; c.DataDir = dir; c.SigningKey = key })
	e.exec(t, `DELETE FROM items`)
	require.Eventually(t, func() bool {
		b, err := os.ReadFile(seqFile(dir, "main"))
		return err == nil && strings.Contains(string(b), `"seqs":[5]`)
	}, 60*time.Second, 50*time.Millisecond, "the partition sequences recorded in the data dir")
	_, err := os.Stat(filepath.Join(dir, "signing.pub"))
	require.NoError(t, err, "the public key beside them")
}
