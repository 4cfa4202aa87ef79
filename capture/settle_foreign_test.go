package capture

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
)

// A message with a body on the settle subject is never a settle probe (a
// probe is empty; a server of 2.12 or later stores none): like any other
// message the capture did not publish, it is foreign, logged and counted
// at the resume, not skipped unseen.
func TestMessageWithABodyOnTheSettleSubjectIsCountedForeign(t *testing.T) {
	t.Parallel()
	e := setup(t)
	itemsTable(t, e, 30)
	ctx := context.Background()
	svc := e.start(t, nil)
	e.exec(t, `DELETE FROM items WHERE id <= 10`)
	e.messages(t, "main", 11)
	require.NoError(t, svc.Stop(ctx))
	// A forger with the capture's credentials, after the last commit.
	m := nats.NewMsg(event.SettleSubject("main"))
	m.Header.Set(event.HeaderMsgID, "main/0/0/forged")
	m.Data = []byte(`{"op":"delete","forged":true}`)
	_, err := e.js.PublishMsg(ctx, m)
	require.NoError(t, err)
	svc = e.start(t, nil)
	e.exec(t, `DELETE FROM items WHERE id > 10`)
	var raw []*jetstream.RawStreamMsg
	require.Eventually(t, func() bool {
		raw = e.rawMsgs(t, "main")
		return len(raw) >= 11+1+21
	}, time.Minute, 50*time.Millisecond)
	require.Equal(t, 1.0, counterValue(t, svc.m.foreign), "the forged message was not counted as foreign")
}
