package event_test

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"

	"github.com/epitaph-dev/epitaph/event"
)

// FuzzDecode: no input panics, and every input either decodes — and then
// encodes to a body that decodes to an equal event (encoding is a fixpoint)
// — or fails with a classified *event.DecodeError. Whenever the fast path
// accepts a body, the encoding/json path gives the same event or the same
// error. The seed corpus in
// testdata/fuzz/FuzzDecode holds a valid event of every op, v2 bodies,
// wrong types and garbage. Both the default decoder and one taught a v2
// format are exercised.
func FuzzDecode(f *testing.F) {
	f.Add([]byte(`{"v":1,"op":"commit","source":"main","xid":1,"commit_lsn":"0/10","rows":1,"tables":{"public.t":1}}`))
	f.Add([]byte(`{"v":2,"op":"delete"}`))
	f.Add([]byte("garbage"))
	f.Add([]byte(`{"v":1,"op":"delete","source":"m\u0061in","schema":"p\u00e9","table":"t\ud800","xid":7,"commit_lsn":"0/1A","commit_time":"2026-11-30T09:00:00.123456Z","seq":0,"identity":"full","columns":[{"name":"id","type":"int8","pk":true}],"key":{"id":1},"row":{"id":1, "v" : [1, {"a":null}]},"refs":[]}`))
	f.Add([]byte(`{"v":1,"OP":"commit","source":"main","commit_lsn":"0/10","rows":1.0,"tables":{"public.t":1}}`))
	f.Add([]byte(`{"v":1,"op":"mark","source":"main","lsn":"0/10","kind":null,"time":null,"partition":-0,"content":"é"}`))

	taught := &event.Decoder{Upgraders: map[int]func([]byte) ([]byte, error){2: upgradeV2}}
	f.Fuzz(func(t *testing.T, data []byte) {
		for _, d := range []*event.Decoder{{}, taught} {
			checkDecode(t, d, data)
		}
		checkFastMatchesSlow(t, data)
	})
}

func checkFastMatchesSlow(t *testing.T, data []byte) {
	trimmed := bytes.TrimSpace(data)
	fast, ok := event.DecodeFast(trimmed)
	if !ok {
		return
	}
	slow, err := event.DecodeSlow(trimmed)
	if ferr := fast.Validate(); ferr != nil {
		if err == nil || err.Error() != ferr.Error() {
			t.Fatalf("fast path: %v; encoding/json path: %v", ferr, err)
		}
		return
	}
	if err != nil {
		t.Fatalf("fast path accepted what encoding/json refuses (%v):\n%q", err, data)
	}
	if !reflect.DeepEqual(fast, slow) {
		t.Fatalf("fast and encoding/json paths differ:\n%+v\n%+v", fast, slow)
	}
}

func checkDecode(t *testing.T, d *event.Decoder, data []byte) {
	e, err := d.Decode(data)
	if err != nil {
		if e != nil {
			t.Fatalf("Decode returned an event and an error: %v", err)
		}
		if _, ok := event.CategoryOf(err); !ok {
			t.Fatalf("unclassified error %T: %v", err, err)
		}
		return
	}
	if e == nil {
		t.Fatal("Decode returned neither event nor error")
	}
	enc, err := event.Encode(e)
	if err != nil {
		t.Fatalf("decoded event does not encode: %v", err)
	}
	e2, err := event.Decode(enc)
	if err != nil {
		t.Fatalf("re-encoded event does not decode: %v\n%s", err, enc)
	}
	enc2, err := event.Encode(e2)
	if err != nil {
		t.Fatalf("re-decoded event does not encode: %v", err)
	}
	if !bytes.Equal(enc, enc2) {
		t.Fatalf("decode/encode is not a fixpoint:\n%s\n%s", enc, enc2)
	}
	if e.Op != e2.Op || e.Source != e2.Source || e.CommitLSN != e2.CommitLSN || e.Seq != e2.Seq ||
		e.XID != e2.XID || !e.CommitTime.Equal(e2.CommitTime) || e.QualifiedTable() != e2.QualifiedTable() {
		t.Fatalf("round trip changed the event:\n%+v\n%+v", e, e2)
	}
}

// upgradeV2 reads an imagined v2 that renamed "row" to "image".
func upgradeV2(b []byte) ([]byte, error) {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, err
	}
	m["v"] = json.RawMessage("1")
	if img, ok := m["image"]; ok {
		m["row"] = img
		delete(m, "image")
	}
	return json.Marshal(m)
}

// TestSeedCorpus checks that the checked-in seeds are what their names say,
// so the fuzzer starts from every op and from each kind of bad input.
func TestSeedCorpus(t *testing.T) {
	t.Parallel()
	read := func(name string) []byte {
		b, err := os.ReadFile(filepath.Join("testdata", "fuzz", "FuzzDecode", name))
		if err != nil {
			t.Fatal(err)
		}
		lit, ok := strings.CutPrefix(strings.TrimSpace(string(b)), "go test fuzz v1\n[]byte(")
		if !ok {
			t.Fatalf("%s: not a corpus file", name)
		}
		s, err := strconv.Unquote(strings.TrimSuffix(lit, ")"))
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		return []byte(s)
	}
	ops := map[string]event.Op{
		"delete_full": event.OpDelete, "delete_key": event.OpDelete, "delete_nothing": event.OpDelete,
		"delete_rowref": event.OpDelete, "truncate": event.OpTruncate, "commit": event.OpCommit,
		"mark": event.OpMark, "heartbeat": event.OpMark, "gap": event.OpGap, "gap_table": event.OpGap,
	}
	for name, op := range ops {
		e, err := event.Decode(read(name))
		if err != nil || e.Op != op {
			t.Fatalf("%s: want a %s event, got %v, %v", name, op, e, err)
		}
		if _, ok := event.DecodeFast(read(name)); !ok {
			t.Fatalf("%s: the fast path does not take what the capture writes", name)
		}
	}
	bad := map[string]event.Category{
		"v2_delete": event.CategoryUnknownVersion, "v_string": event.CategoryInvalid, "empty": event.CategoryMalformed,
		"array": event.CategoryMalformed, "binary": event.CategoryMalformed, "seq_string": event.CategoryInvalid,
		"lsn_bad": event.CategoryInvalid, "row_string": event.CategoryInvalid, "op_unknown": event.CategoryInvalid,
		"tables_mismatch": event.CategoryInvalid, "trailing": event.CategoryMalformed,
		"gap_kind_unknown": event.CategoryInvalid,
	}
	for name, want := range bad {
		_, err := event.Decode(read(name))
		if got, ok := event.CategoryOf(err); !ok || got != want {
			t.Fatalf("%s: want %s, got %v", name, want, err)
		}
	}
	taught := &event.Decoder{Upgraders: map[int]func([]byte) ([]byte, error){2: upgradeV2}}
	e, err := taught.Decode(read("v2_delete"))
	if err != nil || string(e.Row) != `{"id":1}` {
		t.Fatalf("v2 taught: %v, %v", e, err)
	}
}
