package capture

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A standby that holds the lease and waits for the slot (streamed by a
// capture started without --standby) loses one of its pool's connections
// to the source (57P01, an outage by outage()'s own rules), while its
// lease session is untouched: it keeps waiting (it exited before), and
// takes over when the streaming capture stops.
func TestStandbyWaitingForTheSlotRidesOutAPoolConnectionLoss(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE s (id int PRIMARY KEY); ALTER TABLE s REPLICA IDENTITY FULL; INSERT INTO s VALUES (1), (2)`)
	a := e.start(t, func(c *Config) { c.ApplicationName = "epitaph-capture:plain2" })
	b := e.start(t, e.standbyConfig("epitaph-capture:sb2"))
	require.Eventually(t, func() bool {
		st := b.CurrentStatus()
		return st.Role == RoleStandby && st.Standby != nil && st.Standby.WaitingFor == "slot"
	}, 30*time.Second, 20*time.Millisecond)
	// End b's pool sessions (not its lease session, which holds the lock).
	e.exec(t, `SELECT pg_terminate_backend(a.pid) FROM pg_stat_activity a
		WHERE a.application_name = 'epitaph-capture:sb2' AND a.backend_type = 'client backend'
		  AND NOT EXISTS (SELECT 1 FROM pg_locks l WHERE l.pid = a.pid AND l.locktype = 'advisory')`)
	time.Sleep(2 * time.Second)
	select {
	case <-b.ss.Done():
		t.Fatalf("the standby exited on a lost pool connection: %v", b.Wait())
	default:
	}
	require.Equal(t, RoleStandby, b.CurrentStatus().Role)
	require.NoError(t, a.Stop(context.Background()))
	waitRole(t, b, RoleActive)
	e.exec(t, `DELETE FROM s`)
	requireOnce(t, e.deletes(t, "main", 2), 2)
}
