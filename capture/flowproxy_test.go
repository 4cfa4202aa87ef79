package capture

import (
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// clientPort is the client port of the session pid, as the server sees
// it: the proxy's upstream socket when it goes through the proxy.
func (e *env) clientPort(t *testing.T, pid int) int {
	t.Helper()
	port, err := strconv.Atoi(queryString(t, e.db, `SELECT coalesce(max(client_port), 0)::text FROM pg_stat_activity WHERE pid = $1`, pid))
	require.NoError(t, err)
	require.NotZero(t, port, "session %d has no TCP client port", pid)
	return port
}

// walsenderPID waits at most bound for a walsender of the test's
// database other than not and returns its pid.
func (e *env) walsenderPID(t *testing.T, not int, bound time.Duration) int {
	t.Helper()
	deadline := time.Now().Add(bound)
	for {
		pid, err := strconv.Atoi(queryString(t, e.db, `SELECT coalesce(max(pid), 0)::text FROM pg_stat_activity
			WHERE datname = current_database() AND backend_type = 'walsender' AND pid <> $1`, not))
		require.NoError(t, err)
		if pid != 0 {
			return pid
		}
		require.True(t, time.Now().Before(deadline), "no walsender of the capture within %s", bound)
		time.Sleep(20 * time.Millisecond)
	}
}
