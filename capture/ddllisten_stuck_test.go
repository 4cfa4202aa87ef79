package capture

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// A catalog check that is running when every path to the source dies
// sends its next query on a connection the pool hands out without a ping
// (used under a second ago) and waits there for the source's TCP timeout
// (30 s). The LISTEN notices the death sooner (its quiet period and a
// ping) and comes back; a table created then must be published at once,
// not after the stuck check gives up.
func TestCatalogCheckStuckOnADeadPathIsAbandonedWhenTheListenIsLost(t *testing.T) {
	t.Parallel()
	e := setupNoTwoPhase(t)
	proxy, viaProxy := testenv.ProxiedURL(t, e.db)
	cfg := e.config()
	notifyGuard(&cfg)
	cfg.SourceURL = viaProxy
	svc := newService(t, cfg)
	armed, held, release := holdReconcile(t, svc)
	require.NoError(t, svc.Start(context.Background()))
	pid := e.listenPID(t, 0)
	waitListenUp(t, svc, true, 5*time.Second)

	// A check for a new table, held after its first queries.
	armed.Store(true)
	e.exec(t, `CREATE TABLE first (id int PRIMARY KEY, v text); ALTER TABLE first REPLICA IDENTITY FULL`)
	select {
	case <-held:
	case <-time.After(30 * time.Second):
		t.Fatal("no catalog check after CREATE TABLE")
	}
	// Every path through the proxy dies but the replication connection's;
	// the check goes on, on a connection used a moment ago.
	walsender := e.walsenderPID(t, 0, 5*time.Second)
	killed := proxy.BlackholeAllBut(t, e.clientPort(t, walsender))
	require.GreaterOrEqual(t, killed, 2, "the LISTEN and the check's connection")
	close(release)

	waitListenUp(t, svc, false, 30*time.Second)
	took := waitListenUp(t, svc, true, 30*time.Second)
	t.Logf("LISTEN up again %s after it was reported down", took)
	e.listenPID(t, pid)
	e.exec(t, `CREATE TABLE later (id int PRIMARY KEY, v text); ALTER TABLE later REPLICA IDENTITY FULL`)
	took = e.waitPublished(t, "later", 3*time.Second)
	t.Logf("published %s after the CREATE TABLE committed", took)
	e.waitPublished(t, "first", time.Second)
}
