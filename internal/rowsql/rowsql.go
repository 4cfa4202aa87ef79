// Package rowsql is the lossless inverse of the event's value encoding
// (event.Event): from a row event's values and column types, the INSERT
// that puts the row back equal by row::text. The capture (RestoreSQL) and
// the restore command share it; it imports nothing of Epitaph's but the
// wire format, so the projector gets it without the capture.
package rowsql

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/epitaph-dev/epitaph/event"
)

// InsertSQL builds the INSERT that puts a deleted row back from its event
// alone: every value's text form (see ValueText) is cast to the column's
// type as the event names it, `$n::text::<type>`, so the restored row is
// equal to the deleted one by row::text. Only the columns present in the
// row are inserted (a key-identity event carries its key columns only), and
// never a generated one.
// For an event with RowRef, set e.Row to the object's bytes first.
// The column types come from the event, so they are checked to be type
// names (identifiers, typmods, array brackets) and nothing else.
func InsertSQL(e *event.Event) (string, []any, error) {
	if e.Op != event.OpDelete {
		return "", nil, fmt.Errorf("restore: %s event has no row", e.Op)
	}
	if len(e.Row) == 0 {
		return "", nil, fmt.Errorf("restore %s: the row is not in the event (row_ref: read the object first)", e.QualifiedTable())
	}
	values, order, err := ObjectFields(e.Row)
	if err != nil {
		return "", nil, fmt.Errorf("restore %s: %w", e.QualifiedTable(), err)
	}
	types := make(map[string]string, len(e.Columns))
	generated := map[string]bool{}
	for _, c := range e.Columns {
		types[c.Name] = c.Type
		generated[c.Name] = c.Generated
	}
	var cols, vals []string
	var args []any
	for _, name := range order {
		if generated[name] {
			continue // the server computes it (and refuses a value)
		}
		typ, ok := types[name]
		if !ok {
			return "", nil, fmt.Errorf("restore %s: column %q has no type in the event", e.QualifiedTable(), name)
		}
		if err := CheckTypeName(typ); err != nil {
			return "", nil, fmt.Errorf("restore %s: column %q: %w", e.QualifiedTable(), name, err)
		}
		text, notNull, err := ValueText(values[name])
		if err != nil {
			return "", nil, fmt.Errorf("restore %s: column %q: %w", e.QualifiedTable(), name, err)
		}
		cols = append(cols, pgx.Identifier{name}.Sanitize())
		args = append(args, nil)
		if notNull {
			args[len(args)-1] = text
		}
		vals = append(vals, "$"+strconv.Itoa(len(args))+"::text::"+typ)
	}
	sql := "INSERT INTO " + pgx.Identifier{e.Schema, e.Table}.Sanitize() +
		" (" + strings.Join(cols, ", ") + ") OVERRIDING SYSTEM VALUE VALUES (" + strings.Join(vals, ", ") + ")"
	return sql, args, nil
}

// ObjectFields splits a JSON object into its raw member values, keeping
// the member order.
func ObjectFields(b json.RawMessage) (map[string]json.RawMessage, []string, error) {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	tok, err := dec.Token()
	if err != nil || tok != json.Delim('{') {
		return nil, nil, fmt.Errorf("row is not a JSON object")
	}
	out := map[string]json.RawMessage{}
	var order []string
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, nil, fmt.Errorf("row: %w", err)
		}
		name, ok := tok.(string)
		if !ok {
			return nil, nil, fmt.Errorf("row: member name expected")
		}
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil {
			return nil, nil, fmt.Errorf("row: member %q: %w", name, err)
		}
		if _, dup := out[name]; !dup {
			order = append(order, name)
		}
		out[name] = v
	}
	return out, order, nil
}

// CheckTypeName accepts what format_type produces: words, quoted
// identifiers, dots, typmods of digits and commas in parentheses, and
// array brackets.
func CheckTypeName(t string) error {
	bad := fmt.Errorf("type %q is not a type name", t)
	if t == "" {
		return bad
	}
	for i := 0; i < len(t); i++ {
		var ok bool
		switch c := t[i]; c {
		case '"':
			i, ok = quotedEnd(t, i)
		case '(':
			i, ok = typmodEnd(t, i)
		case '[':
			ok = i+1 < len(t) && t[i+1] == ']'
			i++
		default:
			ok = isTypeNameByte(c)
		}
		if !ok {
			return bad
		}
	}
	return nil
}

// quotedEnd is the index of the quote closing the identifier quoted at
// t[i] (doubled quotes inside), false when it is not closed or holds NUL.
func quotedEnd(t string, i int) (int, bool) {
	j := i + 1
	for {
		if j >= len(t) || t[j] == 0 {
			return 0, false
		}
		if t[j] == '"' {
			if j+1 < len(t) && t[j+1] == '"' {
				j += 2
				continue
			}
			return j, true
		}
		j++
	}
}

// typmodEnd is the index of the parenthesis closing the typmod opened at
// t[i], false unless it holds only digits, commas, spaces and '-'.
func typmodEnd(t string, i int) (int, bool) {
	j := strings.IndexByte(t[i:], ')')
	if j < 0 {
		return 0, false
	}
	for _, d := range t[i+1 : i+j] {
		if (d < '0' || d > '9') && d != ',' && d != ' ' && d != '-' {
			return 0, false
		}
	}
	return i + j, true
}

// isTypeNameByte: the bytes of words and dots outside quotes.
func isTypeNameByte(c byte) bool {
	return c == '.' || c == ' ' || c == '_' || c == '$' ||
		(c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')
}

// ValueText returns the Postgres text form of one JSON value of a row
// event, and false for JSON null. It is the inverse of the capture's
// encoding: numbers and jsonb keep their exact JSON text, booleans become
// "true"/"false" (both accepted by every boolean input), strings are
// unquoted.
func ValueText(v json.RawMessage) (string, bool, error) {
	if len(v) == 0 {
		return "", false, fmt.Errorf("empty value")
	}
	switch v[0] {
	case 'n':
		if string(v) == "null" {
			return "", false, nil
		}
	case '"':
		var out string
		if err := json.Unmarshal(v, &out); err != nil {
			return "", false, fmt.Errorf("decode string value: %w", err)
		}
		return out, true, nil
	}
	return string(v), true, nil
}
