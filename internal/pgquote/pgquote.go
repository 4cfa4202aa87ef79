// Package pgquote quotes SQL string literals for the few statements that
// cannot take parameters (DDL such as COMMENT ON, and the options of
// START_REPLICATION). It assumes standard_conforming_strings = on, the
// default since PostgreSQL 9.1 and the only setting Epitaph supports.
package pgquote

import "strings"

// Literal returns s as a single-quoted SQL string literal, doubling the
// single quotes inside it.
func Literal(s string) string {
	return "'" + strings.ReplaceAll(s, "'", "''") + "'"
}
