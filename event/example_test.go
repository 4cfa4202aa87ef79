package event_test

import (
	"fmt"

	"github.com/epitaph-dev/epitaph/event"
)

// A program that reads the stream itself decodes each message's body with
// Decode; a row event is self-contained: table, key, whole row and the
// transaction it belongs to.
func ExampleDecode() {
	body := []byte(`{"v":1,"op":"delete","source":"main","schema":"public","table":"orders",
		"xid":7431,"commit_lsn":"0/1A2B3C8","commit_time":"2026-11-30T09:00:00.123456Z","seq":0,
		"identity":"full","columns":[{"name":"id","type":"int8","pk":true},{"name":"total","type":"numeric"}],
		"key":{"id":42},"row":{"id":42,"total":"12.50"}}`)
	ev, err := event.Decode(body)
	if err != nil {
		fmt.Println("not an event:", err)
		return
	}
	fmt.Println(ev.Op, ev.QualifiedTable(), string(ev.Key), string(ev.Row))
	fmt.Println("transaction", ev.CommitLSN, "row", ev.Seq)

	_, err = event.Decode([]byte(`{"v":9,"op":"delete"}`))
	fmt.Println(err != nil)
	// Output:
	// delete public.orders {"id":42} {"id":42,"total":"12.50"}
	// transaction 0/1A2B3C8 row 0
	// true
}
