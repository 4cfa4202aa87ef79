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

// Sessions is what PublishSessions writes.
type Sessions struct {
	NATSURL, Source          string
	Partitions, Apply, PerTx int
	IDBase                   int64
	FirstLSN                 event.LSN
}

// PublishSessions makes s.Source's stream (s.Partitions partitions) and
// writes s.Apply delete events of public.sessions to it, s.PerTx to a
// transaction, committed now and signed like the capture's: the rows' ids
// start after s.IDBase (so they never meet rows a bench put in the archive
// itself), the commit LSNs after s.FirstLSN. It returns each partition's
// last commit LSN.
func PublishSessions(ctx context.Context, s Sessions) (map[int]event.LSN, error) {
	nc, err := nats.Connect(s.NATSURL)
	if err != nil {
		return nil, err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, err
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: event.StreamName(s.Source), Subjects: []string{event.StreamSubjects(s.Source)},
		Storage: jetstream.FileStorage, Metadata: map[string]string{event.MetaPartitions: strconv.Itoa(s.Partitions),
			event.MetaSource: s.Source, event.MetaWireVersion: "1"}}); err != nil {
		return nil, err
	}
	signer := testenv.NewSigner()
	lsn := s.FirstLSN
	commitTime := time.Now().UTC()
	sent := 0
	last := map[int]event.LSN{}
	for id := s.IDBase; sent < s.Apply; {
		lsn += 0x100
		p := event.Partition(lsn, s.Partitions)
		last[p] = lsn
		n := min(s.PerTx, s.Apply-sent)
		var msgs []*nats.Msg
		for i := 0; i < n; i++ {
			id++
			ev := &event.Event{Op: event.OpDelete, Source: s.Source, Schema: "public", Table: "sessions", XID: int64(lsn) / 16,
				CommitLSN: lsn, CommitTime: commitTime, Seq: i, Identity: event.IdentityFull,
				Columns: []event.Column{{Name: "id", Type: "bigint", PK: true}},
				Key:     json.RawMessage(fmt.Sprintf(`{"id":%d}`, id)),
				Row:     json.RawMessage(fmt.Sprintf(`{"id":%d,"email":"s%d@example.com","token":"%032d"}`, id, id-s.IDBase, id-s.IDBase))}
			m, err := sessionMessage(event.DeleteSubject(s.Source, p, "public", "sessions"), event.MsgID(s.Source, lsn, i), ev)
			if err != nil {
				return nil, err
			}
			msgs = append(msgs, m)
		}
		commit := &event.Event{Op: event.OpCommit, Source: s.Source, XID: int64(lsn) / 16, CommitLSN: lsn, CommitTime: commitTime,
			Rows: n, Tables: map[string]int{"public.sessions": n}}
		m, err := sessionMessage(event.CommitSubject(s.Source, p), event.CommitMsgID(s.Source, lsn), commit)
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
		if sent%2000 < s.PerTx || sent == s.Apply { // at most ~2,200 messages pending (the limit is 4,000)
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
