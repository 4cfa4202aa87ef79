package handler

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
)

// Two operators retry the same dead delivery at once (the console's "retry
// all" and `deliveries retry`): the one that comes second must be told the
// delivery is pending now, not that its row or handler is gone and it
// cannot be retried (both are there, and it is being retried).
func TestRetryRacingAnotherRetrySaysTheDeliveryIsPendingNow(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newTenv(t)
	e.addHandler(KindWebhook, "https://example.invalid/hook")
	e.enqueue(1, e.row(1))
	var id string
	require.NoError(t, e.pool.QueryRow(ctx, `UPDATE epitaph.deliveries SET state = 'dead', outcome = 'failed', attempt = 5,
		settled_at = now() RETURNING id::text`).Scan(&id))

	// The other retry has put it back to pending and not committed yet.
	other, err := e.pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = other.Rollback(ctx) }()
	_, err = other.Exec(ctx, `UPDATE epitaph.deliveries SET state = 'pending', attempt = 0, outcome = NULL, settled_at = NULL
		WHERE id = $1`, id)
	require.NoError(t, err)

	done := make(chan error, 1)
	go func() { done <- Retry(ctx, e.pool, id) }()
	waitsForALock(t, e.pool, "UPDATE epitaph.deliveries d SET state = 'pending'", "the second retry waits for the first")
	require.NoError(t, other.Commit(ctx))
	err = <-done

	var state string
	require.NoError(t, e.pool.QueryRow(ctx, `SELECT state FROM epitaph.deliveries WHERE id = $1`, id).Scan(&state))
	require.Equal(t, StatePending, state)
	require.Error(t, err, "this retry changed nothing")
	require.NotContains(t, err.Error(), "cannot be retried", "the delivery and its handler are there: it is pending")
	require.Contains(t, err.Error(), "is pending")
}
