package archive

import (
	"bytes"
	"encoding/json"
)

// textValues returns, as a JSON object, the exact text of the row's
// members whose value storing the row as jsonb would change, or nil (almost
// always). The event's encoding (event.Event) makes every other value
// survive jsonb: numerics, NaN and infinities, json text and jsonb scalars
// travel as strings, integers and other floats as numbers jsonb keeps
// exactly. What is left is a float's negative zero: the JSON number -0
// becomes the jsonb numeric 0, and restored as 0, not -0.
func textValues(row json.RawMessage) *string {
	if !mayHaveNegativeZero(row) {
		return nil
	}
	dec := json.NewDecoder(bytes.NewReader(row))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return nil
	}
	out := map[string]string{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil
		}
		name, _ := tok.(string)
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil {
			return nil
		}
		if isNegativeZero(v) {
			out[name] = string(v)
		}
	}
	if len(out) == 0 {
		return nil
	}
	b, err := json.Marshal(out)
	if err != nil {
		return nil
	}
	s := string(b)
	return &s
}

// mayHaveNegativeZero is the cheap test before the parse: a member value
// starting "-0" follows a colon (and perhaps blanks). Dates ("2026-01-05")
// do not pass it.
func mayHaveNegativeZero(b []byte) bool {
	for i := bytes.Index(b, []byte("-0")); i >= 0; {
		j := i - 1
		for j >= 0 && (b[j] == ' ' || b[j] == '\t' || b[j] == '\n' || b[j] == '\r') {
			j--
		}
		if j >= 0 && b[j] == ':' {
			return true
		}
		k := bytes.Index(b[i+2:], []byte("-0"))
		if k < 0 {
			return false
		}
		i += 2 + k
	}
	return false
}

// isNegativeZero reports whether v is a JSON number that is a negative
// zero: "-0", "-0.0", "-0e5".
func isNegativeZero(v json.RawMessage) bool {
	if len(v) < 2 || v[0] != '-' {
		return false
	}
	for _, c := range v[1:] {
		switch c {
		case '0', '.':
		case 'e', 'E':
			return true // the mantissa was all zeros
		default:
			return false
		}
	}
	return true
}
