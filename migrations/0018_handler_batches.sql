-- 0018_handler_batches: a webhook handler may send its deliveries in
-- batches: one POST of up to batch_size deliveries, waiting at most
-- batch_wait for a batch to fill. 1 (the default) sends each alone.
ALTER TABLE epitaph.handlers
    ADD COLUMN IF NOT EXISTS batch_size int NOT NULL DEFAULT 1 CHECK (batch_size BETWEEN 1 AND 1000),
    ADD COLUMN IF NOT EXISTS batch_wait interval NOT NULL DEFAULT '0';
