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
	"time"
	"unicode/utf8"

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

// FuzzAppendDelete: AppendDelete writes, byte for byte, what Encode writes
// for the same delete event (whatever the names, values, times and
// positions), and what it writes decodes to that event. The only strings
// AppendString escapes otherwise than encoding/json are those with '\b',
// '\f' (\u0008, \u000c: the same string once decoded) or invalid UTF-8
// (escaped byte-wise, where encoding/json writes U+FFFD): for those the
// body must still be valid JSON, and decode to the same event when the
// strings are valid UTF-8.
func FuzzAppendDelete(f *testing.F) {
	f.Add("main", "public", "orders", "id", "bigint", "note", "text", uint32(7431), uint64(0x1A2B3C8), int64(1796029200), 123456000, 3, uint8(0), "42", "hello", true, false, false)
	f.Add("main", "My Schema", "odd\"table", "k\u2028", "numeric(12,2)", "<&>", "public.mood", uint32(0), uint64(1), int64(0), 0, 0, uint8(1), "a\"b\\c\n\t\r\u0001", "", false, true, true)
	f.Add("s_1", "p\u00e9", "t\ud7ff", "c", "text[]", "v", "jsonb", uint32(1<<32-1), uint64(1<<64-1), int64(253402300799), 999999999, 1<<31-1, uint8(2), "\b\f", "bad\xffutf8", true, true, false)
	f.Fuzz(func(t *testing.T, source, schema, table, keyCol, keyType, col, colType string, xid uint32, lsn uint64,
		sec int64, nsec, seq int, identity uint8, keyVal, val string, keyed, withRefs, withRowRef bool) {
		// Inside what Validate accepts (Encode would leave out a zero LSN,
		// an empty schema or table) and the years encoding/json writes.
		if schema == "" || table == "" || lsn == 0 || seq < 0 || seq > 1<<31-1 || sec < 0 || sec > 253402300799 {
			return
		}
		e := &event.Event{
			Op: event.OpDelete, Source: source, Schema: schema, Table: table, XID: int64(xid),
			CommitLSN: event.LSN(lsn), CommitTime: time.Unix(sec, int64(nsec%1e9+1e9)%1e9).UTC(), Seq: seq,
			Identity: []string{event.IdentityFull, event.IdentityKey, event.IdentityNothing}[identity%3],
			Columns:  []event.Column{{Name: keyCol, Type: keyType, PK: keyed}, {Name: col, Type: colType}},
		}
		if keyed {
			e.Key = jsonObject(keyCol, keyVal)
		}
		e.Row = jsonObject(keyCol, keyVal, col, val)
		if withRefs {
			e.Refs = []event.Ref{{Columns: []string{col}, Schema: schema, Table: table + "_parent", RefColumns: []string{keyCol}}}
		}
		if withRowRef {
			e.RowRef = &event.ObjectRef{Bucket: event.RowBucket(source), Name: val, Size: int64(len(e.Row)), SHA256: keyVal}
		}
		head, err := event.NewTableHead(source, schema, table, e.Columns, e.Refs)
		if err != nil {
			t.Fatal(err)
		}
		tx := event.NewDeleteTx(xid, e.CommitLSN, e.CommitTime)
		row := []byte(e.Row)
		if withRowRef {
			e.Row = nil
		}
		got := event.AppendDelete([]byte("junk"), head, &tx, event.DeleteRow{Seq: seq, Identity: e.Identity, Key: e.Key, Row: row, RowRef: e.RowRef})
		if !bytes.HasPrefix(got, []byte("junk")) {
			t.Fatalf("AppendDelete dropped what dst held: %q", got)
		}
		got = got[len("junk"):]
		checkAppendDelete(t, e, head, got, source, schema, table, keyCol, keyType, col, colType, keyVal, val)
	})
}

func checkAppendDelete(t *testing.T, e *event.Event, head *event.TableHead, got []byte, strs ...string) {
	t.Helper()
	want, err := event.Encode(e)
	if err != nil {
		t.Fatalf("Encode: %v", err)
	}
	fixed := len(got) - len(e.Key) - len(e.Row)
	if e.RowRef != nil {
		b, _ := json.Marshal(e.RowRef)
		fixed -= len(b)
	}
	if head.Size() > fixed {
		t.Fatalf("head size %d is more than the %d bytes outside key and row", head.Size(), fixed)
	}
	if !json.Valid(got) {
		t.Fatalf("AppendDelete wrote invalid JSON:\n%s", got)
	}
	plain, valid := true, true
	for _, s := range strs {
		valid = valid && utf8.ValidString(s)
		plain = plain && utf8.ValidString(s) && !strings.ContainsAny(s, "\b\f")
	}
	if plain && !bytes.Equal(got, want) {
		t.Fatalf("AppendDelete and Encode differ:\n%s\n%s", got, want)
	}
	if !valid {
		return
	}
	ge, gerr := event.Decode(got)
	we, werr := event.Decode(want)
	if (gerr == nil) != (werr == nil) || (gerr != nil && gerr.Error() != werr.Error()) {
		t.Fatalf("decoding AppendDelete's body: %v; Encode's: %v", gerr, werr)
	}
	if gerr == nil && !reflect.DeepEqual(ge, we) {
		t.Fatalf("AppendDelete's body decodes otherwise than Encode's:\n%+v\n%+v", ge, we)
	}
}

// jsonObject writes the object of name/value pairs as the capture writes a
// row: values as JSON strings, compact.
func jsonObject(kv ...string) json.RawMessage {
	b := []byte{'{'}
	for i := 0; i < len(kv); i += 2 {
		if i > 0 {
			b = append(b, ',')
		}
		b = event.AppendString(b, []byte(kv[i]))
		b = append(b, ':')
		b = event.AppendString(b, []byte(kv[i+1]))
	}
	return append(b, '}')
}
