package event

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"sync"
)

// Category classifies why a message could not be used. It is the category
// recorded in quarantine.
type Category string

// Decode failure categories. Further categories (incompatible, oversized,
// missing_payload) are assigned by the projector when applying.
const (
	CategoryMalformed      Category = "malformed"       // not JSON, or not an object
	CategoryUnknownVersion Category = "unknown_version" // "v" this code does not know
	CategoryInvalid        Category = "invalid"         // required fields missing or ill-typed
)

// DecodeError is a permanent failure to decode a message: retrying the same
// bytes with the same code gives the same error.
type DecodeError struct {
	Category Category
	Err      error
}

func (e *DecodeError) Error() string {
	return "decode event: " + string(e.Category) + ": " + e.Err.Error()
}
func (e *DecodeError) Unwrap() error { return e.Err }

// CategoryOf returns the category of a decode error, and false for any other
// error.
func CategoryOf(err error) (Category, bool) {
	var de *DecodeError
	if errors.As(err, &de) {
		return de.Category, true
	}
	return "", false
}

func decodeErr(c Category, format string, args ...any) error {
	return &DecodeError{Category: c, Err: fmt.Errorf(format, args...)}
}

// Decoder decodes messages. Its Versions hook lets a newer format be taught
// to it (tests and future versions register upgraders here).
type Decoder struct {
	// Upgraders maps a wire version other than Version to a function that
	// rewrites such a body into a v1 body.
	Upgraders map[int]func([]byte) ([]byte, error)
}

// Decode decodes with the default decoder (v1 only).
func Decode(data []byte) (*Event, error) { return (&Decoder{}).Decode(data) }

// Decode parses one message body. Every failure is a *DecodeError.
//
// A v1 body is parsed in one pass; only a body that fails it, or carries
// another version, is probed again for its version, so that a newer
// format's differently typed fields are reported as unknown_version rather
// than invalid.
func (d *Decoder) Decode(data []byte) (*Event, error) {
	trimmed := bytes.TrimSpace(data)
	if len(trimmed) == 0 || trimmed[0] != '{' {
		return nil, decodeErr(CategoryMalformed, "body is not a JSON object (%d bytes)", len(data))
	}
	if e, ok := decodeFast(trimmed); ok {
		if err := e.Validate(); err != nil {
			return nil, err
		}
		return e, nil
	}
	return d.decodeSlow(trimmed)
}

// decodeSlow is Decode with encoding/json: the reference the fast path
// must agree with, and the only path that reports errors.
func (d *Decoder) decodeSlow(trimmed []byte) (*Event, error) {
	var w wireEvent
	err := json.Unmarshal(trimmed, &w)
	var se *json.SyntaxError
	if errors.As(err, &se) {
		return nil, decodeErr(CategoryMalformed, "body is not a JSON object: syntax error at offset %d", se.Offset)
	}
	if err == nil {
		w.Event.Columns, err = shapes.columns.get(string(w.Columns))
	}
	if err == nil {
		w.Event.Refs, err = shapes.refs.get(string(w.Refs))
	}
	e := &w.Event
	if err != nil || e.V != Version {
		return d.decodeOther(trimmed, err)
	}
	if err := e.Validate(); err != nil {
		return nil, err
	}
	return e, nil
}

// wireEvent reads "columns" and "refs" as raw bytes: every event of a table
// repeats them, so they are decoded once per distinct shape (shapeCache)
// instead of once per event.
type wireEvent struct {
	Event
	Columns json.RawMessage `json:"columns,omitempty"`
	Refs    json.RawMessage `json:"refs,omitempty"`
}

// shapes caches decoded column and foreign-key lists by their exact bytes.
// Decoded events share these slices: treat Event.Columns and Event.Refs as
// read-only.
var shapes = struct {
	columns shapeCache[Column]
	refs    shapeCache[Ref]
}{shapeCache[Column]{field: "columns"}, shapeCache[Ref]{field: "refs"}}

// maxShapes bounds each cache; past it the cache starts again empty.
const maxShapes = 4096

// shapeCache decodes the JSON array of one field, once per distinct text.
type shapeCache[T any] struct {
	field string
	mu    sync.Mutex
	m     map[string][]T
}

func (c *shapeCache[T]) get(raw string) ([]T, error) {
	if len(raw) == 0 || raw == "null" {
		return nil, nil
	}
	c.mu.Lock()
	v, ok := c.m[raw]
	c.mu.Unlock()
	if ok {
		return v, nil
	}
	if err := json.Unmarshal([]byte(raw), &v); err != nil {
		return nil, fieldErr(c.field, err)
	}
	c.mu.Lock()
	if c.m == nil || len(c.m) >= maxShapes {
		c.m = map[string][]T{}
	}
	c.m[raw] = v
	c.mu.Unlock()
	return v, nil
}

// fieldErr names the top-level field of a nested unmarshal error.
func fieldErr(field string, err error) error {
	var te *json.UnmarshalTypeError
	if errors.As(err, &te) {
		te.Field = field + "." + te.Field
		return te
	}
	return fmt.Errorf("field %q: %w", field, err)
}

// decodeOther handles a syntactically valid object that is not a clean v1
// event: a missing or ill-typed "v", another version (upgraded when taught),
// or a v1 body with ill-typed fields (v1err).
func (d *Decoder) decodeOther(body []byte, v1err error) (*Event, error) {
	var probe struct {
		V json.RawMessage `json:"v"`
	}
	if err := json.Unmarshal(body, &probe); err != nil {
		return nil, decodeErr(CategoryMalformed, "body is not a JSON object")
	}
	if len(probe.V) == 0 {
		return nil, decodeErr(CategoryInvalid, "missing \"v\"")
	}
	var v int
	if err := json.Unmarshal(probe.V, &v); err != nil {
		return nil, decodeErr(CategoryInvalid, "\"v\" is not an integer")
	}
	if v == Version {
		return nil, decodeErr(CategoryInvalid, "%v", sanitizeJSONErr(v1err))
	}
	up, ok := d.Upgraders[v]
	if !ok {
		return nil, decodeErr(CategoryUnknownVersion, "wire version %d is not known (this build reads %d)", v, Version)
	}
	upgraded, err := up(body)
	if err != nil {
		return nil, decodeErr(CategoryInvalid, "upgrade from version %d: %v", v, err)
	}
	return (&Decoder{}).Decode(upgraded)
}

// sanitizeJSONErr keeps the field and type of an unmarshal error but never
// the offending value, which may be row data.
func sanitizeJSONErr(err error) error {
	var te *json.UnmarshalTypeError
	if errors.As(err, &te) {
		return fmt.Errorf("field %q: expected %s, got JSON %s", te.Field, te.Type, te.Value)
	}
	var se *json.SyntaxError
	if errors.As(err, &se) {
		return fmt.Errorf("syntax error at offset %d", se.Offset)
	}
	return errors.New("ill-typed field")
}

// Validate checks the fields each op requires.
func (e *Event) Validate() error {
	if e.Source == "" {
		return decodeErr(CategoryInvalid, "missing \"source\"")
	}
	switch e.Op {
	case OpDelete:
		return e.validateDelete()
	case OpTruncate:
		if e.Schema == "" || e.Table == "" || e.CommitLSN == 0 {
			return decodeErr(CategoryInvalid, "truncate: missing schema, table or commit_lsn")
		}
		if e.Seq < 0 || e.Seq > math.MaxInt32 {
			return decodeErr(CategoryInvalid, "truncate: seq out of range")
		}
	case OpCommit:
		return e.validateCommit()
	case OpMark:
		if e.LSN == 0 {
			return decodeErr(CategoryInvalid, "mark: missing lsn")
		}
	case OpGap:
		return e.validateGap()
	case "":
		return decodeErr(CategoryInvalid, "missing \"op\"")
	default:
		return decodeErr(CategoryInvalid, "op %q is not known", e.Op)
	}
	return nil
}

func (e *Event) validateDelete() error {
	if e.Schema == "" || e.Table == "" {
		return decodeErr(CategoryInvalid, "delete: missing schema or table")
	}
	if e.CommitLSN == 0 {
		return decodeErr(CategoryInvalid, "delete: missing commit_lsn")
	}
	if e.Seq < 0 || e.Seq > math.MaxInt32 {
		return decodeErr(CategoryInvalid, "delete: seq out of range")
	}
	switch e.Identity {
	case IdentityFull, IdentityKey, IdentityNothing:
	default:
		return decodeErr(CategoryInvalid, "delete: identity %q is not full, key or nothing", e.Identity)
	}
	if e.RowRef == nil {
		if !isObject(e.Row) {
			return decodeErr(CategoryInvalid, "delete: \"row\" must be an object")
		}
	} else if e.RowRef.Bucket == "" || e.RowRef.Name == "" {
		return decodeErr(CategoryInvalid, "delete: row_ref needs bucket and name")
	}
	if len(e.Key) > 0 && !isObject(e.Key) && !bytes.Equal(e.Key, []byte("null")) {
		return decodeErr(CategoryInvalid, "delete: \"key\" must be an object")
	}
	return nil
}

func (e *Event) validateCommit() error {
	if e.CommitLSN == 0 {
		return decodeErr(CategoryInvalid, "commit: missing commit_lsn")
	}
	if e.Rows < 0 {
		return decodeErr(CategoryInvalid, "commit: negative rows")
	}
	sum := 0
	for t, n := range e.Tables {
		if n < 0 {
			return decodeErr(CategoryInvalid, "commit: negative count for %q", t)
		}
		sum += n
	}
	if e.Tables != nil && sum != e.Rows {
		return decodeErr(CategoryInvalid, "commit: table counts add up to %d, rows says %d", sum, e.Rows)
	}
	return nil
}

func (e *Event) validateGap() error {
	if e.ToLSN < e.FromLSN {
		return decodeErr(CategoryInvalid, "gap: to_lsn before from_lsn")
	}
	// Only a loss upstream is published; removals and truncates are
	// recorded by the projector, never believed from the stream.
	if e.GapKind() != GapLostUpstream {
		return decodeErr(CategoryInvalid, "gap: kind %q is not %s", e.Kind, GapLostUpstream)
	}
	if (e.Schema == "") != (e.Table == "") {
		return decodeErr(CategoryInvalid, "gap: schema and table go together (got schema %q, table %q)", e.Schema, e.Table)
	}
	return nil
}

func isObject(b json.RawMessage) bool {
	t := bytes.TrimSpace(b)
	return len(t) > 0 && t[0] == '{'
}
