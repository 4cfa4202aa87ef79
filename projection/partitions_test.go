package projection_test

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/erasure"
	"github.com/epitaph-dev/epitaph/projection/version"
	"github.com/epitaph-dev/epitaph/restore"
)

// legacyArchiveDDL is archive v1 as an earlier release left it: one
// unpartitioned rows table keyed (source, commit_lsn, seq).
const legacyArchiveDDL = `CREATE SCHEMA archive_v1;
CREATE TABLE archive_v1.rows (source text NOT NULL, schema_name text NOT NULL, table_name text NOT NULL, key jsonb, row jsonb,
    identity text, correlation_id text NOT NULL, is_root boolean, xid bigint, commit_lsn pg_lsn NOT NULL, commit_time timestamptz,
    seq integer NOT NULL, archived_at timestamptz NOT NULL DEFAULT now(), expires_at timestamptz, refs jsonb, columns jsonb,
    PRIMARY KEY (source, commit_lsn, seq));
CREATE INDEX rows_expires_at_idx ON archive_v1.rows (expires_at) WHERE expires_at IS NOT NULL;
INSERT INTO epitaph.projection_versions (projection, version, state, schema_name, partitions, boundary_seq, live_at)
VALUES ('archive', 1, 'live', 'archive_v1', 2, 0, now());`

// An archive left unpartitioned by an earlier release keeps applying;
// "rebuild archive" makes a partitioned version of it (weekly here), every
// row in the partition of its commit week, the current and next weeks made
// ahead; it is promoted, rolled back and promoted again with the same
// rows served throughout, and both keep applying.
func TestPartitionedArchiveRebuildPromoteRollback(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	ctx := context.Background()
	pool := e.pool()
	require.NoError(t, migrations.Apply(ctx, pool))
	_, err := pool.Exec(ctx, legacyArchiveDDL)
	require.NoError(t, err)
	e.start(e.config("w1"))

	times := []time.Time{time.Date(2026, 9, 2, 10, 0, 0, 0, time.UTC), time.Date(2026, 10, 15, 10, 0, 0, 0, time.UTC),
		time.Date(2026, 10, 16, 10, 0, 0, 0, time.UTC), time.Date(2026, 11, 30, 23, 59, 0, 0, time.UTC)}
	for i, at := range times {
		tx := e.nextTx(orderRows(i+1, 2)...)
		tx.time = at
		e.publish(tx)
	}
	e.heartbeat()
	c := e.conn()
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 12 })
	require.Zero(t, count(t, c, `SELECT count(*) FROM pg_inherits WHERE inhparent = 'archive_v1.rows'::regclass`),
		"the earlier release's table stays as it is")

	v2, err := version.CreateVersion(ctx, pool, e.js, version.RebuildOptions{Source: src, Period: archive.PeriodWeek})
	require.NoError(t, err)
	require.Equal(t, archive.PeriodWeek, v2.Period)
	v2, err = version.GetVersion(ctx, pool, archive.Projection, 2)
	require.NoError(t, err)
	require.Equal(t, archive.PeriodWeek, v2.Period, "stored with the version")
	eventually(t, 60*time.Second, func() bool { return state(t, pool, 2) == version.StateReady })
	require.Equal(t, 12, count(t, c, `SELECT count(*) FROM archive_v2.rows`))
	// Every row in its week's partition (weeks from Monday, UTC).
	require.Equal(t, 12, count(t, c, `SELECT count(*) FROM archive_v2.rows
		WHERE tableoid::regclass::text = 'archive_v2.rows_p' || to_char(date_trunc('week', commit_time AT TIME ZONE 'UTC'), 'YYYYMMDD')`))
	for _, want := range []string{"rows_p20260831", "rows_p20261012", "rows_p20261130", archive.DefaultPartition,
		archive.PartitionName(archive.PeriodStart(archive.PeriodWeek, time.Now())),
		archive.PartitionName(archive.PeriodStart(archive.PeriodWeek, time.Now()).AddDate(0, 0, 7))} {
		require.Equal(t, 1, count(t, c, `SELECT count(*) FROM pg_inherits WHERE inhparent = 'archive_v2.rows'::regclass
			AND inhrelid = to_regclass('archive_v2.' || $1)`, want), want)
	}
	require.Zero(t, count(t, c, `SELECT count(*) FROM archive_v2.rows_default`))

	same := func() {
		t.Helper()
		require.Zero(t, count(t, c, `SELECT count(*) FROM (
			(SELECT commit_lsn, seq, row FROM archive_v1.rows EXCEPT SELECT commit_lsn, seq, row FROM archive.rows)
			UNION ALL
			(SELECT commit_lsn, seq, row FROM archive.rows EXCEPT SELECT commit_lsn, seq, row FROM archive_v1.rows)) d`))
	}
	_, err = version.Promote(ctx, pool, archive.Projection, 2, false)
	require.NoError(t, err)
	require.Contains(t, viewTarget(t, c), "archive_v2.rows")
	same()
	from, to, err := version.Rollback(ctx, pool, archive.Projection, false)
	require.NoError(t, err)
	require.Equal(t, [2]int{2, 1}, [2]int{from, to})
	require.Contains(t, viewTarget(t, c), "archive_v1.rows")
	same()
	_, err = version.Promote(ctx, pool, archive.Projection, 2, false)
	require.NoError(t, err)

	// Both keep applying; a late row, older than every partition, gets its
	// week's partition made before its apply.
	late := e.nextTx(orderRows(50, 1)...)
	late.time = time.Date(2025, 1, 8, 0, 0, 0, 0, time.UTC)
	e.publish(late)
	eventually(t, 20*time.Second, func() bool {
		return count(t, c, `SELECT count(*) FROM archive_v1.rows`) == 14 && count(t, c, `SELECT count(*) FROM archive.rows`) == 14
	})
	// Made before the apply, or (a failed attempt: a lock held a moment
	// too long on a busy machine) on a later page.
	lateRows := fmt.Sprintf(`SELECT count(*) FROM archive_v2.%s`, archive.PartitionName(archive.PeriodStart(archive.PeriodWeek, late.time)))
	eventually(t, 20*time.Second, func() bool { e.heartbeat(); return count(t, c, lateRows) == 2 })
	same()
}

// An erasure finds and removes its rows in every partition (a customer
// deleted in September and again in October), and leaves the others'
// rows where they are.
func TestEraseAcrossPartitions(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	e.start(retentionConfig(e, "w1"))
	sep := customerTx(e, 42, "ann@example.com", 1)
	sep.time = time.Date(2026, 9, 3, 8, 0, 0, 0, time.UTC)
	oct := customerTx(e, 42, "ann@example.com")
	oct.time = time.Date(2026, 10, 3, 8, 0, 0, 0, time.UTC)
	bob := customerTx(e, 43, "bob@example.com", 3)
	bob.time = oct.time.Add(time.Minute)
	for _, tx := range []*txn{sep, oct, bob} {
		e.publish(tx)
	}
	e.heartbeat()
	c := e.conn()
	ctx := context.Background()
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 4+1+4 })
	where := `SELECT tableoid::regclass::text || ':' || table_name || ':' || (key->>'id') FROM archive_v1.rows ORDER BY 1`
	require.Equal(t, []string{
		"archive_v1.rows_p20260901:customers:42", "archive_v1.rows_p20260901:order_lines:1000", "archive_v1.rows_p20260901:order_lines:1001",
		"archive_v1.rows_p20260901:orders:1",
		"archive_v1.rows_p20261001:customers:42", "archive_v1.rows_p20261001:customers:43", "archive_v1.rows_p20261001:order_lines:3000",
		"archive_v1.rows_p20261001:order_lines:3001", "archive_v1.rows_p20261001:orders:3",
	}, keysOf(t, c, where))

	rc, err := erasure.Erase(ctx, newPool(t, e.url), erasure.EraseOptions{Table: "public.customers",
		Match: json.RawMessage(`{"email":"ann@example.com"}`), WithChildren: true, Reason: "request 9", Actor: "dpo"})
	require.NoError(t, err)
	require.Equal(t, 4+1, rc.Removed["archive_v1.rows"])
	require.Equal(t, []string{
		"archive_v1.rows_p20261001:customers:43", "archive_v1.rows_p20261001:order_lines:3000",
		"archive_v1.rows_p20261001:order_lines:3001", "archive_v1.rows_p20261001:orders:3",
	}, keysOf(t, c, where))
}

// Rows archived in three months, so three partitions, are restored from
// two of them into the source, each restored row equal to its archived
// image; an erasure then removes one customer's rows from the first and
// the last month and leaves the other's, and an erased transaction can no
// longer be restored.
func TestRestoreAndEraseAcrossPartitions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srcURL := testenv.NewDatabase(t)
	testenv.Exec(t, srcURL, `CREATE TABLE public.customers (id bigint PRIMARY KEY, email text NOT NULL);
		CREATE TABLE public.orders (id bigint PRIMARY KEY, customer_id bigint NOT NULL REFERENCES public.customers, note text)`)
	source, err := pgx.Connect(ctx, testenv.NoSearchPath(srcURL))
	require.NoError(t, err)
	t.Cleanup(func() { _ = source.Close(context.Background()) })
	e := newEnv(t, 2)
	e.start(retentionConfig(e, "w1"))

	// A customer and one order, deleted in one transaction at "at".
	customerCols := []event.Column{{Name: "id", Type: "bigint", PK: true}, {Name: "email", Type: "text"}}
	orderCols := []event.Column{{Name: "id", Type: "bigint", PK: true}, {Name: "customer_id", Type: "bigint"}, {Name: "note", Type: "text"}}
	deleted := func(customer int, email string, order int, at time.Time) *txn {
		tx := e.nextTx(
			row{schema: "public", table: "customers", key: fmt.Sprintf(`{"id":%d}`, customer),
				image: fmt.Sprintf(`{"id":%d,"email":%q}`, customer, email), columns: customerCols},
			row{schema: "public", table: "orders", key: fmt.Sprintf(`{"id":%d}`, order),
				image:   fmt.Sprintf(`{"id":%d,"customer_id":%d,"note":"order %d of %s"}`, order, customer, order, email),
				columns: orderCols,
				refs:    []event.Ref{{Columns: []string{"customer_id"}, Schema: "public", Table: "customers", RefColumns: []string{"id"}}}})
		tx.time = at
		return tx
	}
	sep := deleted(42, "ann@example.com", 1, time.Date(2026, 9, 3, 8, 0, 0, 0, time.UTC))
	oct := deleted(43, "bob@example.com", 3, time.Date(2026, 10, 3, 8, 0, 0, 0, time.UTC))
	nov := deleted(42, "ann@example.com", 5, time.Date(2026, 11, 3, 8, 0, 0, 0, time.UTC))
	for _, tx := range []*txn{sep, oct, nov} {
		e.publish(tx)
	}
	e.heartbeat()
	c := e.conn()
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 6 })
	where := `SELECT tableoid::regclass::text || ':' || table_name || ':' || (key->>'id') FROM archive_v1.rows ORDER BY 1`
	require.Equal(t, []string{
		"archive_v1.rows_p20260901:customers:42", "archive_v1.rows_p20260901:orders:1",
		"archive_v1.rows_p20261001:customers:43", "archive_v1.rows_p20261001:orders:3",
		"archive_v1.rows_p20261101:customers:42", "archive_v1.rows_p20261101:orders:5",
	}, keysOf(t, c, where))
	corr := func(tx *txn) string {
		t.Helper()
		var id string
		require.NoError(t, c.QueryRow(ctx, `SELECT DISTINCT correlation_id FROM archive.rows WHERE xid = $1`, tx.xid).Scan(&id))
		return id
	}

	target := newPool(t, e.url)
	for _, tx := range []*txn{sep, oct} {
		res, err := restore.Run(ctx, target, source, restore.Config{Source: src, CorrelationID: corr(tx), Actor: "dpo"})
		require.NoError(t, err)
		require.Equal(t, restore.OutcomeRestored, res.Outcome)
		require.Equal(t, 2, res.Restored, "the customer and its order of %s", tx.time.Format(time.DateOnly))
	}
	// Row by row: the source now holds exactly the archived images of
	// September's and October's rows.
	rows, err := source.Query(ctx, `SELECT 'customers ' || to_jsonb(c)::text FROM public.customers c
		UNION ALL SELECT 'orders ' || to_jsonb(o)::text FROM public.orders o ORDER BY 1`)
	require.NoError(t, err)
	inSource, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, keysOf(t, c, `SELECT table_name || ' ' || row::text FROM archive.rows WHERE correlation_id = ANY($1) ORDER BY 1`,
		[]string{corr(sep), corr(oct)}), inSource)
	require.Equal(t, []string{
		`customers {"id": 42, "email": "ann@example.com"}`, `customers {"id": 43, "email": "bob@example.com"}`,
		`orders {"id": 1, "note": "order 1 of ann@example.com", "customer_id": 42}`,
		`orders {"id": 3, "note": "order 3 of bob@example.com", "customer_id": 43}`,
	}, inSource)

	sepCorr := corr(sep)
	rc, err := erasure.Erase(ctx, target, erasure.EraseOptions{Table: "public.customers",
		Match: json.RawMessage(`{"email":"ann@example.com"}`), WithChildren: true, Reason: "request 12", Actor: "dpo"})
	require.NoError(t, err)
	require.Equal(t, 4, rc.Removed["archive_v1.rows"], "ann and her orders, in September and November")
	require.Equal(t, []string{"archive_v1.rows_p20261001:customers:43", "archive_v1.rows_p20261001:orders:3"}, keysOf(t, c, where))
	_, err = restore.Run(ctx, target, source, restore.Config{Source: src, CorrelationID: sepCorr, Actor: "dpo", OnConflict: restore.OnConflictSkip})
	var cannot *restore.CannotError
	require.ErrorAs(t, err, &cannot, "an erased transaction is not restored")
	require.Contains(t, err.Error(), "no archived rows of "+sepCorr+" match")
}

// strandInDefault archives one order (so the current periods have their
// partitions), then, while a reader holds archive_v1.rows so no partition
// can be made, one dated 29 February 2024: it waits until both orders are
// archived and returns the held reader's transaction and the late one.
func strandInDefault(t *testing.T, e *env, c *pgx.Conn) (pgx.Tx, *txn) {
	t.Helper()
	ctx := context.Background()
	e.publish(e.nextTx(orderRows(1, 1)...))
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 2 })
	tx, err := e.conn().Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(ctx) })
	_, err = tx.Exec(ctx, `LOCK TABLE archive_v1.rows IN ACCESS SHARE MODE`)
	require.NoError(t, err)
	old := e.nextTx(orderRows(2, 1)...)
	old.time = time.Date(2024, 2, 29, 12, 0, 0, 0, time.UTC)
	e.publish(old)
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 4 })
	return tx, old
}

// movedOutOfDefault waits, with a heartbeat page each time, for the late
// order's rows to be in their own partition, and checks the default
// partition is empty.
func movedOutOfDefault(t *testing.T, e *env, c *pgx.Conn, msg string) {
	t.Helper()
	eventually(t, 20*time.Second, func() bool {
		e.heartbeat()
		return count(t, c, `SELECT count(*) FROM archive_v1.rows_p20240201`) == 2
	}, msg)
	require.Zero(t, count(t, c, `SELECT count(*) FROM archive_v1.rows_default`))
	require.Equal(t, 4, count(t, c, `SELECT count(*) FROM archive.rows`))
}

// A partition that cannot be made (a reader holds the rows table) never
// holds up or fails the apply: the rows go to the default partition, and
// move to their own when it is made on a later page.
func TestApplyDoesNotWaitForAPartition(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	e.start(e.config("w1"))
	c := e.conn()
	tx, old := strandInDefault(t, e, c)
	require.Equal(t, []string{"archive_v1.rows_default", "archive_v1.rows_default"},
		keysOf(t, c, `SELECT tableoid::regclass::text FROM archive_v1.rows WHERE commit_lsn = $1::pg_lsn`, old.lsn.String()))
	require.Zero(t, count(t, c, `SELECT count(*) FROM pg_class WHERE relname = 'rows_p20240201'`))

	// The reader goes; the period is owed, so a later page with no row of
	// it (a heartbeat) makes its partition, once the backoff is over, and
	// its rows move out of the default.
	require.NoError(t, tx.Rollback(context.Background()))
	movedOutOfDefault(t, e, c, "the late period's partition made on a later page")
}

// Rows a failed attempt left in the default partition are moved by a
// worker that never owed them: one started after the worker that failed
// stopped reads the default partition once and makes their periods.
func TestRowsLeftInTheDefaultMoveAfterARestart(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	first := e.start(e.config("w1"))
	c := e.conn()
	tx, _ := strandInDefault(t, e, c)
	require.Equal(t, 2, count(t, c, `SELECT count(*) FROM archive_v1.rows_default`))
	ctx := context.Background()
	require.NoError(t, first.Stop(ctx))
	require.NoError(t, tx.Rollback(ctx))

	e.start(e.config("w2"))
	movedOutOfDefault(t, e, c, "the stray period's partition made by the new worker")
}
