package bench_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/bench"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

func TestMain(m *testing.M) { testenv.MainNoLeaks(m) }

// A JetStream request the server took and never answered (an embedded
// broker that died with its capture before answering) does not hold the
// wait for the capture's stream past its deadline: it fails at the deadline
// (CI once waited the test's whole 10 minutes, then said "within 1m0s"),
// saying what is missing.
func TestWaitCaptureReadyFailsAtItsDeadline(t *testing.T) {
	t.Parallel()
	srv, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: -1, NoLog: true, NoSigs: true})
	require.NoError(t, err)
	go srv.Start()
	t.Cleanup(srv.Shutdown)
	require.True(t, srv.ReadyForConnections(30*time.Second))
	// Takes every JetStream API request and answers none.
	nc, err := nats.Connect(srv.ClientURL())
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	sub, err := nc.SubscribeSync("$JS.API.>")
	require.NoError(t, err)
	require.NoError(t, nc.Flush())
	t.Cleanup(func() { _ = sub.Unsubscribe() })

	watch, err := bench.WatchStream(srv.ClientURL(), "waits")
	require.NoError(t, err)
	defer watch.Close()
	url := testenv.NewDatabase(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	start := time.Now()
	err = bench.WaitCaptureReady(ctx, watch, url, "waits", 2*time.Second, nil)
	require.Error(t, err)
	require.NotErrorIs(t, err, context.DeadlineExceeded)
	require.Contains(t, err.Error(), `capture made no stream and slot "waits" within 2s (stream exists: false; slot exists: false`)
	require.Contains(t, err.Error(), "\nslot waits:", "says what slot creation waits for (here nothing: the cluster is shared)")
	require.Less(t, time.Since(start), time.Minute, "failed at its deadline (2 s, and one bounded poll)")
	m, err := sub.NextMsg(10 * time.Second)
	require.NoError(t, err, "the request reached the server")
	require.True(t, strings.HasPrefix(m.Subject, "$JS.API.STREAM.INFO."), m.Subject)
}

// Creating a logical replication slot waits for every transaction that
// holds an xid anywhere in the cluster, another database's too: the
// walsender waits on the blocker's transactionid lock, and SlotWaits names
// the blocker (its pid, database, how long its transaction has been open).
// Once the blocker commits, the slot is created. Not parallel: its open
// transaction would hold up any other test's slot.
func TestSlotCreationWaitsForTransactionsOfTheWholeCluster(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	other := testenv.NewDatabase(t)
	blocker, err := pgx.Connect(ctx, other)
	require.NoError(t, err)
	defer blocker.Close(context.WithoutCancel(ctx))
	tx, err := blocker.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(context.WithoutCancel(ctx))
	var pid int
	var xid int64
	require.NoError(t, tx.QueryRow(ctx, "SELECT txid_current()").Scan(&xid))
	require.NoError(t, tx.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid))

	url := testenv.NewDatabase(t)
	rcfg, err := pgconn.ParseConfig(url)
	require.NoError(t, err)
	rcfg.RuntimeParams["replication"] = "database"
	repl, err := pgconn.ConnectConfig(ctx, rcfg)
	require.NoError(t, err)
	defer repl.Close(context.WithoutCancel(ctx))
	created := make(chan error, 1)
	go func() {
		_, err := pglogrepl.CreateReplicationSlot(ctx, repl, "waits_for_the_cluster", "pgoutput",
			pglogrepl.CreateReplicationSlotOptions{Mode: pglogrepl.LogicalReplication, SnapshotAction: "NOEXPORT_SNAPSHOT"})
		created <- err
	}()
	want := fmt.Sprintf("waits on Lock/transactionid, blocked by pid %d (database %s,", pid, rcfgDatabase(t, other))
	var waits string
	for deadline := time.Now().Add(2 * time.Minute); !strings.Contains(waits, want); {
		require.True(t, time.Now().Before(deadline), "slot creation never seen waiting for pid %d:%s", pid, waits)
		select {
		case err := <-created:
			require.Fail(t, "the slot was created while a transaction ran", "err %v", err)
		case <-time.After(100 * time.Millisecond):
		}
		waits = bench.SlotWaits(ctx, url)
	}
	t.Logf("%s", waits)
	require.Contains(t, waits, "transaction open for")
	require.NoError(t, tx.Commit(ctx))
	select {
	case err := <-created:
		require.NoError(t, err, "created once the blocker committed")
	case <-time.After(2 * time.Minute):
		require.Fail(t, "slot not created after the blocker committed", bench.SlotWaits(ctx, url))
	}
	testenv.Exec(t, url, "SELECT pg_drop_replication_slot('waits_for_the_cluster')")
}

func rcfgDatabase(t *testing.T, url string) string {
	t.Helper()
	c, err := pgconn.ParseConfig(url)
	require.NoError(t, err)
	return c.Database
}
