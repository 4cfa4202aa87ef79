package capture

import (
	"encoding/json"
	"regexp"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/rowsql"
)

var identRE = regexp.MustCompile(`^[a-z0-9_]{1,63}$`)

// Built-in type OIDs whose text form maps onto a JSON scalar.
const (
	oidBool    = 16
	oidInt8    = 20
	oidInt2    = 21
	oidInt4    = 23
	oidOID     = 26
	oidFloat4  = 700
	oidFloat8  = 701
	oidNumeric = 1700
	oidJSONB   = 3802
)

// appendValue appends the JSON form of one column value given in
// Postgres text form, following the rules of event.Event: booleans and
// integers as JSON literals, floats as numbers or "NaN"/"Infinity"/
// "-Infinity", jsonb objects and arrays embedded, everything else (numeric included) as its
// text form in a JSON string. The mapping is lossless: the text form is
// recovered exactly from the JSON token (see RestoreSQL).
func appendValue(dst []byte, typeOID uint32, text []byte) []byte {
	if typeOID == oidBool {
		switch string(text) {
		case "t":
			return append(dst, "true"...)
		case "f":
			return append(dst, "false"...)
		}
	}
	if rawValue(typeOID, text) {
		return append(dst, text...)
	}
	return event.AppendString(dst, text)
}

// rawValue says whether appendValue embeds the text form as it is: an
// integer, a float that is a JSON number, a jsonb object or array.
func rawValue(typeOID uint32, text []byte) bool {
	switch typeOID {
	case oidInt2, oidInt4, oidInt8, oidOID:
		return isInteger(text)
	case oidFloat4, oidFloat8:
		return isJSONNumber(text)
	case oidJSONB:
		// Only objects and arrays are embedded: a top-level JSON null would
		// read as SQL NULL, and a top-level string as text, so jsonb
		// scalars travel as their text form in a string.
		return len(text) > 0 && (text[0] == '{' || text[0] == '[') && json.Valid(text)
	}
	return false
}

func isInteger(b []byte) bool {
	if len(b) > 0 && b[0] == '-' {
		b = b[1:]
	}
	if len(b) == 0 || (b[0] == '0' && len(b) > 1) {
		return false
	}
	for _, c := range b {
		if c < '0' || c > '9' {
			return false
		}
	}
	return true
}

// isJSONNumber reports whether b is a JSON number whose text Postgres would
// read back as the same float (Postgres' shortest-exact output, e.g.
// "1.5", "-0", "1e+100", "4.2e-05").
func isJSONNumber(b []byte) bool {
	i := 0
	if i < len(b) && b[i] == '-' {
		i++
	}
	start := i
	for i < len(b) && b[i] >= '0' && b[i] <= '9' {
		i++
	}
	if i == start || (b[start] == '0' && i-start > 1) {
		return false
	}
	if i < len(b) && b[i] == '.' {
		i++
		s := i
		for i < len(b) && b[i] >= '0' && b[i] <= '9' {
			i++
		}
		if i == s {
			return false
		}
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			i++
		}
		s := i
		for i < len(b) && b[i] >= '0' && b[i] <= '9' {
			i++
		}
		if i == s {
			return false
		}
	}
	return i == len(b)
}

// ValueText returns the Postgres text form of one JSON value of a row
// event, and false for JSON null (see rowsql.ValueText).
func ValueText(v json.RawMessage) (string, bool, error) { return rowsql.ValueText(v) }
