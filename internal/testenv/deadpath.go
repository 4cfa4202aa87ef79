package testenv

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
)

// AnswerLostOnADeadPath runs call, whose statement matching query (ILIKE,
// in pg_stat_activity of the database at url) waits behind lock, then
// kills every path through proxy and releases lock, so the statement
// completes and its answer never arrives. call must return within 20 s
// (a connection without TCP_USER_TIMEOUT waits minutes); what it returns
// is returned.
func AnswerLostOnADeadPath(t *testing.T, url, query string, proxy *FlowProxy, lock pgx.Tx, call func() error) error {
	t.Helper()
	ctx := context.Background()
	done := make(chan error, 1)
	go func() { done <- call() }()
	require.Eventually(t, func() bool {
		c, err := pgx.Connect(ctx, url)
		if err != nil {
			return false
		}
		defer c.Close(ctx)
		var n int
		return c.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock' AND query ILIKE $1`, query).Scan(&n) == nil && n == 1
	}, 20*time.Second, 20*time.Millisecond, "the statement waits behind the lock")
	require.Positive(t, proxy.BlackholeAllBut(t, 0), "the connection goes through the proxy")
	start := time.Now()
	require.NoError(t, lock.Rollback(ctx)) // the statement completes; its answer never arrives
	select {
	case err := <-done:
		t.Logf("returned %s after the path died (err: %v)", time.Since(start).Round(time.Millisecond), err)
		return err
	case <-time.After(20 * time.Second):
		t.Fatal("still waiting 20 s after the path died")
		return nil
	}
}
