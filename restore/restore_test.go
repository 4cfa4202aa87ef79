package restore_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/restore"
)

// shopSchema: a customer with orders, order lines and shipments, deleted
// by cascade. customers and orders form a cycle (a customer's favorite
// order, deferrable); customers has an identity and a generated column.
const shopSchema = `
CREATE TYPE mood AS ENUM ('sad', 'happy');
CREATE TABLE customers (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name text NOT NULL,
    settings json, prefs jsonb, score double precision, photo bytea, tags text[], note text,
    name_upper text GENERATED ALWAYS AS (upper(name)) STORED,
    legacy text,
    favorite_order_id bigint);
CREATE TABLE orders (
    id bigint PRIMARY KEY,
    customer_id bigint NOT NULL REFERENCES customers ON DELETE CASCADE,
    total numeric(12,2), placed timestamptz, meta jsonb, m mood, during tstzrange);
ALTER TABLE customers ADD CONSTRAINT customers_favorite_fk FOREIGN KEY (favorite_order_id) REFERENCES orders
    DEFERRABLE INITIALLY IMMEDIATE;
CREATE TABLE lines (
    order_id bigint REFERENCES orders ON DELETE CASCADE, n integer, sku text, qty integer, price real,
    PRIMARY KEY (order_id, n));
CREATE TABLE shipments (
    id uuid PRIMARY KEY, order_id bigint NOT NULL REFERENCES orders ON DELETE CASCADE,
    tracking text, weights double precision[], at inet);
ALTER TABLE customers REPLICA IDENTITY FULL;
ALTER TABLE orders REPLICA IDENTITY FULL;
ALTER TABLE lines REPLICA IDENTITY FULL;
ALTER TABLE shipments REPLICA IDENTITY FULL;
`

// shopData inserts customers 42, 43 (kept) and 44 with their orders.
const shopData = `
INSERT INTO customers (id, name, settings, prefs, score, photo, tags, note, legacy) OVERRIDING SYSTEM VALUE VALUES
  (42, 'Ada', '{"b": 1,  "a": [1, 2], "b": 2}', '42', '-0', '\x00ff10', '{a,NULL,"b c"}', repeat('five megabytes ', 350000), 'old'),
  (43, 'Kept', 'null', 'null', 1.5, '', '{}', 'x', NULL),
  (44, 'Bob', '"s"', '"42"', 'NaN', NULL, NULL, NULL, 'older');
INSERT INTO orders VALUES
  (1, 42, 12.50, '2026-11-20 10:00:00.123456+00', 'null', 'happy', '[2026-11-20 10:00+00,2026-11-21 10:00+00)'),
  (2, 42, 9999999999.99, '2026-11-21 10:00+00', NULL, 'sad', 'empty'),
  (3, 43, 1, now(), '{}', NULL, NULL),
  (4, 44, -0.10, now(), '[1, "x", null]', NULL, NULL);
UPDATE customers SET favorite_order_id = 2 WHERE id = 42;
UPDATE customers SET favorite_order_id = 4 WHERE id = 44;
INSERT INTO lines VALUES (1, 1, 'sku-1', 2, '-0'), (1, 2, 'sku-2', 1, 'Infinity'), (2, 1, 'sku-3', 5, 1.1), (3, 1, 'k', 1, 1), (4, 1, 'b', 1, 2);
INSERT INTO shipments VALUES
  ('a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', 1, 'TRACK-1', '{-0,1.5,NULL}', '192.168.1.5/24'),
  ('b0eebc99-9c0b-4ef8-bb6d-6bb9bd380a12', 2, NULL, '{}', '::1'),
  ('c0eebc99-9c0b-4ef8-bb6d-6bb9bd380a13', 4, 'B', NULL, NULL);
`

// customerCols are the customer's columns that outlive the schema change
// of the test (legacy is dropped, vip added).
const customerCols = `id, name, settings, prefs, score, photo, tags, note, name_upper, favorite_order_id`

type shop struct {
	customer, orders, lines, shipments []string
}

func (e *env) shopOf(ids ...int64) shop {
	return shop{
		customer:  e.texts(`SELECT ROW(`+customerCols+`)::text FROM public.customers WHERE id = ANY($1) ORDER BY id`, ids),
		orders:    e.texts(`SELECT t::text FROM public.orders t WHERE customer_id = ANY($1) ORDER BY id`, ids),
		lines:     e.texts(`SELECT t::text FROM public.lines t JOIN public.orders o ON o.id = t.order_id WHERE o.customer_id = ANY($1) ORDER BY 1`, ids),
		shipments: e.texts(`SELECT t::text FROM public.shipments t JOIN public.orders o ON o.id = t.order_id WHERE o.customer_id = ANY($1) ORDER BY 1`, ids),
	}
}

func (s shop) rows() int { return len(s.customer) + len(s.orders) + len(s.lines) + len(s.shipments) }

// TestRestoreCustomerWithEverything: customer 42 and 44 deleted in one
// transaction with their orders, lines and shipments (cascade); the
// schema changes since (a column dropped, one added); a dry run plans and
// writes nothing; the restore of customer 42's snapshot subtree puts
// exactly those rows back equal by row::text (json text, jsonb scalars,
// float -0, NaN, bytea, arrays, a 5 MB text, the cycle through the
// deferrable favorite order, the identity column, the generated column
// recomputed), records who did it and stops the rows' pending deliveries;
// restoring again aborts naming the row, or skips.
func TestRestoreCustomerWithEverything(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := setup(t, shopSchema, "public.customers")
	e.exec(shopData)
	before := e.shopOf(42)
	require.Equal(t, 8, before.rows())
	require.Greater(t, len(before.customer[0]), 5_000_000, "a 5 MB text (beyond the broker's payload limit: an object)")
	bob := e.shopOf(44)
	kept := e.shopOf(43)

	corr := e.deleteArchived(`DELETE FROM public.customers WHERE id IN (42, 44)`, 8+bob.rows())
	require.Zero(t, e.shopOf(42, 44).rows())
	require.Eventually(t, func() bool {
		return e.count(`SELECT count(*) FROM archive.snapshots WHERE correlation_id = $1 AND status = 'complete'`, corr) == 2
	}, 120*time.Second, 50*time.Millisecond, "both customers' snapshots complete")

	// A pending delivery of one of customer 42's rows (as a handler would
	// have queued it), and one of customer 44's.
	for _, id := range []string{"00000000-0000-0000-0000-000000000001", "00000000-0000-0000-0000-000000000002"} {
		cust := map[string]string{"00000000-0000-0000-0000-000000000001": `{"id": 42}`, "00000000-0000-0000-0000-000000000002": `{"id": 44}`}[id]
		_, err := e.target.Exec(ctx, `INSERT INTO epitaph.deliveries (id, handler_id, source, commit_lsn, seq, schema_name, table_name, key,
			correlation_id, version, payload)
			SELECT $1, gen_random_uuid(), source, commit_lsn, seq, schema_name, table_name, key, correlation_id, 1, key
			FROM archive.rows WHERE correlation_id = $2 AND table_name = 'customers' AND key = $3::jsonb`, id, corr, cust)
		require.NoError(t, err)
	}

	e.exec(`ALTER TABLE customers DROP COLUMN legacy; ALTER TABLE customers ADD COLUMN vip boolean NOT NULL DEFAULT false`)

	cfg := restore.Config{Source: "main", CorrelationID: corr, RootKey: json.RawMessage(`{"id": 42}`), Actor: "alice", DryRun: true}
	plan, err := restore.Run(ctx, e.target, e.source, cfg)
	require.NoError(t, err)
	require.Equal(t, "planned", plan.Outcome)
	require.Equal(t, 8, plan.Rows)
	require.Equal(t, []string{"public.customers", "public.orders", "public.lines", "public.shipments"}, tableNames(plan))
	require.Equal(t, []int{1, 2, 3, 2}, tableRows(plan))
	require.Equal(t, []string{"legacy"}, plan.Tables[0].DroppedColumns)
	require.Equal(t, []string{"vip"}, plan.Tables[0].AddedColumns)
	require.Equal(t, []string{"name_upper"}, plan.Tables[0].GeneratedColumns)
	require.Equal(t, []string{"public.customers_favorite_fk"}, plan.Deferred, "the cycle's deferrable key")
	require.Empty(t, plan.Conflicts)
	require.Zero(t, e.shopOf(42, 44).rows(), "a dry run writes nothing")
	require.Zero(t, e.count(`SELECT count(*) FROM epitaph.restores`), "a dry run records nothing")

	// A webhook that batches without revalidation follows a cursor over
	// the archive: its pending deliveries of the orders have no rows.
	hook := handler.Def{ID: "0b6f5e43-3d0e-4c2b-9a51-6f7f2a8c1e90", Schema: "public", Table: "orders", Kind: handler.KindWebhook,
		Target: "http://127.0.0.1:1/hook", MaxAttempts: 5, Backoff: time.Second, ClaimTimeout: time.Minute,
		BatchSize: 10, BatchWait: 100 * time.Millisecond}
	require.True(t, hook.UsesCursor())
	require.NoError(t, handler.Add(ctx, e.target, hook))
	_, err = e.target.Exec(ctx, `UPDATE epitaph.handler_cursors SET commit_lsn = '0/0', seq = 0 WHERE handler_id = $1`, hook.ID)
	require.NoError(t, err)

	cfg.DryRun = false
	res, err := restore.Run(ctx, e.target, e.source, cfg)
	require.NoError(t, err)
	require.Equal(t, restore.OutcomeRestored, res.Outcome)
	require.Equal(t, 8, res.Restored)
	require.Equal(t, 1+2, res.Superseded, "the queued delivery, and the cursor's two orders of customer 42")
	require.Equal(t, 2, e.count(`SELECT count(*) FROM epitaph.deliveries d JOIN archive.rows a USING (source, commit_lsn, seq)
		WHERE d.handler_id = $1 AND d.state = 'stopped' AND d.outcome = 'stop_superseded'
		  AND a.correlation_id = $2 AND a.table_name = 'orders' AND a.row->>'customer_id' = '42'`, hook.ID, corr),
		"customer 42's orders stopped for the cursor handler; customer 44's left to it")
	require.Equal(t, 2, e.count(`SELECT count(*) FROM epitaph.deliveries WHERE handler_id = $1`, hook.ID))
	require.Equal(t, before, e.shopOf(42), "restored equal by row::text")
	require.Zero(t, e.shopOf(44).rows(), "only customer 42's subtree")
	require.Equal(t, []string{"ADA"}, e.texts(`SELECT name_upper FROM public.customers WHERE id = 42`), "the generated column is computed")
	require.Equal(t, []string{"false"}, e.texts(`SELECT vip::text FROM public.customers WHERE id = 42`), "an added column takes its default")
	require.Equal(t, kept, e.shopOf(43), "customer 43 untouched")

	var actor, outcome string
	var restored int
	var planJSON []byte
	require.NoError(t, e.target.QueryRow(ctx, `SELECT actor, outcome, rows_restored, plan FROM epitaph.restores WHERE id = $1`, res.ID).
		Scan(&actor, &outcome, &restored, &planJSON))
	require.Equal(t, []any{"alice", "restored", 8}, []any{actor, outcome, restored})
	require.Contains(t, string(planJSON), `"dropped_columns": ["legacy"]`)

	var state, dOutcome string
	var payload *string
	require.NoError(t, e.target.QueryRow(ctx, `SELECT state, outcome, payload::text FROM epitaph.deliveries WHERE id = '00000000-0000-0000-0000-000000000001'`).
		Scan(&state, &dOutcome, &payload))
	require.Equal(t, []any{"stopped", "stop_superseded", (*string)(nil)}, []any{state, dOutcome, payload})
	require.NoError(t, e.target.QueryRow(ctx, `SELECT state FROM epitaph.deliveries WHERE id = '00000000-0000-0000-0000-000000000002'`).Scan(&state))
	require.Equal(t, "pending", state, "customer 44 was not restored")

	// Again: every row exists now. Abort (the default) names the row and
	// writes nothing; skip skips them all.
	cfg.OnConflict = ""
	_, err = restore.Run(ctx, e.target, e.source, cfg)
	var ce *restore.ConflictError
	require.ErrorAs(t, err, &ce)
	require.Len(t, ce.Rows, 8)
	require.Equal(t, "public.customers", ce.Rows[0].Table)
	require.JSONEq(t, `{"id": 42}`, string(ce.Rows[0].Key))
	require.Contains(t, err.Error(), `public.customers {"id":42}`)
	require.Equal(t, 1, e.count(`SELECT count(*) FROM epitaph.restores WHERE outcome = 'conflict'`))
	cfg.OnConflict = restore.OnConflictSkip
	res, err = restore.Run(ctx, e.target, e.source, cfg)
	require.NoError(t, err)
	require.Equal(t, []int{0, 8}, []int{res.Restored, res.Skipped})
	require.Equal(t, before, e.shopOf(42))

	// The whole transaction: customer 44 comes back, 42's rows are skipped.
	res, err = restore.Run(ctx, e.target, e.source, restore.Config{Source: "main", CorrelationID: corr, Actor: "bob", OnConflict: restore.OnConflictSkip})
	require.NoError(t, err)
	require.Equal(t, []int{bob.rows(), 8}, []int{res.Restored, res.Skipped})
	require.Equal(t, bob.orders, e.shopOf(44).orders)
	require.Equal(t, bob.lines, e.shopOf(44).lines)
	require.Equal(t, bob.shipments, e.shopOf(44).shipments)
}

func tableNames(r *restore.Result) []string {
	var out []string
	for _, t := range r.Tables {
		out = append(out, t.Table)
	}
	return out
}

func tableRows(r *restore.Result) []int {
	var out []int
	for _, t := range r.Tables {
		out = append(out, t.Rows)
	}
	return out
}
