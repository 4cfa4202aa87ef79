package projection_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/projection"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/erasure"
	"github.com/epitaph-dev/epitaph/projection/retention"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// The test transactions are committed on 2026-11-30: a TTL of an hour has
// passed for them, one of 100 years has not.
func retentionConfig(e *env, worker string) projection.Config {
	cfg := e.config(worker)
	cfg.ArchiveTTL = map[string]time.Duration{"public.sessions": time.Hour, "*": 100 * 365 * 24 * time.Hour}
	cfg.CleanupInterval = -1 // the tests run the batches
	return cfg
}

func sessionRows(from, n int) []row {
	var rs []row
	for i := from; i < from+n; i++ {
		rs = append(rs, row{schema: "public", table: "sessions", key: fmt.Sprintf(`{"id":%d}`, i),
			image: fmt.Sprintf(`{"id":%d,"token":"tok-%d"}`, i, i)})
	}
	return rs
}

func newPool(t *testing.T, url string) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), url)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

func keysOf(t *testing.T, c *pgx.Conn, sql string, args ...any) []string {
	t.Helper()
	rows, err := c.Query(context.Background(), sql, args...)
	require.NoError(t, err)
	ks, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return ks
}

// Expired rows vanish from archive.rows at once and from every version's
// table within one batch; held rows and rows with open deliveries stay
// (hidden); unexpired rows are untouched; snapshots go with their root; a
// deleted row's terminal deliveries go with it once no version's archive
// holds the row, an unexpired row's stay.
func TestRetentionCleanup(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	cfg := retentionConfig(e, "w1")
	cfg.SnapshotRoots = []string{"public.sessions"}
	e.start(cfg)
	t1 := e.nextTx(sessionRows(1, 5)...)
	t2 := e.nextTx(orderRows(1, 2)...)
	e.publish(t1)
	e.publish(t2)
	c := e.conn()
	eventually(t, 20*time.Second, func() bool {
		return count(t, c, `SELECT count(*) FROM archive_v1.rows WHERE verified`) == 8 &&
			count(t, c, `SELECT count(*) FROM archive_v1.snapshots`) == 5
	})
	// Hidden at once: the view shows the unexpired rows only.
	require.Equal(t, []string{`{"id": 1000}`, `{"id": 1001}`, `{"id": 1}`},
		keysOf(t, c, `SELECT key::text FROM archive.rows ORDER BY table_name, key`))
	require.Equal(t, 0, count(t, c, `SELECT count(*) FROM archive.snapshots`))

	ctx := context.Background()
	pool := newPool(t, e.url)
	// Session 2 under a legal hold (by match), session 3 with a pending
	// delivery, session 4 with a done one and a dead one, session 5 with a
	// stopped one; the unexpired order 1000 with a done one.
	_, err := erasure.AddLegalHold(ctx, pool, erasure.LegalHoldOptions{
		Table: "public.sessions", Match: json.RawMessage(`{"token":"tok-2"}`), Reason: "litigation 7", Actor: "tester"})
	require.NoError(t, err)
	deliver := func(tx *txn, seq int, table, state string) {
		_, err := c.Exec(ctx, `INSERT INTO epitaph.deliveries (id, handler_id, source, commit_lsn, seq, schema_name, table_name,
			key, correlation_id, version, state) VALUES (gen_random_uuid(), gen_random_uuid(), $1, $2::pg_lsn, $3, 'public', $4,
			'{}', 'x', 1, $5)`, src, tx.lsn.String(), seq, table, state)
		require.NoError(t, err)
	}
	deliver(t1, 2, "sessions", "pending")
	deliver(t1, 3, "sessions", "done")
	deliver(t1, 3, "sessions", "dead")
	deliver(t1, 4, "sessions", "stopped")
	deliver(t2, 0, "orders", "done")
	deliveriesOf := func(tx *txn, seq int) int {
		return count(t, c, `SELECT count(*) FROM epitaph.deliveries WHERE commit_lsn = $1::pg_lsn AND seq = $2`, tx.lsn.String(), seq)
	}
	res, err := retention.CleanupBatch(ctx, pool, retention.CleanupOptions{Batch: 100})
	require.NoError(t, err)
	require.Equal(t, 3, res.Deleted)
	require.Equal(t, map[string]int{"public.sessions": 3}, res.ByTable)
	require.Equal(t, 3, res.Snapshots)
	require.Equal(t, 3, res.Deliveries, "the done, dead and stopped deliveries of sessions 4 and 5")
	require.Zero(t, deliveriesOf(t1, 3))
	require.Zero(t, deliveriesOf(t1, 4))
	require.Equal(t, 1, deliveriesOf(t1, 2), "the pending delivery keeps its row and itself")
	require.Equal(t, 1, deliveriesOf(t2, 0), "an unexpired row's delivery stays")
	require.False(t, res.Full)
	require.Nil(t, res.OldestDue, "what is left expired is kept on purpose")
	require.Equal(t, []string{`{"id": 2}`, `{"id": 3}`},
		keysOf(t, c, `SELECT key::text FROM archive_v1.rows WHERE table_name = 'sessions' ORDER BY key`))
	require.Equal(t, []string{`{"id": 2}`, `{"id": 3}`},
		keysOf(t, c, `SELECT root_key::text FROM archive_v1.snapshots ORDER BY root_key`))
	require.Equal(t, 3, count(t, c, `SELECT count(*) FROM archive.rows`), "unexpired rows untouched")
	require.Equal(t, 0, count(t, c, `SELECT count(*) FROM archive.rows WHERE table_name = 'sessions'`), "kept rows stay hidden")

	// Released: the next batch deletes them, and the group with them.
	hs, err := erasure.ListLegalHolds(ctx, pool)
	require.NoError(t, err)
	require.Len(t, hs, 1)
	ok, err := erasure.RemoveLegalHold(ctx, pool, hs[0].ID)
	require.NoError(t, err)
	require.True(t, ok)
	_, err = c.Exec(ctx, `UPDATE epitaph.deliveries SET state = 'done'`)
	require.NoError(t, err)
	// Another version (retired, its own copy of sessions 2 and 3, expiring
	// later) still holds the rows: their deliveries stay with it.
	_, err = c.Exec(ctx, `CREATE SCHEMA archive_v2;
		CREATE TABLE archive_v2.rows (LIKE archive_v1.rows INCLUDING ALL);
		INSERT INTO archive_v2.rows SELECT * FROM archive_v1.rows WHERE table_name = 'sessions';
		UPDATE archive_v2.rows SET expires_at = now() + interval '1 day';
		INSERT INTO epitaph.projection_versions (projection, version, state, schema_name) VALUES ('archive', 2, 'retired', 'archive_v2')`)
	require.NoError(t, err)
	res, err = retention.CleanupBatch(ctx, pool, retention.CleanupOptions{})
	require.NoError(t, err)
	require.Equal(t, 2, res.Deleted)
	require.Equal(t, map[string]int{"archive_v1": 2}, res.ByVersion)
	require.Zero(t, res.Deliveries, "archive_v2 holds the rows")
	require.Equal(t, 1, deliveriesOf(t1, 2))
	_, err = c.Exec(ctx, `UPDATE archive_v2.rows SET expires_at = now() - interval '1 second'`)
	require.NoError(t, err)
	res, err = retention.CleanupBatch(ctx, pool, retention.CleanupOptions{})
	require.NoError(t, err)
	require.Equal(t, map[string]int{"archive_v2": 2}, res.ByVersion)
	require.Equal(t, 1, res.Deliveries, "the last version's copy is gone: so is the delivery")
	require.Zero(t, deliveriesOf(t1, 2))
	require.Equal(t, 1, deliveriesOf(t2, 0))
	require.Equal(t, 0, count(t, c, `SELECT count(*) FROM archive_v1.rows WHERE table_name = 'sessions'`))
	require.Equal(t, 0, count(t, c, `SELECT count(*) FROM archive_v1.snapshots`))
	require.Equal(t, 0, count(t, c, `SELECT count(*) FROM archive_v1.snapshot_groups WHERE commit_lsn = $1::pg_lsn`, t1.lsn.String()))
	require.Equal(t, 3, count(t, c, `SELECT count(*) FROM archive_v1.rows`))
}

// A batch never deletes more than its bound: 100,000 expired rows take
// ceil(100,000 / batch) batches of one statement each, and the service's
// cleaner deletes all of them while the projector keeps applying.
func TestRetentionBatchBound(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	cfg := retentionConfig(e, "w1")
	s := e.start(cfg)
	c := e.conn()
	ctx := context.Background()
	// 100,000 expired rows, written straight into the version table.
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive_v1.rows`) == 0 })
	_, err := c.Exec(ctx, `INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row, correlation_id, commit_lsn, seq, expires_at)
		SELECT 'old', 'public', 'sessions', jsonb_build_object('id', i), jsonb_build_object('id', i), 'old:1:0/1', '0/1'::pg_lsn, i,
		       now() - interval '1 day' + i * interval '1 ms'
		FROM generate_series(1, 100000) i`)
	require.NoError(t, err)
	pool := newPool(t, e.url)
	const bound = 30000
	batches := 0
	for {
		res, err := retention.CleanupBatch(ctx, pool, retention.CleanupOptions{Batch: bound})
		require.NoError(t, err)
		require.LessOrEqual(t, res.Deleted, bound)
		require.Equal(t, 1, res.Statements)
		if res.Deleted == 0 {
			break
		}
		batches++
		left := count(t, c, `SELECT count(*) FROM archive_v1.rows WHERE source = 'old'`)
		require.Equal(t, max(0, 100000-batches*bound), left, "oldest first, exactly the bound per batch")
	}
	require.Equal(t, 4, batches)

	// The service's cleaner, while applying: nothing unexpired is lost.
	_, err = c.Exec(ctx, `INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row, correlation_id, commit_lsn, seq, expires_at)
		SELECT 'old', 'public', 'sessions', jsonb_build_object('id', i), jsonb_build_object('id', i), 'old:1:0/1', '0/1'::pg_lsn, i,
		       now() - interval '1 day'
		FROM generate_series(1, 20000) i`)
	require.NoError(t, err)
	require.NoError(t, s.Stop(ctx))
	cfg = retentionConfig(e, "w2")
	cfg.CleanupInterval, cfg.CleanupBatch = 50*time.Millisecond, 1000
	s2 := e.start(cfg)
	var want []string
	for i := 0; i < 40; i++ {
		tx := e.nextTx(orderRows(100+i, 2)...)
		e.publish(tx)
		want = append(want, fmt.Sprintf("%d", 100+i))
	}
	eventually(t, 60*time.Second, func() bool {
		return count(t, c, `SELECT count(*) FROM archive_v1.rows WHERE source = 'old'`) == 0 &&
			count(t, c, `SELECT count(*) FROM archive.rows WHERE table_name = 'orders'`) == 40
	})
	require.Equal(t, want, keysOf(t, c, `SELECT key->>'id' FROM archive.rows WHERE table_name = 'orders' ORDER BY key->>'id'`))
	require.Equal(t, 80, count(t, c, `SELECT count(*) FROM archive.rows WHERE table_name = 'order_lines'`))
	// Counted once the batch has returned (after its commit).
	eventually(t, 10*time.Second, func() bool { return metricSum(t, s2, "epitaph_projector_rows_expired_total") == 20000 })
}

// erasureEnv: a customer with two orders (and lines) deleted in one
// transaction, another customer's order, on two versions.
func customerTx(e *env, customer int, email string, orders ...int) *txn {
	rows := []row{{schema: "public", table: "customers", key: fmt.Sprintf(`{"id":%d}`, customer),
		image: fmt.Sprintf(`{"id":%d,"email":%q}`, customer, email)}}
	for _, o := range orders {
		for _, r := range orderRows(o, 2) {
			if r.table == "orders" {
				r.image = fmt.Sprintf(`{"id":%d,"customer_id":%d,"note":"for %s"}`, o, customer, email)
			}
			rows = append(rows, r)
		}
	}
	return e.nextTx(rows...)
}

// Erasing a customer with children removes them from every version, the
// receipt and the whole epitaph schema hold no erased value, the fence keeps
// them out of a rebuild and out of later events, and every other row stays.
func TestEraseWithChildren(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	cfg := retentionConfig(e, "w1")
	cfg.SnapshotRoots = []string{"public.customers", "public.orders"}
	s := e.start(cfg)
	cfg2 := retentionConfig(e, "w2")
	cfg2.SnapshotRoots = cfg.SnapshotRoots
	e.start(cfg2)
	ann := customerTx(e, 42, "ann@example.com", 1, 2)
	bob := customerTx(e, 43, "bob@example.com", 3)
	e.publish(ann)
	e.publish(bob)
	c := e.conn()
	ctx := context.Background()
	eventually(t, 30*time.Second, func() bool {
		return count(t, c, `SELECT count(*) FROM archive.rows`) == 7+4 &&
			count(t, c, `SELECT count(*) FROM archive.snapshots WHERE status = 'complete'`) == 5
	})
	// A quarantined event of Ann (as an apply would record it) and a
	// pending delivery of her order.
	msg := e.messages(ann)[0]
	_, err := c.Exec(ctx, `INSERT INTO epitaph.quarantine (projection, version, partition, stream_seq, subject, data, category, error,
		source_schema, source_table, source_key) VALUES ('archive', 1, 0, 999999, $1, $2, 'incompatible', 'x', 'public', 'customers', '{"id":42}')`,
		msg.Subject, msg.Data)
	require.NoError(t, err)
	_, err = c.Exec(ctx, `INSERT INTO epitaph.deliveries (id, handler_id, source, commit_lsn, seq, schema_name, table_name,
		key, correlation_id, version, state, payload) VALUES (gen_random_uuid(), gen_random_uuid(), $1, $2::pg_lsn, 1, 'public', 'orders',
		'{"id":1}', 'x', 1, 'pending', '{"note":"for ann@example.com"}')`, src, ann.lsn.String())
	require.NoError(t, err)

	// Deletes keep flowing while Ann is erased, and until the end.
	stopTraffic := e.traffic(ctx, 20*time.Millisecond)
	defer stopTraffic()
	pool := newPool(t, e.url)
	rc, err := erasure.Erase(ctx, pool, erasure.EraseOptions{Table: "public.customers",
		Match: json.RawMessage(`{"email":"ann@example.com"}`), WithChildren: true, Reason: "GDPR art. 17 request 12", Actor: "dpo"})
	require.NoError(t, err)
	require.Equal(t, 7, rc.Removed["archive_v1.rows"])
	require.Equal(t, 3, rc.Removed["archive_v1.snapshots"], "the customer's and both orders' documents")
	require.Equal(t, 1, rc.Removed["epitaph.deliveries"])
	require.Equal(t, 1, rc.Removed["epitaph.quarantine"])
	require.Equal(t, []string{"email"}, rc.Columns)

	// Bob is untouched, row by row (the traffic's ids are from 100000 on).
	require.Equal(t, []string{"customers:43", "order_lines:3000", "order_lines:3001", "orders:3"},
		keysOf(t, c, `SELECT table_name || ':' || (key->>'id') FROM archive_v1.rows WHERE (key->>'id')::bigint < 100000 ORDER BY 1`))
	require.Equal(t, []string{"public.customers", "public.orders"},
		keysOf(t, c, `SELECT root_table FROM archive_v1.snapshots WHERE commit_lsn = $1::pg_lsn ORDER BY 1`, bob.lsn.String()))
	require.Equal(t, 1, count(t, c, `SELECT count(*) FROM epitaph.deliveries WHERE state = 'stopped' AND outcome = 'stop_revoked' AND payload IS NULL AND key IS NULL`))
	require.Equal(t, 1, count(t, c, `SELECT count(*) FROM epitaph.quarantine WHERE length(data) = 0 AND status = 'discarded'`))

	// Idempotent: a second run removes nothing and counts a run.
	rc2, err := erasure.Erase(ctx, pool, erasure.EraseOptions{Table: "public.customers",
		Match: json.RawMessage(`{"email": "ann@example.com"}`), WithChildren: true, Actor: "dpo"})
	require.NoError(t, err)
	require.Equal(t, rc.ID, rc2.ID)
	require.Equal(t, 2, rc2.Runs)
	require.Equal(t, rc.Removed, rc2.Removed)

	// The stream still has Ann's events: a rebuild and a re-published copy
	// of her transaction (a replay) archive none of them.
	e.publish(ann)
	v2, err := version.CreateVersion(ctx, s.Pool(), e.js, version.RebuildOptions{Projection: archive.Projection})
	require.NoError(t, err)
	later := customerTx(e, 42, "ann@example.com", 9) // Ann deleted again later: fenced too
	e.publish(later)
	e.publish(customerTx(e, 44, "cy@example.com", 5))
	traffic := stopTraffic()
	require.Positive(t, traffic)
	eventually(t, 60*time.Second, func() bool {
		return count(t, c, fmt.Sprintf(`SELECT count(*) FROM %s.rows`, v2.Schema)) == 4+4+traffic &&
			count(t, c, `SELECT count(*) FROM archive_v1.rows`) == 4+4+traffic
	}, "every row of both versions but Ann's")
	// Every other row as the oracle says, in both versions, the same.
	for _, schema := range []string{"archive_v1", v2.Schema} {
		require.Equal(t, []string{"customers:43", "customers:44", "order_lines:3000", "order_lines:3001", "order_lines:5000", "order_lines:5001", "orders:3", "orders:5"},
			keysOf(t, c, fmt.Sprintf(`SELECT table_name || ':' || (key->>'id') FROM %s.rows WHERE (key->>'id')::bigint < 100000 ORDER BY 1`, schema)), schema)
		require.Equal(t, traffic/3, count(t, c, fmt.Sprintf(`SELECT count(*) FROM %s.rows WHERE table_name = 'orders' AND (key->>'id')::bigint >= 100000
			AND row = jsonb_build_object('id', (key->>'id')::bigint, 'customer_id', 7, 'total', '12.50')`, schema)), schema)
		require.Equal(t, traffic*2/3, count(t, c, fmt.Sprintf(`SELECT count(*) FROM %s.rows WHERE table_name = 'order_lines' AND (key->>'id')::bigint >= 100000000
			AND row = jsonb_build_object('id', (key->>'id')::bigint, 'order_id', (key->>'id')::bigint / 1000, 'qty', (key->>'id')::bigint %% 1000 + 1)`, schema)), schema)
	}
	require.Equal(t, 0, count(t, c, fmt.Sprintf(`SELECT count(*) FROM (
		(SELECT source, commit_lsn, seq, table_name, key, row, is_root FROM archive_v1.rows EXCEPT SELECT source, commit_lsn, seq, table_name, key, row, is_root FROM %[1]s.rows)
		UNION ALL
		(SELECT source, commit_lsn, seq, table_name, key, row, is_root FROM %[1]s.rows EXCEPT SELECT source, commit_lsn, seq, table_name, key, row, is_root FROM archive_v1.rows)) d`, v2.Schema)))
	_, err = version.Promote(ctx, s.Pool(), archive.Projection, v2.Version, true)
	require.NoError(t, err)
	require.Equal(t, 0, count(t, c, `SELECT count(*) FROM archive.rows WHERE row::text LIKE '%ann@example.com%'`))

	// Nothing in the epitaph schema or any archive holds the erased value.
	requireNowhere(t, c, "ann@example.com")
	list, err := erasure.ListErasures(ctx, pool)
	require.NoError(t, err)
	b, err := json.Marshal(list)
	require.NoError(t, err)
	require.NotContains(t, string(b), "ann@example.com")
}

// requireNowhere greps every table of the epitaph and archive schemas.
func requireNowhere(t *testing.T, c *pgx.Conn, value string) {
	t.Helper()
	tables := keysOf(t, c, `SELECT quote_ident(n.nspname) || '.' || quote_ident(c.relname) FROM pg_class c
		JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.relkind = 'r' AND (n.nspname = 'epitaph' OR n.nspname LIKE 'archive%')`)
	require.NotEmpty(t, tables)
	for _, tbl := range tables {
		n := count(t, c, `SELECT count(*) FROM `+tbl+` x WHERE strpos(x::text, $1) > 0`, value)
		require.Equal(t, 0, n, "%s holds %q", tbl, value)
		if strings.HasSuffix(tbl, ".quarantine") {
			require.Equal(t, 0, count(t, c, `SELECT count(*) FROM epitaph.quarantine WHERE strpos(convert_from(data, 'UTF8'), $1) > 0`, value))
		}
	}
}

// An erasure racing applies of the same key ends with the row erased,
// whichever commits first.
func TestEraseConcurrentWithApply(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	cfg := retentionConfig(e, "w1")
	cfg.BatchSize = 3
	e.start(cfg)
	c := e.conn()
	ctx := context.Background()
	pool := newPool(t, e.url)
	for round := 0; round < 5; round++ {
		var txs []*txn
		for i := 0; i < 30; i++ {
			txs = append(txs, e.nextTx(row{schema: "public", table: "users", key: fmt.Sprintf(`{"id":%d}`, round),
				image: fmt.Sprintf(`{"id":%d,"n":%d}`, round, i)}))
		}
		var wg sync.WaitGroup
		wg.Add(1)
		go func() {
			defer wg.Done()
			for _, tx := range txs {
				e.publish(tx)
			}
		}()
		eventually(t, 20*time.Second, func() bool {
			return count(t, c, `SELECT count(*) FROM archive_v1.rows WHERE key = $1::jsonb`, fmt.Sprintf(`{"id":%d}`, round)) > 0
		})
		_, err := erasure.Erase(ctx, pool, erasure.EraseOptions{Table: "public.users",
			Key: json.RawMessage(fmt.Sprintf(`{"id":%d}`, round)), Actor: "t"})
		require.NoError(t, err)
		wg.Wait()
		last := txs[len(txs)-1]
		marker := e.nextTx(row{schema: "public", table: "markers", key: fmt.Sprintf(`{"id":%d}`, round), image: `{}`})
		e.publish(marker)
		eventually(t, 30*time.Second, func() bool {
			return count(t, c, `SELECT count(*) FROM archive_v1.rows WHERE table_name = 'markers' AND key = $1::jsonb`,
				fmt.Sprintf(`{"id":%d}`, round)) == 1
		}, "applied past", last.lsn)
		require.Equal(t, 0, count(t, c, `SELECT count(*) FROM archive_v1.rows WHERE table_name = 'users'`), "round %d", round)
	}
}

// --purge-stream deletes the erased rows' messages and objects from the
// stream (read back: gone), leaves every other message, and is refused
// with ErrStreamDeniesDeletes by a stream that denies deletes.
func TestErasePurgeStream(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	ctx := context.Background()
	obs, err := e.js.CreateObjectStore(ctx, jetstream.ObjectStoreConfig{Bucket: event.RowBucket("main")})
	require.NoError(t, err)
	e.start(retentionConfig(e, "w1"))
	ann := customerTx(e, 42, "ann@example.com", 1)
	msgs := e.messages(ann)
	// The order's row is large: in the object store.
	order := []byte(`{"id":1,"customer_id":42,"note":"for ann@example.com"}`)
	refRow(t, msgs[1], storeRow(t, obs, "ann-order", order))
	for _, m := range msgs {
		_, err := e.pubMsg(ctx, m)
		require.NoError(t, err)
	}
	bob := customerTx(e, 43, "bob@example.com", 3)
	e.publish(bob)
	c := e.conn()
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 8 })
	pool := newPool(t, e.url)
	require.NoError(t, erasure.CheckPurge(ctx, e.js, src))
	rc, err := erasure.Erase(ctx, pool, erasure.EraseOptions{Table: "public.customers", Key: json.RawMessage(`{"id":42}`),
		WithChildren: true, Actor: "dpo", PurgeStream: true})
	require.NoError(t, err)
	require.Equal(t, 4, rc.Removed["archive_v1.rows"])
	rc, err = erasure.PurgeStream(ctx, pool, e.js, src, rc.ID)
	require.NoError(t, err)
	require.Equal(t, 4, rc.Removed["stream:"+event.StreamName(src)])
	require.Equal(t, 1, rc.Removed["objects"])
	_, err = obs.GetInfo(ctx, "ann-order")
	require.ErrorIs(t, err, jetstream.ErrObjectNotFound)
	// What is left in the stream: Ann's commit (counts only) and Bob.
	stream, err := e.js.Stream(ctx, event.StreamName(src))
	require.NoError(t, err)
	var left []string
	for seq := uint64(1); seq <= stream.CachedInfo().State.LastSeq; seq++ {
		m, err := stream.GetMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		require.NoError(t, err)
		require.NotContains(t, string(m.Data), "ann@example.com")
		left = append(left, m.Subject)
	}
	require.Len(t, left, 1+5, "Ann's commit, Bob's four rows and commit")
	// Idempotent.
	rc2, err := erasure.PurgeStream(ctx, pool, e.js, src, rc.ID)
	require.NoError(t, err)
	require.Equal(t, rc.Removed, rc2.Removed)

	// A stream that denies deletes: refused before anything is recorded.
	cfg := stream.CachedInfo().Config
	cfg.DenyDelete = true
	_, err = e.js.UpdateStream(ctx, cfg)
	require.NoError(t, err)
	require.ErrorIs(t, erasure.CheckStreamDeletes(ctx, e.js, src), erasure.ErrStreamDeniesDeletes)
	require.ErrorIs(t, erasure.CheckPurge(ctx, e.js, src), erasure.ErrStreamDeniesDeletes)
	_, err = erasure.PurgeStream(ctx, pool, e.js, src, rc.ID)
	require.ErrorIs(t, err, erasure.ErrStreamDeniesDeletes)
}
