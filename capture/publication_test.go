package capture

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
)

// TestTableRemovedFromThePublicationBySomeoneElseRecordsAGap: someone
// drops a captured table from the capture's publication while the capture
// streams; a delete before the catalog poll adds it again is not decoded
// for the capture. When the poll adds it again the capture records a gap
// naming the table, as it does for the tables it removes itself.
func TestTableRemovedFromThePublicationBySomeoneElseRecordsAGap(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE g (id int PRIMARY KEY); ALTER TABLE g REPLICA IDENTITY FULL; INSERT INTO g VALUES (1), (2), (3)`)
	e.start(t, nil)
	e.exec(t, `DELETE FROM g WHERE id = 1`)
	e.messages(t, "main", 2)
	e.exec(t, `ALTER PUBLICATION epitaph DROP TABLE g`)
	e.exec(t, `DELETE FROM g WHERE id = 2`) // not published: not captured
	deadline := time.Now().Add(30 * time.Second)
	for queryString(t, e.db, `SELECT count(*)::text FROM pg_publication_tables WHERE pubname = 'epitaph' AND tablename = 'g'`) != "1" {
		require.True(t, time.Now().Before(deadline), "the catalog poll did not add the table again")
		time.Sleep(100 * time.Millisecond)
	}
	e.exec(t, `DELETE FROM g WHERE id = 3`)
	e.deletes(t, "main", 2)
	var gaps []string
	for _, m := range e.messages(t, "main", 0) {
		if m.ev.Op == event.OpGap && m.ev.Table == "g" {
			gaps = append(gaps, m.ev.Reason)
		}
	}
	require.Len(t, gaps, 4, "the delete of id 2, made while someone had removed the table from the publication, is neither in the stream nor a gap: a gap on every partition")
	require.Contains(t, gaps[0], "removed from the publication by someone else")
}

// holdReconcile makes svc's next catalog reconcile, once armed, stop
// after it has read the publication's members: held is closed then, and
// it goes on when release is closed (or the test ends).
func holdReconcile(t *testing.T, svc *Service) (armed *atomic.Bool, held, release chan struct{}) {
	t.Helper()
	armed = &atomic.Bool{}
	held, release, done := make(chan struct{}), make(chan struct{}), make(chan struct{})
	t.Cleanup(func() { close(done) }) // never leave the watch held (runs before the stop)
	svc.hooks = &testHooks{afterMembers: func() {
		if armed.CompareAndSwap(true, false) {
			close(held)
			select {
			case <-release:
			case <-done:
			}
		}
	}}
	return armed, held, release
}

// TestTableRemovedWhileAReconcileRunsStillRecordsAGap: someone removes a
// captured table from the publication while a catalog reconcile (for
// another table) is under way: it read the publication before the removal
// and its list of published tables after. The table still counts as
// published at that look, so the reconcile that adds it again records the
// gap of the delete made while it was out.
func TestTableRemovedWhileAReconcileRunsStillRecordsAGap(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE g (id int PRIMARY KEY); ALTER TABLE g REPLICA IDENTITY FULL; INSERT INTO g VALUES (1), (2), (3)`)
	cfg := e.config()
	fastPoll(&cfg)
	svc := newService(t, cfg)
	armed, held, release := holdReconcile(t, svc)
	require.NoError(t, svc.Start(context.Background()))
	e.exec(t, `DELETE FROM g WHERE id = 1`)
	e.messages(t, "main", 2)

	armed.Store(true)
	e.exec(t, `CREATE TABLE h (id int PRIMARY KEY); ALTER TABLE h REPLICA IDENTITY FULL`) // a reconcile for h
	select {
	case <-held:
	case <-time.After(30 * time.Second):
		t.Fatal("no catalog reconcile after CREATE TABLE")
	}
	e.exec(t, `ALTER PUBLICATION epitaph DROP TABLE g`)
	e.exec(t, `DELETE FROM g WHERE id = 2`) // not published: not captured
	close(release)

	deadline := time.Now().Add(30 * time.Second)
	for queryString(t, e.db, `SELECT count(*)::text FROM pg_publication_tables WHERE pubname = 'epitaph' AND tablename = 'g'`) != "1" {
		require.True(t, time.Now().Before(deadline), "the catalog poll did not add the table again")
		time.Sleep(100 * time.Millisecond)
	}
	e.exec(t, `DELETE FROM g WHERE id = 3`)
	e.deletes(t, "main", 2)
	var gaps []string
	for _, m := range e.messages(t, "main", 0) {
		if m.ev.Op == event.OpGap && m.ev.Table == "g" {
			gaps = append(gaps, m.ev.Reason)
		}
	}
	require.Len(t, gaps, 4, "the delete of id 2 is neither in the stream nor a gap: a gap on every partition")
	require.Contains(t, gaps[0], "removed from the publication by someone else")
}
