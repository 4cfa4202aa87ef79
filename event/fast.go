package event

import (
	"encoding/json"
	"strconv"
	"strings"

	"github.com/tidwall/gjson"
)

// decodeFast parses a clean v1 body in one validating scan and one pass over
// its top-level fields (gjson), instead of encoding/json's reflection, which
// was a third of a projector's CPU. It handles only the form the capture
// writes: every field known, spelled exactly, present once and of its
// type, strings without escapes or non-ASCII bytes unless decoded exactly
// as encoding/json does. Anything else returns ok=false and Decode takes
// the encoding/json path, which alone decides what is malformed, invalid
// or of another version. So both paths give the same event for every body
// the fast one accepts (FuzzDecodeFastMatchesSlow).
func decodeFast(data []byte) (e *Event, ok bool) {
	s := string(data)
	if !gjson.Valid(s) {
		return nil, false
	}
	root := gjson.Parse(s)
	if !root.IsObject() {
		return nil, false
	}
	e = &Event{}
	var raw fastRaw
	var seen uint32
	ok = true
	root.ForEach(func(k, v gjson.Result) bool {
		bit, known := fastFields[k.Str]
		if !known || seen&bit != 0 {
			ok = false
			return false
		}
		seen |= bit
		ok = e.fastField(k.Str, v, &raw)
		return ok
	})
	if !ok || e.V != Version {
		return nil, false
	}
	var err error
	if e.Columns, err = shapes.columns.get(raw.cols); err != nil {
		return nil, false
	}
	if e.Refs, err = shapes.refs.get(raw.refs); err != nil {
		return nil, false
	}
	return e, true
}

// fastRaw holds the fields decodeFast decodes after the scan, through the
// shape caches.
type fastRaw struct{ cols, refs string }

// fastField decodes one top-level field (a name of fastFields) into e:
// false when it is not of the form decodeFast takes. The fields of every
// event are here, the rest in fastRowField and fastPositionField.
func (e *Event) fastField(name string, v gjson.Result, raw *fastRaw) (ok bool) {
	switch name {
	case "v":
		e.V, ok = fastInt(v)
	case "op":
		var op string
		op, ok = fastString(v)
		e.Op = Op(op)
	case "source":
		e.Source, ok = fastString(v)
	case "schema":
		e.Schema, ok = fastString(v)
	case "table":
		e.Table, ok = fastString(v)
	case "xid":
		var n int
		n, ok = fastInt(v)
		e.XID = int64(n)
	case "commit_lsn":
		ok = e.CommitLSN.UnmarshalJSON([]byte(v.Raw)) == nil
	case "commit_time":
		ok = e.CommitTime.UnmarshalJSON([]byte(v.Raw)) == nil
	case "seq":
		e.Seq, ok = fastInt(v)
	default:
		return e.fastRowField(name, v, raw)
	}
	return ok
}

// fastRowField decodes a field of row and truncate events.
func (e *Event) fastRowField(name string, v gjson.Result, raw *fastRaw) (ok bool) {
	switch name {
	case "identity":
		e.Identity, ok = fastString(v)
	case "columns":
		raw.cols, ok = v.Raw, true
	case "refs":
		raw.refs, ok = v.Raw, true
	case "key":
		e.Key, ok = json.RawMessage(v.Raw), true
	case "row":
		e.Row, ok = json.RawMessage(v.Raw), true
	case "row_ref":
		ok = v.Type == gjson.JSON && json.Unmarshal([]byte(v.Raw), &e.RowRef) == nil
	case "cascade":
		e.Cascade, ok = fastBool(v)
	case "restart_identity":
		e.RestartIdentity, ok = fastBool(v)
	default:
		return e.fastPositionField(name, v)
	}
	return ok
}

// fastPositionField decodes a field of commit, mark and gap events.
func (e *Event) fastPositionField(name string, v gjson.Result) (ok bool) {
	switch name {
	case "rows":
		e.Rows, ok = fastInt(v)
	case "tables":
		ok = v.Type == gjson.JSON && json.Unmarshal([]byte(v.Raw), &e.Tables) == nil
	case "partition":
		e.Partition, ok = fastInt(v)
	case "lsn":
		ok = e.LSN.UnmarshalJSON([]byte(v.Raw)) == nil
	case "kind":
		e.Kind, ok = fastString(v)
	case "content":
		e.Content, ok = fastString(v)
	case "time":
		ok = e.Time.UnmarshalJSON([]byte(v.Raw)) == nil
	case "from_lsn":
		ok = e.FromLSN.UnmarshalJSON([]byte(v.Raw)) == nil
	case "to_lsn":
		ok = e.ToLSN.UnmarshalJSON([]byte(v.Raw)) == nil
	case "reason":
		e.Reason, ok = fastString(v)
	default:
		return true // every name of fastFields has its case
	}
	return ok
}

// fastFields are the JSON names of Event's fields, each with its own bit.
var fastFields = func() map[string]uint32 {
	names := []string{"v", "op", "source", "schema", "table", "xid", "commit_lsn", "commit_time", "seq",
		"identity", "columns", "key", "row", "row_ref", "refs", "cascade", "restart_identity", "rows", "tables",
		"partition", "lsn", "kind", "content", "time", "from_lsn", "to_lsn", "reason"}
	m := make(map[string]uint32, len(names))
	for i, n := range names {
		m[n] = 1 << i
	}
	return m
}()

// fastString reads a JSON string. One with escapes or non-ASCII bytes is
// decoded by encoding/json, whose handling of invalid UTF-8 and surrogates
// gjson does not share.
func fastString(v gjson.Result) (string, bool) {
	if v.Type != gjson.String {
		return "", false
	}
	if strings.IndexByte(v.Raw, '\\') < 0 && isASCII(v.Raw) {
		return v.Str, true
	}
	var s string
	if err := json.Unmarshal([]byte(v.Raw), &s); err != nil {
		return "", false
	}
	return s, true
}

func isASCII(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] >= 0x80 {
			return false
		}
	}
	return true
}

// fastInt reads a JSON number into an int the way encoding/json does:
// exact integer digits only.
func fastInt(v gjson.Result) (int, bool) {
	if v.Type != gjson.Number {
		return 0, false
	}
	n, err := strconv.ParseInt(v.Raw, 10, 0)
	return int(n), err == nil
}

func fastBool(v gjson.Result) (bool, bool) {
	switch v.Type {
	case gjson.True:
		return true, true
	case gjson.False:
		return false, true
	}
	return false, false
}
