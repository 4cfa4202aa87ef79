package projection_test

import (
	"context"
	"encoding/json"
	"regexp"
	"sort"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/projection"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// archivedRow is a target's archive.rows, one entry per row: table, key and
// row image, decoded, in a stable order.
type archivedRow struct {
	Table string
	Key   map[string]any
	Row   map[string]any
}

func archiveOf(t *testing.T, c *pgx.Conn) []archivedRow {
	t.Helper()
	rows, err := c.Query(context.Background(), `SELECT schema_name || '.' || table_name, key::text, row::text
		FROM archive.rows ORDER BY 1, (key->>'id')::bigint`)
	require.NoError(t, err)
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (archivedRow, error) {
		var a archivedRow
		var k, v string
		if err := r.Scan(&a.Table, &k, &v); err != nil {
			return a, err
		}
		if err := json.Unmarshal([]byte(k), &a.Key); err != nil {
			return a, err
		}
		return a, json.Unmarshal([]byte(v), &a.Row)
	})
	require.NoError(t, err)
	return out
}

// expectedArchive is what the archive must hold for the published
// transactions, in archiveOf's order.
func expectedArchive(t *testing.T, txs []*txn) []archivedRow {
	t.Helper()
	var out []archivedRow
	for _, tx := range txs {
		for _, r := range tx.rows {
			a := archivedRow{Table: r.schema + "." + r.table}
			require.NoError(t, json.Unmarshal([]byte(r.key), &a.Key))
			require.NoError(t, json.Unmarshal([]byte(r.image), &a.Row))
			out = append(out, a)
		}
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Table != out[j].Table {
			return out[i].Table < out[j].Table
		}
		return out[i].Key["id"].(float64) < out[j].Key["id"].(float64)
	})
	return out
}

func groupOf(t *testing.T, url string) string {
	t.Helper()
	ctx := context.Background()
	c, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer c.Close(ctx)
	g, err := version.DefaultGroup(ctx, c)
	require.NoError(t, err)
	return g
}

// The default group is 8 hex digits, stable for a database, different for
// two databases of one server.
func TestDefaultGroupPerTarget(t *testing.T) {
	t.Parallel()
	a, b := testenv.NewDatabase(t), testenv.NewDatabase(t)
	ga, gb := groupOf(t, a), groupOf(t, b)
	require.Regexp(t, regexp.MustCompile(`^[0-9a-f]{8}$`), ga)
	require.Equal(t, ga, groupOf(t, a))
	require.NotEqual(t, ga, gb)
	require.Error(t, version.ValidateGroup("a_b"))
	require.Error(t, version.ValidateGroup("a.b"))
	require.Error(t, version.ValidateGroup(""))
	require.NoError(t, version.ValidateGroup("blue-2"))
}

// Two projectors write to different target databases from one stream:
// each reads through its own group's consumers, both archives hold exactly
// the deleted rows, and neither ever resets a consumer (before groups they
// shared archive-v1-p<p> and kept deleting each other's).
func TestTwoTargetsFromOneStream(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	url2 := testenv.NewDatabase(t)
	cfgA := e.config("a")
	cfgB := e.config("b")
	// Not a lease test: a lease lost to a slow renewal on a loaded machine
	// restarts partitions, and a restarted partition may reset its consumer.
	cfgA.LeaseTTL, cfgB.LeaseTTL = 30*time.Second, 30*time.Second
	cfgB.TargetURL = testenv.NoSearchPath(url2)
	a := e.start(cfgA)
	b := e.start(cfgB)
	eventually(t, 10*time.Second, func() bool { return len(owned(a)) == 2 && len(owned(b)) == 2 })
	ca := e.conn()
	cb, err := pgx.Connect(context.Background(), url2)
	require.NoError(t, err)
	t.Cleanup(func() { cb.Close(context.Background()) })

	var txs []*txn
	for i := 0; i < 40; i++ {
		tx := e.nextTx(orderRows(i+1, 2)...)
		txs = append(txs, tx)
		e.publish(tx)
		if i%10 == 9 {
			e.heartbeat()
		}
	}
	want := expectedArchive(t, txs)
	for _, c := range []*pgx.Conn{ca, cb} {
		eventually(t, 30*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) >= len(want) })
	}
	// Idle a while: both keep polling their consumers.
	lsn := e.heartbeat()
	for _, c := range []*pgx.Conn{ca, cb} {
		eventually(t, 20*time.Second, func() bool {
			return count(t, c, `SELECT count(*) FROM epitaph.progress WHERE source_lsn >= $1::pg_lsn`, lsn.String()) == 2
		})
	}
	require.Equal(t, want, archiveOf(t, ca))
	require.Equal(t, want, archiveOf(t, cb))
	// Sharing consumers, the two kept resetting each other's, again and
	// again (5-7 times per 30 s, with no failure of their own). Now the
	// stream holds four consumers, each group's own (below). A worker
	// still resets its own consumer when a partition restarts after a
	// transient failure (a timeout on a loaded machine: the deliveries it
	// had fetched and not applied are pending on the server), and only
	// then. (The reset once seen with no failure was a fetch the client
	// ended at its own deadline while the server still delivered to it:
	// TestFetchPageLosesNoDeliveryToAnEndingFetch.)
	for name, s := range map[string]*projection.Service{"a": a, "b": b} {
		resets := metricSum(t, s, "epitaph_projector_consumer_resets_total")
		failures := metricSum(t, s, "epitaph_projector_transient_errors_total")
		why := map[string]float64{}
		for _, r := range []string{"ack_pending", "ack_floor", "stalled", "config"} {
			if n := metricSumLabel(t, s, "epitaph_projector_consumer_resets_total", "reason", r); n > 0 {
				why[r] = n
			}
		}
		t.Logf("%s reset %v consumers of its own %v, after %v transient failures", name, resets, why, failures)
		require.LessOrEqual(t, resets, failures, "%s reset consumers with no failure to explain it (reasons %v)", name, why)
	}

	ctx := context.Background()
	stream, err := e.js.Stream(ctx, event.StreamName(src))
	require.NoError(t, err)
	names := map[string]bool{}
	for n := range stream.ConsumerNames(ctx).Name() {
		names[n] = true
	}
	ga, gb := a.Group(), b.Group()
	require.Equal(t, groupOf(t, e.url), ga)
	require.Equal(t, groupOf(t, url2), gb)
	// Each target's consumers are the ones recorded on its progress rows,
	// named for its group with a random part.
	require.Equal(t, map[string]bool{
		recordedConsumer(t, e.url, ga, 1, 0): true, recordedConsumer(t, e.url, ga, 1, 1): true,
		recordedConsumer(t, url2, gb, 1, 0): true, recordedConsumer(t, url2, gb, 1, 1): true,
	}, names)
}

// Deployments from before consumer names carried a random part read
// through <group>_archive-v1-p<p> (recorded on the row) or, before consumer
// groups, archive-v1-p<p> (nothing recorded). After the upgrade the worker
// deletes the old consumer, records a new name of its group with a random
// part and creates that consumer at the Postgres cursor (the cursor is the
// truth); nothing is lost or applied twice, --group (Config.Group) names
// the consumers, and a restart reuses the recorded names.
func TestOldConsumersMigrateToTheGroup(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	c := e.conn()
	ctx := context.Background()
	cfg := e.config("w1")
	cfg.Group = "blue"
	cfg.LeaseTTL = 30 * time.Second // not a lease test (see TestTwoTargetsFromOneStream)
	var txs []*txn
	publish := func(n int) {
		for i := 0; i < n; i++ {
			tx := e.nextTx(orderRows(len(txs)+1, 1)...)
			txs = append(txs, tx)
			e.publish(tx)
		}
	}
	publish(10)
	s := e.start(cfg)
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 20 })
	require.NoError(t, s.Stop(ctx))
	first := []string{recordedConsumer(t, e.url, "blue", 1, 0), recordedConsumer(t, e.url, "blue", 1, 1)}

	// A restart reuses the recorded names.
	s = e.start(cfg)
	publish(5)
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 30 })
	require.NoError(t, s.Stop(ctx))
	require.Equal(t, first, []string{recordedConsumer(t, e.url, "blue", 1, 0), recordedConsumer(t, e.url, "blue", 1, 1)})

	// Make it look like the old deployments: the consumers under the old
	// names at the cursor; partition 0 records the group's name, partition
	// 1 nothing.
	stream, err := e.js.Stream(ctx, event.StreamName(src))
	require.NoError(t, err)
	old := []string{"blue_archive-v1-p0", "archive-v1-p1"}
	for p := 0; p < 2; p++ {
		var cursor uint64
		require.NoError(t, c.QueryRow(ctx, `SELECT cursor FROM epitaph.progress WHERE partition = $1`, p).Scan(&cursor))
		require.NoError(t, stream.DeleteConsumer(ctx, first[p]))
		_, err := stream.CreateConsumer(ctx, jetstream.ConsumerConfig{Durable: old[p],
			FilterSubject: event.PartitionFilter(src, p), DeliverPolicy: jetstream.DeliverByStartSequencePolicy,
			OptStartSeq: cursor + 1, AckPolicy: jetstream.AckAllPolicy})
		require.NoError(t, err)
	}
	_, err = c.Exec(ctx, `UPDATE epitaph.progress SET consumer = CASE partition WHEN 0 THEN 'blue_archive-v1-p0' END`)
	require.NoError(t, err)
	publish(10) // while no projector runs

	s2, err := projection.New(cfg, projection.WithLogger(testLogger(t)), projection.WithRegistry(prometheus.NewRegistry()))
	require.NoError(t, err)
	require.NoError(t, s2.Start(ctx))
	t.Cleanup(func() { require.NoError(t, s2.Stop(context.Background())) })
	publish(10)
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 70 })
	require.Equal(t, expectedArchive(t, txs), archiveOf(t, c))
	eventually(t, 10*time.Second, func() bool {
		return count(t, c, `SELECT count(*) FROM epitaph.progress WHERE consumer LIKE 'blue\_archive-v1-p_-%'`) == 2
	})
	for p := 0; p < 2; p++ {
		_, err := stream.Consumer(ctx, old[p])
		require.ErrorIs(t, err, jetstream.ErrConsumerNotFound, "old consumer of p%d", p)
		name := recordedConsumer(t, e.url, "blue", 1, p)
		require.NotEqual(t, first[p], name, "a new name")
		_, err = stream.Consumer(ctx, name)
		require.NoError(t, err)
	}
	names := map[string]bool{}
	for n := range stream.ConsumerNames(ctx).Name() {
		names[n] = true
	}
	require.Len(t, names, 2, "no consumer left behind: %v", names)
	// The migration itself resets nothing; a partition restarted after a
	// transient failure (a timeout on a loaded machine) resets its consumer
	// to the cursor, and only that may.
	resets := metricSum(t, s2, "epitaph_projector_consumer_resets_total")
	failures := metricSum(t, s2, "epitaph_projector_transient_errors_total")
	t.Logf("reset %v consumers after %v transient failures", resets, failures)
	require.LessOrEqual(t, resets, failures)
}

// A worker restarted with the same id takes its own leases back at once
// (new epochs, same owner) instead of waiting out its lease TTL, and
// resumes applying.
func TestRestartWithSameIDTakesLeasesBack(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 4)
	c := e.conn()
	cfg := e.config("w1")
	cfg.LeaseTTL = time.Minute
	cfg.BalanceInterval = 300 * time.Millisecond
	hardCtx, kill := context.WithCancel(context.Background())
	first, err := projection.New(cfg, projection.WithLogger(testLogger(t)), projection.WithRegistry(prometheus.NewRegistry()))
	require.NoError(t, err)
	require.NoError(t, first.Start(hardCtx))
	t.Cleanup(func() { require.NoError(t, first.Stop(context.Background())) })
	eventually(t, 10*time.Second, func() bool { return len(owned(first)) == 4 })
	e.publish(e.nextTx(orderRows(1, 1)...))
	eventually(t, 10*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 2 })
	before := count(t, c, `SELECT sum(epoch) FROM epitaph.progress`)

	kill() // dies holding its leases
	<-first.Done()
	require.Equal(t, 4, count(t, c, `SELECT count(*) FROM epitaph.progress WHERE owner = 'w1' AND lease_expires_at > now() + interval '30 seconds'`),
		"the leases are still valid for most of their TTL")

	restarted := time.Now()
	second := e.start(cfg)
	eventually(t, 5*time.Second, func() bool { return len(owned(second)) == 4 })
	require.Less(t, time.Since(restarted), cfg.LeaseTTL/2, "took its leases back before they expired")
	require.Equal(t, before+4, count(t, c, `SELECT sum(epoch) FROM epitaph.progress`), "each taken back with a new epoch")
	require.Equal(t, 4, count(t, c, `SELECT count(*) FROM epitaph.progress WHERE owner = 'w1'`))
	e.publish(e.nextTx(orderRows(2, 1)...))
	eventually(t, 10*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 4 })
}
