package quarantine_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/quarantine"
)

// An entry an operator resolved is an audit record: what was discarded (or
// replayed), why, and the category and error it had then. A rewind
// re-delivers its event, which may fail differently now (here: a row first
// kept as unknown_version, then made unauthenticated when its window's
// commit failed verification, discarded; after the rewind, with the key
// trusted meanwhile, the row fails as unknown_version alone). The re-delivery
// must not rewrite the resolved entry's category and error.
func TestRedeliveryKeepsAResolvedEntrysCategoryAndError(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := setup(t)

	body := []byte(`{"v":2,"schema":"public","table":"orders","key":{"id":1}}`)
	first := entry(40, quarantine.CategoryUnknownVersion, body)
	insert(t, pool, first)
	unauth := first
	unauth.Category, unauth.Error = string(quarantine.CategoryUnauthenticated), "no verified commit claims this row"
	insert(t, pool, unauth)
	recs, err := quarantine.List(ctx, pool, quarantine.Filter{})
	require.NoError(t, err)
	require.Len(t, recs, 1)
	id := recs[0].ID
	require.NoError(t, quarantine.Discard(ctx, pool, id, "forged by the old capture host (SEC-7)"))
	before, err := quarantine.Show(ctx, pool, id, false)
	require.NoError(t, err)
	require.Equal(t, string(quarantine.CategoryUnauthenticated), before.Category)

	// The partition rewinds: the event arrives again and fails otherwise.
	insert(t, pool, first)

	after, err := quarantine.Show(ctx, pool, id, false)
	require.NoError(t, err)
	require.Equal(t, quarantine.StatusDiscarded, after.Status, "a resolved entry stays resolved")
	require.Equal(t, before.ResolutionReason, after.ResolutionReason)
	require.Equal(t, before.Category, after.Category, "the discarded entry's category is its audit record")
	require.Equal(t, before.Error, after.Error, "the discarded entry's error is its audit record")
}
