-- The shop schema the workload deletes from, and the ledger of every row it
-- inserted. The ledger lives in schema "workload", which callers must not
-- capture (EPITAPH_TABLES = workload.Tables).

CREATE SCHEMA IF NOT EXISTS workload;

CREATE TABLE IF NOT EXISTS workload.ledger (
    table_name text   NOT NULL, -- "schema.table"
    pk         jsonb  NOT NULL, -- {"id": n}
    gen        integer NOT NULL,
    row        jsonb  NOT NULL, -- to_jsonb(row) as inserted
    PRIMARY KEY (table_name, pk, gen)
);

-- A statement-level trigger with a transition table records inserted rows
-- set-based, in the inserting transaction (a rolled-back insert leaves no
-- ledger row). Benchmarks that do not verify set workload.no_ledger = on.
CREATE OR REPLACE FUNCTION workload.record() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF coalesce(current_setting('workload.no_ledger', true), '') = 'on' THEN
        RETURN NULL;
    END IF;
    INSERT INTO workload.ledger (table_name, pk, gen, row)
    SELECT TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME, jsonb_build_object('id', n.id), n.gen, to_jsonb(n)
    FROM new_rows n
    -- A restore puts a deleted row back with its values and generation:
    -- the ledger already has that image.
    ON CONFLICT (table_name, pk, gen) DO NOTHING;
    RETURN NULL;
END
$$;

CREATE TABLE IF NOT EXISTS public.customers (
    id         bigint PRIMARY KEY, -- seeded beyond 2^53 on purpose
    name       text NOT NULL,
    email      text,
    credit     numeric(12,2),
    tags       text[],
    created_at timestamptz NOT NULL,
    profile    jsonb,
    gen        integer NOT NULL DEFAULT 0
);

CREATE TABLE IF NOT EXISTS public.orders (
    id          bigint PRIMARY KEY,
    customer_id bigint NOT NULL REFERENCES public.customers (id),
    status      text NOT NULL,
    total       numeric(14,2),
    placed_at   timestamptz,
    note        text, -- sometimes several KB of incompressible text (TOASTed)
    attrs       jsonb,
    gen         integer NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS orders_customer_id ON public.orders (customer_id);

CREATE TABLE IF NOT EXISTS public.order_lines (
    id         bigint PRIMARY KEY,
    order_id   bigint NOT NULL REFERENCES public.orders (id) ON DELETE CASCADE,
    sku        text NOT NULL,
    qty        integer NOT NULL,
    unit_price numeric(12,2) NOT NULL,
    weight     double precision,
    gen        integer NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS order_lines_order_id ON public.order_lines (order_id);

CREATE TABLE IF NOT EXISTS public.shipments (
    id         bigint PRIMARY KEY,
    order_id   bigint NOT NULL REFERENCES public.orders (id) ON DELETE CASCADE,
    carrier    text NOT NULL,
    tracking   uuid,
    shipped_at timestamptz,
    delivered  boolean NOT NULL DEFAULT false,
    gen        integer NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS shipments_order_id ON public.shipments (order_id);

-- Both foreign keys cascade: a NO ACTION key to order_lines could be checked
-- before the shipment cascade has removed the items of the same order.
CREATE TABLE IF NOT EXISTS public.shipment_items (
    id            bigint PRIMARY KEY,
    shipment_id   bigint NOT NULL REFERENCES public.shipments (id) ON DELETE CASCADE,
    order_line_id bigint NOT NULL REFERENCES public.order_lines (id) ON DELETE CASCADE,
    qty           smallint NOT NULL,
    gen           integer NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS shipment_items_shipment_id ON public.shipment_items (shipment_id);
CREATE INDEX IF NOT EXISTS shipment_items_order_line_id ON public.shipment_items (order_line_id);

ALTER TABLE public.customers REPLICA IDENTITY FULL;
ALTER TABLE public.orders REPLICA IDENTITY FULL;
ALTER TABLE public.order_lines REPLICA IDENTITY FULL;
ALTER TABLE public.shipments REPLICA IDENTITY FULL;
ALTER TABLE public.shipment_items REPLICA IDENTITY FULL;

DROP TRIGGER IF EXISTS ledger ON public.customers;
CREATE TRIGGER ledger AFTER INSERT ON public.customers REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION workload.record();
DROP TRIGGER IF EXISTS ledger ON public.orders;
CREATE TRIGGER ledger AFTER INSERT ON public.orders REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION workload.record();
DROP TRIGGER IF EXISTS ledger ON public.order_lines;
CREATE TRIGGER ledger AFTER INSERT ON public.order_lines REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION workload.record();
DROP TRIGGER IF EXISTS ledger ON public.shipments;
CREATE TRIGGER ledger AFTER INSERT ON public.shipments REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION workload.record();
DROP TRIGGER IF EXISTS ledger ON public.shipment_items;
CREATE TRIGGER ledger AFTER INSERT ON public.shipment_items REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION workload.record();
