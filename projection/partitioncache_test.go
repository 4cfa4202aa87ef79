package projection

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A failed attempt owes its periods to the next one, whatever that page's
// rows; the backoff doubles per failure in a row, up to a minute, and ends
// with an attempt that makes them.
func TestPartitionCacheOwesFailedPeriods(t *testing.T) {
	var c partitionCache
	now := time.Date(2026, 12, 6, 12, 0, 0, 0, time.UTC)
	dec, jan, old := time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC), time.Date(2027, 1, 1, 0, 0, 0, 0, time.UTC),
		time.Date(2024, 2, 1, 0, 0, 0, 0, time.UTC)
	c.add("a", []time.Time{dec, jan})
	require.Equal(t, []time.Time{old}, c.missing("a", []time.Time{dec, jan, old}))

	require.Equal(t, time.Second, c.fail("a", []time.Time{old}, now))
	require.True(t, c.backingOff("a", now.Add(999*time.Millisecond)))
	require.False(t, c.backingOff("a", now.Add(time.Second)))
	require.False(t, c.backingOff("b", now), "per schema")
	require.Equal(t, []time.Time{old}, c.missing("a", []time.Time{dec, jan}), "owed to a page without its rows")
	require.Empty(t, c.missing("b", []time.Time{}))

	for want := 2 * time.Second; want <= time.Minute; want *= 2 {
		require.Equal(t, want, c.fail("a", []time.Time{old}, now))
	}
	require.Equal(t, time.Minute, c.fail("a", []time.Time{old}, now), "at most a minute")
	require.True(t, c.backingOff("a", now.Add(59*time.Second)))

	c.add("a", []time.Time{old})
	require.Empty(t, c.missing("a", []time.Time{dec, jan, old}))
	require.False(t, c.backingOff("a", now), "made: no backoff")
	require.Equal(t, time.Second, c.fail("a", []time.Time{old}, now), "the next failure starts again at a second")
}
