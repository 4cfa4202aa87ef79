package pgquote_test

import (
	"testing"

	"github.com/epitaph-dev/epitaph/internal/pgquote"
)

func TestLiteral(t *testing.T) {
	for in, want := range map[string]string{
		"":            "''",
		"plain":       "'plain'",
		"it's":        "'it''s'",
		"''":          "''''''",
		`back\slash`:  `'back\slash'`,
		`"epitaph"`:   `'"epitaph"'`,
		"ünïcödé 'x'": "'ünïcödé ''x'''",
	} {
		if got := pgquote.Literal(in); got != want {
			t.Errorf("Literal(%q) = %s, want %s", in, got, want)
		}
	}
}
