package event

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
)

// LSN is a PostgreSQL write-ahead log position. It encodes in JSON as the
// Postgres text form "XXX/XXX".
type LSN uint64

// String returns the Postgres text form, e.g. "0/1A2B3C8".
func (l LSN) String() string { return fmt.Sprintf("%X/%X", uint32(l>>32), uint32(l)) }

// ParseLSN parses the Postgres text form of an LSN.
func ParseLSN(s string) (LSN, error) {
	hi, lo, ok := strings.Cut(s, "/")
	if !ok {
		return 0, fmt.Errorf("parse lsn %q: missing '/'", s)
	}
	h, err := strconv.ParseUint(hi, 16, 32)
	if err != nil {
		return 0, fmt.Errorf("parse lsn %q: %w", s, err)
	}
	l, err := strconv.ParseUint(lo, 16, 32)
	if err != nil {
		return 0, fmt.Errorf("parse lsn %q: %w", s, err)
	}
	return LSN(h<<32 | l), nil
}

// MarshalJSON encodes the LSN as its text form.
func (l LSN) MarshalJSON() ([]byte, error) { return json.Marshal(l.String()) }

// UnmarshalJSON decodes the text form.
func (l *LSN) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return fmt.Errorf("lsn must be a string like \"0/1A2B3C8\": %w", err)
	}
	v, err := ParseLSN(s)
	if err != nil {
		return err
	}
	*l = v
	return nil
}

// IsZero reports whether the LSN is unset (used by omitempty/omitzero).
func (l LSN) IsZero() bool { return l == 0 }

func itoa(i int64) string { return strconv.FormatInt(i, 10) }
