package lowgc

import (
	"runtime/debug"
	"testing"

	"github.com/stretchr/testify/require"
)

func gcPercent() int {
	p := debug.SetGCPercent(100)
	debug.SetGCPercent(p)
	return p
}

func TestHoldNestsAndRestores(t *testing.T) {
	defer debug.SetGCPercent(debug.SetGCPercent(200))
	a := Hold()
	require.Equal(t, Percent, gcPercent())
	b := Hold()
	a()
	a() // twice: once
	require.Equal(t, Percent, gcPercent(), "still held by b")
	b()
	require.Equal(t, 200, gcPercent())

	debug.SetGCPercent(-1)
	c := Hold()
	require.Equal(t, -1, gcPercent(), "GC off stays off")
	c()
	require.Equal(t, -1, gcPercent())

	debug.SetGCPercent(5)
	d := Hold()
	require.Equal(t, 5, gcPercent(), "a lower target is kept")
	d()
	require.Equal(t, 5, gcPercent())
}
