package archive

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestTextValues(t *testing.T) {
	for _, c := range []struct{ row, want string }{
		{`{"a":1,"b":"2026-01-05"}`, ""},
		{`{"f":-0,"g":-0.5,"d":"x:-0"}`, `{"f":"-0"}`},
		{`{"f": -0.0, "g":-0e3, "h":-0.01}`, `{"f":"-0.0","g":"-0e3"}`},
		{`{"s":"a: -0"}`, ""},
		{`{"n":null,"a":[-0]}`, ""},
		{`not json -0`, ""},
	} {
		got := textValues([]byte(c.row))
		if c.want == "" {
			require.Nil(t, got, c.row)
			continue
		}
		require.NotNil(t, got, c.row)
		require.JSONEq(t, c.want, *got, c.row)
	}
}
