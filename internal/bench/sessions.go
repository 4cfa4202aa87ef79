package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// PublishSessions makes source's stream (partitions partitions) and writes
// apply delete events of public.sessions to it, perTx to a transaction,
// committed now and signed like the capture's: the rows' ids start after
// idBase (so they never meet rows a bench put in the archive itself), the
// commit LSNs after firstLSN. It returns each partition's last commit LSN.
func PublishSessions(ctx context.Context, natsURL, source string, partitions, apply, perTx int, idBase int64, firstLSN event.LSN) (map[int]event.LSN, error) {
	nc, err := nats.Connect(natsURL)
	if err != nil {
		return nil, err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, err
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: event.StreamName(source), Subjects: []string{event.StreamSubjects(source)},
		Storage: jetstream.FileStorage, Metadata: map[string]string{event.MetaPartitions: strconv.Itoa(partitions),
			event.MetaSource: source, event.MetaWireVersion: "1"}}); err != nil {
		return nil, err
	}
	signer := testenv.NewSigner()
	lsn := firstLSN
	commitTime := time.Now().UTC()
	sent := 0
	last := map[int]event.LSN{}
	for id := idBase; sent < apply; {
		lsn += 0x100
		p := event.Partition(lsn, partitions)
		last[p] = lsn
		n := min(perTx, apply-sent)
		var msgs []*nats.Msg
		for i := 0; i < n; i++ {
			id++
			ev := &event.Event{Op: event.OpDelete, Source: source, Schema: "public", Table: "sessions", XID: int64(lsn) / 16,
				CommitLSN: lsn, CommitTime: commitTime, Seq: i, Identity: event.IdentityFull,
				Columns: []event.Column{{Name: "id", Type: "bigint", PK: true}},
				Key:     json.RawMessage(fmt.Sprintf(`{"id":%d}`, id)),
				Row:     json.RawMessage(fmt.Sprintf(`{"id":%d,"email":"s%d@example.com","token":"%032d"}`, id, id-idBase, id-idBase))}
			m, err := sessionMessage(event.DeleteSubject(source, p, "public", "sessions"), event.MsgID(source, lsn, i), ev)
			if err != nil {
				return nil, err
			}
			msgs = append(msgs, m)
		}
		commit := &event.Event{Op: event.OpCommit, Source: source, XID: int64(lsn) / 16, CommitLSN: lsn, CommitTime: commitTime,
			Rows: n, Tables: map[string]int{"public.sessions": n}}
		m, err := sessionMessage(event.CommitSubject(source, p), event.CommitMsgID(source, lsn), commit)
		if err != nil {
			return nil, err
		}
		for _, m := range append(msgs, m) {
			signer.Sign(m)
			if _, err := js.PublishMsgAsync(m); err != nil {
				return nil, err
			}
		}
		sent += n
		if sent%2000 < perTx || sent == apply { // at most ~2,200 messages pending (the limit is 4,000)
			select {
			case <-js.PublishAsyncComplete():
			case <-time.After(time.Minute):
				return nil, fmt.Errorf("publish did not complete")
			}
		}
	}
	return last, nil
}

func sessionMessage(subject, id string, ev *event.Event) (*nats.Msg, error) {
	b, err := event.Encode(ev)
	if err != nil {
		return nil, err
	}
	m := nats.NewMsg(subject)
	m.Data = b
	m.Header.Set(event.HeaderMsgID, id)
	m.Header.Set(event.HeaderVersion, "1")
	return m, nil
}
