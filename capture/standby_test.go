package capture

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// standbyConfig is a standby capture named app, serving its endpoints.
func (e *env) standbyConfig(app string) func(*Config) {
	return func(c *Config) {
		c.Standby = true
		c.StandbyPoll = 100 * time.Millisecond
		c.ApplicationName = app
		c.MetricsAddr = "127.0.0.1:0"
	}
}

func waitRole(t *testing.T, svc *Service, role string) Status {
	t.Helper()
	var st Status
	require.Eventually(t, func() bool {
		st = svc.CurrentStatus()
		return st.Role == role
	}, 30*time.Second, 20*time.Millisecond, "role %s, last status %+v", role, st)
	return st
}

// scrapedValue reads an unlabelled metric from a /metrics text.
func scrapedValue(t *testing.T, text, name string) string {
	t.Helper()
	for _, l := range strings.Split(text, "\n") {
		if v, ok := strings.CutPrefix(l, name+" "); ok {
			return v
		}
	}
	t.Fatalf("metric %s not found", name)
	return ""
}

// TestStandbyWaitsAndTakesOver runs two standby captures of one slot: the
// first streams, the second waits (healthy, not active, naming the holder)
// and takes over when the first stops; every row is in the stream once.
func TestStandbyWaitsAndTakesOver(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE s (id int PRIMARY KEY); ALTER TABLE s REPLICA IDENTITY FULL;
		INSERT INTO s SELECT generate_series(1, 10)`)
	a := e.start(t, e.standbyConfig("epitaph-capture:test-a"))
	waitRole(t, a, RoleActive)
	b := e.start(t, e.standbyConfig("epitaph-capture:test-b"))
	st := waitRole(t, b, RoleStandby)
	require.False(t, st.Active)
	require.Eventually(t, func() bool {
		st = b.CurrentStatus()
		return st.Standby != nil && st.Standby.Holder != nil
	}, 10*time.Second, 20*time.Millisecond)
	require.Equal(t, "lease", st.Standby.WaitingFor)
	require.Equal(t, "epitaph-capture:test-a", st.Standby.Holder.ApplicationName)

	base := "http://" + b.MetricsAddr()
	code, body := httpGet(t, base+"/healthz")
	require.Equal(t, http.StatusOK, code, body)
	// A waiting standby is live and ready: it must not be restarted.
	for _, p := range []string{"/livez", "/readyz"} {
		code, body = httpGet(t, base+p)
		require.Equal(t, http.StatusOK, code, "%s: %s", p, body)
	}
	_, body = httpGet(t, base+"/metrics")
	require.Equal(t, "0", scrapedValue(t, body, "epitaph_capture_active"))
	_, body = httpGet(t, base+"/status")
	var doc map[string]any
	require.NoError(t, json.Unmarshal([]byte(body), &doc))
	require.Equal(t, "standby", doc["role"])
	_, body = httpGet(t, "http://"+a.MetricsAddr()+"/metrics")
	require.Equal(t, "1", scrapedValue(t, body, "epitaph_capture_active"))

	// The slot is streamed by a's replication connection.
	require.Equal(t, "epitaph-capture:test-a", queryString(t, e.db, `SELECT a.application_name FROM pg_replication_slots s
		JOIN pg_stat_activity a ON a.pid = s.active_pid WHERE s.slot_name = $1`, e.slot))

	e.exec(t, `DELETE FROM s WHERE id <= 5`)
	e.deletes(t, "main", 5)
	require.NoError(t, a.Stop(context.Background()))
	require.NoError(t, a.Wait())
	waitRole(t, b, RoleActive)
	e.exec(t, `DELETE FROM s WHERE id > 5`)
	ms := e.deletes(t, "main", 10)
	requireOnce(t, ms, 10)
	require.Equal(t, "epitaph-capture:test-b", queryString(t, e.db, `SELECT a.application_name FROM pg_replication_slots s
		JOIN pg_stat_activity a ON a.pid = s.active_pid WHERE s.slot_name = $1`, e.slot))

	// a, restarted, is the standby now.
	a = e.start(t, e.standbyConfig("epitaph-capture:test-a"))
	st = waitRole(t, a, RoleStandby)
	require.Equal(t, 0, len(st.PublicationTables), "a standby has not touched the publication")
	require.NoError(t, b.Stop(context.Background()))
	require.NoError(t, b.Wait())
	waitRole(t, a, RoleActive)
}

// TestStandbyLeaseLostFailsClosed kills the lease connection of a streaming
// capture: it stops at once with a *LeaseLostError, releasing the slot.
func TestStandbyLeaseLostFailsClosed(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE s (id int PRIMARY KEY); INSERT INTO s VALUES (1)`)
	a := e.start(t, e.standbyConfig("epitaph-capture:lease-lost"))
	waitRole(t, a, RoleActive)
	// The lease session is the one holding an advisory lock.
	e.exec(t, `SELECT pg_terminate_backend(l.pid) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
		WHERE l.locktype = 'advisory' AND a.application_name = 'epitaph-capture:lease-lost'`)
	start := time.Now()
	err := waitEnded(t, a)
	var lost *LeaseLostError
	require.True(t, errors.As(err, &lost), "err = %v", err)
	require.Less(t, time.Since(start), 10*time.Second)
	require.Equal(t, RoleStopped, a.CurrentStatus().Role)
	require.Eventually(t, func() bool {
		return queryString(t, e.db, `SELECT active::text FROM pg_replication_slots WHERE slot_name = $1`, e.slot) == "false"
	}, 10*time.Second, 50*time.Millisecond)

	// A new standby takes it and carries on.
	e.start(t, e.standbyConfig("epitaph-capture:lease-lost-2"))
	e.exec(t, `DELETE FROM s`)
	ms := e.deletes(t, "main", 1)
	requireOnce(t, ms, 1)
}

// TestStandbyStoppedWhileWaiting: a standby stopped before it gets the
// lease ends without error and without touching anything.
func TestStandbyStoppedWhileWaiting(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE s (id int PRIMARY KEY)`)
	a := e.start(t, e.standbyConfig("epitaph-capture:w-a"))
	waitRole(t, a, RoleActive)
	b := e.start(t, e.standbyConfig("epitaph-capture:w-b"))
	waitRole(t, b, RoleStandby)
	require.NoError(t, b.Stop(context.Background()))
	require.NoError(t, b.Wait())
	require.Equal(t, RoleStopped, b.CurrentStatus().Role)
	require.Equal(t, RoleActive, a.CurrentStatus().Role)
}

func TestStandbyNeedsExternalBroker(t *testing.T) {
	t.Parallel()
	_, err := New(Config{SourceURL: "postgres://u@127.0.0.1/db", DataDir: t.TempDir(), Standby: true})
	require.True(t, IsPermanent(err))
	require.ErrorContains(t, err, "standby needs an external JetStream server (EPITAPH_NATS_URL)")
}

func TestLeaseKeyParts(t *testing.T) {
	k := leaseKey("db", "epitaph")
	require.NotEqual(t, k, leaseKey("db", "epitaph2"))
	require.NotEqual(t, k, leaseKey("db2", "epitaph"))
	hi, lo := lockParts(k)
	require.Equal(t, uint64(k), uint64(hi)<<32|uint64(lo))
	require.Less(t, lo, int64(1)<<32)
}

// TestStandbyWaitsForSlotHeldWithoutLease: a capture started without
// --standby streams without the lease; a standby takes the lease, waits for
// the slot (naming its holder) and streams once that capture stops.
func TestStandbyWaitsForSlotHeldWithoutLease(t *testing.T) {
	t.Parallel()
	e := setup(t)
	e.exec(t, `CREATE TABLE s (id int PRIMARY KEY); INSERT INTO s VALUES (1), (2)`)
	a := e.start(t, func(c *Config) { c.ApplicationName = "epitaph-capture:plain" })
	b := e.start(t, e.standbyConfig("epitaph-capture:sb"))
	var st Status
	require.Eventually(t, func() bool {
		st = b.CurrentStatus()
		return st.Role == RoleStandby && st.Standby != nil && st.Standby.WaitingFor == "slot" && st.Standby.Holder != nil
	}, 30*time.Second, 20*time.Millisecond, "status %+v", st)
	require.Equal(t, "epitaph-capture:plain", st.Standby.Holder.ApplicationName)
	e.exec(t, `DELETE FROM s WHERE id = 1`)
	e.deletes(t, "main", 1)
	require.NoError(t, a.Stop(context.Background()))
	require.NoError(t, a.Wait())
	waitRole(t, b, RoleActive)
	e.exec(t, `DELETE FROM s WHERE id = 2`)
	requireOnce(t, e.deletes(t, "main", 2), 2)
}

// TestLeaseSession: one session holds the lock, pg_locks names it, a
// second cannot take it until the first closes; the lease session asks for
// short TCP keepalives.
func TestLeaseSession(t *testing.T) {
	t.Parallel()
	db := setup(t).db
	ctx := t.Context()
	a, err := newLease(db, "epitaph-capture:lease-a", "somedb", "slot", DefaultSourceTCPTimeout)
	require.NoError(t, err)
	defer a.close()
	b, err := newLease(db, "epitaph-capture:lease-b", "somedb", "slot", DefaultSourceTCPTimeout)
	require.NoError(t, err)
	defer b.close()
	got, err := a.try(ctx)
	require.NoError(t, err)
	require.True(t, got)
	require.NoError(t, a.check(ctx))
	got, err = b.try(ctx)
	require.NoError(t, err)
	require.False(t, got)
	h, err := b.holder(ctx)
	require.NoError(t, err)
	require.NotNil(t, h)
	require.Equal(t, "epitaph-capture:lease-a", h.ApplicationName)
	require.EqualValues(t, a.conn.PgConn().PID(), h.PID)
	for k, v := range map[string]string{"tcp_keepalives_idle": "10", "tcp_keepalives_interval": "5", "tcp_keepalives_count": "3", "tcp_user_timeout": "20000"} {
		var got string
		require.NoError(t, a.conn.QueryRow(ctx, "SELECT current_setting($1)", k).Scan(&got))
		require.Equal(t, v, got, k)
	}
	require.Error(t, b.check(ctx), "b does not hold it")
	a.close()
	require.Eventually(t, func() bool { got, err := b.try(ctx); return err == nil && got }, 10*time.Second, 50*time.Millisecond)
	require.NoError(t, b.check(ctx))
}
