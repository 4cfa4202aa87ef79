-- The demo's shop: an ordinary application schema. Nothing in it knows
-- about Epitaph: no triggers, no extra columns.
CREATE TABLE customers (
    id         bigint PRIMARY KEY,
    name       text NOT NULL,
    email      text
);
CREATE TABLE orders (
    id          bigint PRIMARY KEY,
    customer_id bigint NOT NULL REFERENCES customers (id) ON DELETE CASCADE,
    status      text NOT NULL,
    total       numeric(12,2) NOT NULL,
    placed_at   timestamptz NOT NULL
);
CREATE TABLE order_lines (
    id         bigint PRIMARY KEY,
    order_id   bigint NOT NULL REFERENCES orders (id) ON DELETE CASCADE,
    sku        text NOT NULL,
    qty        integer NOT NULL,
    unit_price numeric(12,2) NOT NULL
);
CREATE TABLE shipments (
    id         bigint PRIMARY KEY,
    order_id   bigint NOT NULL REFERENCES orders (id) ON DELETE CASCADE,
    carrier    text NOT NULL,
    tracking   uuid NOT NULL
);
ALTER TABLE customers REPLICA IDENTITY FULL;
ALTER TABLE orders REPLICA IDENTITY FULL;
ALTER TABLE order_lines REPLICA IDENTITY FULL;
ALTER TABLE shipments REPLICA IDENTITY FULL;

INSERT INTO customers SELECT c, 'Customer ' || c, 'c' || c || '@example.com' FROM generate_series(1, 20) c;
INSERT INTO orders SELECT o, 1 + (o % 20), (ARRAY['placed','paid','shipped'])[1 + o % 3], 0, timestamptz '2026-11-01 10:00:00+00' + o * interval '17 minutes'
FROM generate_series(1, 200) o;
INSERT INTO order_lines SELECT l, 1 + (l % 200), 'SKU-' || (l % 37), 1 + l % 4, round((3 + (l % 50) * 1.25)::numeric, 2)
FROM generate_series(1, 600) l;
UPDATE orders o SET total = s.total FROM (SELECT order_id, sum(qty * unit_price) AS total FROM order_lines GROUP BY order_id) s WHERE s.order_id = o.id;
INSERT INTO shipments SELECT s, s, (ARRAY['DHL','UPS','La Poste'])[1 + s % 3], md5(s::text)::uuid FROM generate_series(1, 150) s;
