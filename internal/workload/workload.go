// Package workload is the shared delete workload of Epitaph's end-to-end
// tests and benchmarks: a shop schema whose orders delete by cascade, a
// randomized, reproducible (seeded) mix of deleting transactions, and a
// ledger of every row ever inserted, from which the rows deleted so far are
// known exactly. The verifiers compare that truth with what reached the
// stream or the archive, row by row, in Postgres.
package workload

import (
	"context"
	_ "embed"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// Tables are the shop tables, qualified: what a capture of the workload
// publishes (EPITAPH_TABLES). The ledger in schema "workload" is not among
// them and must never be captured.
var Tables = []string{
	"public.customers",
	"public.orders",
	"public.order_lines",
	"public.shipments",
	"public.shipment_items",
}

// CustomerIDBase is the id before the first customer: customer ids are
// beyond 2^53, so a value that passes through a float64 anywhere shows up as
// a difference.
const CustomerIDBase int64 = 1 << 53

//go:embed schema.sql
var schemaSQL string

// Setup creates the shop schema (REPLICA IDENTITY FULL on every table) and
// the ledger. It is idempotent.
func Setup(ctx context.Context, url string) error {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return fmt.Errorf("connect source: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, schemaSQL); err != nil {
		return fmt.Errorf("create shop schema: %w", err)
	}
	return nil
}

// SeedConfig sizes one Seed call. Zero fields take the defaults.
type SeedConfig struct {
	Customers         int // default 100
	OrdersPerCustomer int // default 10
	LinesPerOrder     int // default 3
	ShipmentsPerOrder int // default 1; -1 = none
	ItemsPerShipment  int // default 2 (each refers to one of the order's lines); -1 = none
	// NoLedger skips the ledger (benchmarks that do not verify): seeding is
	// about twice as fast.
	NoLedger bool
}

func (c *SeedConfig) defaults() {
	if c.Customers == 0 {
		c.Customers = 100
	}
	if c.OrdersPerCustomer == 0 {
		c.OrdersPerCustomer = 10
	}
	if c.LinesPerOrder == 0 {
		c.LinesPerOrder = 3
	}
	if c.ShipmentsPerOrder == 0 {
		c.ShipmentsPerOrder = 1
	}
	if c.ItemsPerShipment == 0 {
		c.ItemsPerShipment = 2
	}
	if c.ShipmentsPerOrder < 0 {
		c.ShipmentsPerOrder = 0
	}
	if c.ItemsPerShipment < 0 || c.ShipmentsPerOrder == 0 {
		c.ItemsPerShipment = 0
	}
}

// RowsPerOrder is how many rows deleting one seeded order removes by
// cascade (the order, its lines, shipments and shipment items).
func (c SeedConfig) RowsPerOrder() int {
	c.defaults()
	return 1 + c.LinesPerOrder + c.ShipmentsPerOrder + c.ShipmentsPerOrder*c.ItemsPerShipment
}

// Counts are row counts per shop table.
type Counts struct {
	Customers, Orders, OrderLines, Shipments, ShipmentItems int64
}

// Total is the sum over the tables.
func (c Counts) Total() int64 {
	return c.Customers + c.Orders + c.OrderLines + c.Shipments + c.ShipmentItems
}

// Seed bulk-inserts customers with their orders, lines, shipments and
// shipment items (INSERT .. SELECT generate_series, one transaction), with
// ids after the largest existing ones, and records them in the ledger. The
// values are deterministic and cover the column types: int8 beyond 2^53,
// numeric, text (some unicode, some several KB and TOASTed), NULLs,
// timestamptz with microseconds, jsonb, text[], uuid, bool, float8 with
// NaN.
func Seed(ctx context.Context, url string, cfg SeedConfig) (Counts, error) {
	cfg.defaults()
	if cfg.ItemsPerShipment > 0 && cfg.LinesPerOrder == 0 {
		return Counts{}, fmt.Errorf("seed: shipment items need order lines")
	}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return Counts{}, fmt.Errorf("connect source: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	tx, err := conn.Begin(ctx)
	if err != nil {
		return Counts{}, fmt.Errorf("seed: begin: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	if cfg.NoLedger {
		if _, err := tx.Exec(ctx, "SET LOCAL workload.no_ledger = on"); err != nil {
			return Counts{}, fmt.Errorf("seed: %w", err)
		}
	}
	var custBase, ordBase, lineBase, shipBase, itemBase int64
	// After the largest id ever inserted, deleted ones included (the
	// ledger's): a new row must never take the id and generation of a
	// deleted one, which the verifiers would take for the same row.
	err = tx.QueryRow(ctx, `SELECT
		coalesce(greatest((SELECT max(id) FROM public.customers), `+ledgerMax+`'public.customers')), $1),
		coalesce(greatest((SELECT max(id) FROM public.orders), `+ledgerMax+`'public.orders')), 0),
		coalesce(greatest((SELECT max(id) FROM public.order_lines), `+ledgerMax+`'public.order_lines')), 0),
		coalesce(greatest((SELECT max(id) FROM public.shipments), `+ledgerMax+`'public.shipments')), 0),
		coalesce(greatest((SELECT max(id) FROM public.shipment_items), `+ledgerMax+`'public.shipment_items')), 0)`, CustomerIDBase).
		Scan(&custBase, &ordBase, &lineBase, &shipBase, &itemBase)
	if err != nil {
		return Counts{}, fmt.Errorf("seed: read id bases: %w", err)
	}
	nCust := int64(cfg.Customers)
	nOrd := nCust * int64(cfg.OrdersPerCustomer)
	c := Counts{
		Customers:     nCust,
		Orders:        nOrd,
		OrderLines:    nOrd * int64(cfg.LinesPerOrder),
		Shipments:     nOrd * int64(cfg.ShipmentsPerOrder),
		ShipmentItems: nOrd * int64(cfg.ShipmentsPerOrder) * int64(cfg.ItemsPerShipment),
	}
	steps := []struct {
		name string
		sql  string
		args []any
		skip bool
	}{
		{"customers", seedCustomers, []any{custBase, nCust}, false},
		{"orders", seedOrders, []any{ordBase, nOrd, custBase, cfg.OrdersPerCustomer}, false},
		{"order_lines", seedLines, []any{lineBase, ordBase, nOrd, cfg.LinesPerOrder}, cfg.LinesPerOrder == 0},
		{"shipments", seedShipments, []any{shipBase, ordBase, nOrd, cfg.ShipmentsPerOrder}, cfg.ShipmentsPerOrder == 0},
		{"shipment_items", seedItems, []any{itemBase, shipBase, lineBase, nOrd, cfg.ShipmentsPerOrder, cfg.ItemsPerShipment, cfg.LinesPerOrder}, cfg.ItemsPerShipment == 0},
	}
	for _, s := range steps {
		if s.skip {
			continue
		}
		if _, err := tx.Exec(ctx, s.sql, s.args...); err != nil {
			return Counts{}, fmt.Errorf("seed %s: %w", s.name, err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return Counts{}, fmt.Errorf("seed: commit: %w", err)
	}
	return c, nil
}

// ledgerMax, followed by a quoted table name and ")", is the
// largest id the ledger recorded for that table.
const ledgerMax = `(SELECT max((pk->>'id')::bigint) FROM workload.ledger WHERE table_name = `

const seedCustomers = `
INSERT INTO public.customers (id, name, email, credit, tags, created_at, profile, gen)
SELECT $1::bigint + i,
       CASE WHEN i % 7 = 0 THEN 'Zoë Ångström ' || i || ' ✓' ELSE 'customer ' || i END,
       CASE WHEN i % 10 = 0 THEN NULL ELSE 'c' || i || '@example.com' END,
       round((i % 100000)::numeric / 7, 2),
       ARRAY['t' || (i % 5), 'vip', NULL],
       timestamptz '2026-01-01 00:00:00+00' + i * interval '1 second 123 microseconds',
       jsonb_build_object('i', i, 'big', 12345678901234567890::numeric, 'nested', jsonb_build_object('a', jsonb_build_array(1, 2.5, 'x', NULL))),
       0
FROM generate_series(1, $2::bigint) i`

const seedOrders = `
INSERT INTO public.orders (id, customer_id, status, total, placed_at, note, attrs, gen)
SELECT $1::bigint + j,
       $3::bigint + ((j - 1) / $4::int) + 1,
       (ARRAY['new', 'paid', 'shipped', 'cancelled', 'très bien'])[1 + j % 5],
       round(((j * 7919) % 1000000)::numeric / 100, 2),
       timestamptz '2026-06-01 12:00:00+00' - j * interval '17 seconds 999 microseconds',
       CASE WHEN j % 97 = 0 THEN (SELECT string_agg(md5((j * 1000 + k)::text), '') FROM generate_series(1, 150) k)
            WHEN j % 11 = 0 THEN NULL
            ELSE 'note for order ' || j END,
       CASE WHEN j % 13 = 0 THEN NULL ELSE jsonb_build_object('gift', j % 2 = 0, 'channel', 'web', 'score', j % 100) END,
       0
FROM generate_series(1, $2::bigint) j`

const seedLines = `
INSERT INTO public.order_lines (id, order_id, sku, qty, unit_price, weight, gen)
SELECT $1::bigint + (j - 1) * $4::int + k,
       $2::bigint + j,
       'SKU-' || lpad(((j * 31 + k) % 100000)::text, 6, '0'),
       1 + (j + k) % 9,
       round((((j + k) * 104729) % 100000)::numeric / 100, 2),
       CASE WHEN (j + k) % 50 = 0 THEN 'NaN'::float8 ELSE ((j + k) % 1000)::float8 / 3 END,
       0
FROM generate_series(1, $3::bigint) j, generate_series(1, $4::int) k`

const seedShipments = `
INSERT INTO public.shipments (id, order_id, carrier, tracking, shipped_at, delivered, gen)
SELECT $1::bigint + (j - 1) * $4::int + s,
       $2::bigint + j,
       (ARRAY['DHL', 'UPS', 'La Poste'])[1 + (j + s) % 3],
       md5(j::text || '/' || s::text)::uuid,
       CASE WHEN j % 3 = 0 THEN NULL ELSE timestamptz '2026-06-02 08:00:00+00' + j * interval '1 minute' END,
       j % 2 = 0,
       0
FROM generate_series(1, $3::bigint) j, generate_series(1, $4::int) s`

const seedItems = `
INSERT INTO public.shipment_items (id, shipment_id, order_line_id, qty, gen)
SELECT $1::bigint + ((j - 1) * $5::int + (s - 1)) * $6::int + i,
       $2::bigint + (j - 1) * $5::int + s,
       $3::bigint + (j - 1) * $7::int + ((i - 1) % $7::int) + 1,
       1 + i % 3,
       0
FROM generate_series(1, $4::bigint) j, generate_series(1, $5::int) s, generate_series(1, $6::int) i`
