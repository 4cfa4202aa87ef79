package testenv

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/epitaph-dev/epitaph/event"
)

// NewSourceStream creates the file-stored stream of source src with one
// partition and wire version 1 in its metadata, as a capture makes it.
func NewSourceStream(tb testing.TB, js jetstream.JetStream, src string) {
	tb.Helper()
	_, err := js.CreateStream(context.Background(), jetstream.StreamConfig{
		Name: event.StreamName(src), Subjects: []string{event.StreamSubjects(src)}, Storage: jetstream.FileStorage,
		Metadata: map[string]string{event.MetaPartitions: "1", event.MetaSource: src, event.MetaWireVersion: "1"},
	})
	if err != nil {
		tb.Fatalf("create the stream of source %s: %v", src, err)
	}
}

// OrdersTx returns the unsigned messages of one transaction of source src
// on partition 0, in the order a capture publishes them: a delete of
// public.orders (key column id, a bigint) for each row image, then the
// commit. alter, when not nil, rewrites the encoded body of each row
// (numbered from 0) before it is put in its message.
func OrdersTx(tb testing.TB, src string, lsn event.LSN, ctime time.Time, alter func(seq int, body []byte) []byte, images ...string) []*nats.Msg {
	tb.Helper()
	msg := func(subject, id string, ev *event.Event) *nats.Msg {
		b, err := event.Encode(ev)
		if err != nil {
			tb.Fatalf("encode %s: %v", id, err)
		}
		if alter != nil && ev.Op == event.OpDelete {
			b = alter(ev.Seq, b)
		}
		m := nats.NewMsg(subject)
		m.Data = b
		m.Header.Set(event.HeaderMsgID, id)
		return m
	}
	var out []*nats.Msg
	for i, img := range images {
		var row map[string]any
		dec := json.NewDecoder(bytes.NewReader([]byte(img)))
		dec.UseNumber()
		if err := dec.Decode(&row); err != nil {
			tb.Fatalf("row image %s: %v", img, err)
		}
		out = append(out, msg(event.DeleteSubject(src, 0, "public", "orders"), event.MsgID(src, lsn, i), &event.Event{
			Op: event.OpDelete, Source: src, Schema: "public", Table: "orders",
			XID: int64(lsn) / 16, CommitLSN: lsn, CommitTime: ctime, Seq: i, Identity: event.IdentityFull,
			Columns: []event.Column{{Name: "id", Type: "bigint", PK: true}},
			Key:     json.RawMessage(fmt.Sprintf(`{"id":%v}`, row["id"])), Row: json.RawMessage(img)}))
	}
	return append(out, msg(event.CommitSubject(src, 0), event.CommitMsgID(src, lsn), &event.Event{
		Op: event.OpCommit, Source: src, XID: int64(lsn) / 16, CommitLSN: lsn,
		CommitTime: ctime, Rows: len(images), Tables: map[string]int{"public.orders": len(images)}}))
}

// FirstRowV2 is an alter for OrdersTx that puts the transaction's first
// row in a wire version this build does not know: an imagined v2 that
// renamed "row" to "image". The projector quarantines it as
// unknown_version; V2Decoder reads it.
func FirstRowV2(seq int, body []byte) []byte {
	if seq != 0 {
		return body
	}
	body = bytes.Replace(body, []byte(`"v":1`), []byte(`"v":2`), 1)
	return bytes.Replace(body, []byte(`"row":`), []byte(`"image":`), 1)
}

// V2Decoder is a decoder taught the imagined v2 of FirstRowV2, as a
// replay after an upgrade would be.
func V2Decoder() *event.Decoder {
	return &event.Decoder{Upgraders: map[int]func([]byte) ([]byte, error){2: func(b []byte) ([]byte, error) {
		var m map[string]json.RawMessage
		if err := json.Unmarshal(b, &m); err != nil {
			return nil, err
		}
		m["v"], m["row"] = json.RawMessage("1"), m["image"]
		delete(m, "image")
		return json.Marshal(m)
	}}}
}
