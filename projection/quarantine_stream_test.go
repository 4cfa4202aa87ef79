package projection_test

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
)

// A stream deleted and made anew numbers its messages from 1 again: a
// message quarantined from it at a sequence an entry of the old stream
// holds, resolved long ago, is a new open entry, not an attempt of the
// old one (which would leave the message resolved, unseen, and its
// deletes missing with nothing open to say so).
func TestRecreatedStreamsQuarantinedMessageIsNotTakenForAnOldEntry(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	ctx := context.Background()
	c := e.conn()
	publishRaw := func(id string, data []byte) {
		m := nats.NewMsg(event.CommitSubject(src, 0))
		m.Data = data
		m.Header.Set(event.HeaderMsgID, id)
		_, err := e.js.PublishMsg(ctx, m)
		require.NoError(t, err)
	}
	e.publish(e.nextTx(orderRows(1, 1)...))
	publishRaw("garbage-old", []byte("not json at all"))
	s := e.start(e.config("w1"))
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM epitaph.quarantine`) == 1 })
	var seq int64
	require.NoError(t, c.QueryRow(ctx, `SELECT stream_seq FROM epitaph.quarantine`).Scan(&seq))
	_, err := c.Exec(ctx, `UPDATE epitaph.quarantine SET status = 'discarded', resolved_at = now(), resolution_reason = 'old'`)
	require.NoError(t, err)
	require.NoError(t, s.Stop(ctx))

	require.NoError(t, e.js.DeleteStream(ctx, event.StreamName(src)))
	e.createStream()
	e.publish(e.nextTx(orderRows(2, 1)...))
	publishRaw("garbage-new", []byte("{not json either"))
	e.start(e.config("w2"))
	eventually(t, 30*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 4 },
		"the new stream's transaction is archived")
	eventually(t, 20*time.Second, func() bool {
		return count(t, c, `SELECT count(*) FROM epitaph.quarantine WHERE status = 'open'`) == 1
	}, "the new stream's message at sequence %d is an open entry; entries: %d", seq,
		count(t, c, `SELECT count(*) FROM epitaph.quarantine`))
	require.Equal(t, 1, count(t, c, `SELECT count(*) FROM epitaph.quarantine WHERE status = 'open' AND stream_seq = $1
		AND convert_from(data, 'UTF8') = '{not json either'`, seq), "the new message, at the old entry's sequence")
	require.Equal(t, 1, count(t, c, `SELECT count(*) FROM epitaph.quarantine WHERE status = 'discarded'
		AND convert_from(data, 'UTF8') = 'not json at all' AND attempts = 1`), "the old entry kept as it was resolved")
}
