package workload

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Plan describes one randomized run. The same Seed over the same seeded data
// makes the same choices.
type Plan struct {
	// Seed of the random choices.
	Seed uint64
	// Transactions is how many deleting transactions to run (the big one and
	// re-insert cycles not counted); 0 = until ctx is done or no order is
	// left.
	Transactions int
	// MaxOrdersPerTx caps a cascading transaction; sizes are mixed: mostly
	// one order, some a few, a few up to the cap. Default 200.
	MaxOrdersPerTx int
	// SingleFraction of the transactions delete one row of a child table
	// (a shipment item, an order line or a shipment, each with its own
	// cascade); default 0.3. A further 5% delete a customer with all its
	// orders in one transaction of several statements.
	SingleFraction float64
	// BigTxRows, when > 0, runs one transaction deleting about this many
	// rows (whole orders by cascade), before transaction BigTxAt.
	BigTxRows int
	// BigTxAt is the index of the transaction the big one runs before;
	// default a tenth of Transactions, or 50 when Transactions is 0.
	BigTxAt int
	// Reinserts is how many times a deleted order (and its lines) is
	// inserted again with gen+1 and then deleted again. They are spread
	// over the run.
	Reinserts int
	// Pause between transactions; 0 = none.
	Pause time.Duration
	// RetryFor is how long connection failures (a restarting Postgres) are
	// retried before Run gives up; default 2 minutes.
	RetryFor time.Duration
	// Logger; default discards.
	Logger *slog.Logger
}

func (p *Plan) defaults() {
	if p.MaxOrdersPerTx <= 0 {
		p.MaxOrdersPerTx = 200
	}
	if p.SingleFraction == 0 {
		p.SingleFraction = 0.3
	}
	if p.RetryFor <= 0 {
		p.RetryFor = 2 * time.Minute
	}
	if p.Logger == nil {
		p.Logger = slog.New(slog.DiscardHandler)
	}
}

// Result says what a Run did.
type Result struct {
	// Transactions that were attempted (committed, or failed on a
	// connection error with an unknown outcome).
	Transactions int
	// Reinserted is how many re-insert cycles ran.
	Reinserted int
	// Deleted is how many rows the run deleted, counted from the ledger
	// (ledger rows whose generation is no longer live), so it includes
	// cascades and is exact whatever the outcome of interrupted commits.
	Deleted int64
	// Retries counts reconnections after connection failures.
	Retries int
}

// Run runs the plan against url until it is done or ctx is cancelled (not an
// error: the Result says how far it got). Connection failures are retried
// for Plan.RetryFor; any other database error stops the run.
func Run(ctx context.Context, url string, plan Plan) (Result, error) {
	plan.defaults()
	r := &runner{url: url, plan: plan, rng: rand.New(rand.NewPCG(plan.Seed, plan.Seed^0x9e3779b97f4a7c15)), log: plan.Logger}
	var res Result
	if ctx.Err() != nil {
		return res, nil
	}
	before, err := deletedCount(ctx, url)
	if err != nil {
		return res, err
	}
	defer func() {
		if r.conn != nil {
			r.conn.Close(context.WithoutCancel(ctx))
		}
	}()
	if err := r.retry(ctx, &res, r.load); err != nil {
		return r.finish(ctx, res, before, err)
	}
	total := plan.Transactions
	bigAt, reinsertEvery := -1, 0
	if plan.BigTxRows > 0 {
		bigAt = plan.BigTxAt
		if bigAt <= 0 {
			bigAt = total / 10
			if total == 0 {
				bigAt = 50
			}
		}
	}
	if plan.Reinserts > 0 {
		span := total
		if span == 0 {
			span = 50 * (plan.Reinserts + 1)
		}
		reinsertEvery = max(1, span/(plan.Reinserts+1))
	}
	for i := 0; total == 0 || i < total; i++ {
		if ctx.Err() != nil {
			break
		}
		if i == bigAt {
			if err := r.retry(ctx, &res, r.bigTx); err != nil {
				return r.finish(ctx, res, before, err)
			}
			res.Transactions++
		}
		if reinsertEvery > 0 && res.Reinserted < plan.Reinserts && i > 0 && i%reinsertEvery == 0 {
			if err := r.retry(ctx, &res, r.reinsertCycle); err != nil {
				return r.finish(ctx, res, before, err)
			}
			res.Reinserted++
			res.Transactions += 2
		}
		if len(r.orders) == 0 {
			break
		}
		if err := r.retry(ctx, &res, r.oneTx); err != nil {
			return r.finish(ctx, res, before, err)
		}
		res.Transactions++
		if plan.Pause > 0 {
			select {
			case <-ctx.Done():
			case <-time.After(plan.Pause):
			}
		}
	}
	return r.finish(ctx, res, before, nil)
}

func (r *runner) finish(ctx context.Context, res Result, before int64, err error) (Result, error) {
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		err = nil
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.plan.RetryFor)
	defer cancel()
	var after int64
	cerr := r.retry(cctx, &res, func(ctx context.Context) error {
		var e error
		after, e = deletedCount(ctx, r.url)
		return e
	})
	res.Deleted = after - before
	if err == nil {
		err = cerr
	}
	return res, err
}

// deletedCount is how many ledger rows are no longer live: every live row has
// exactly one ledger row (its current generation).
func deletedCount(ctx context.Context, url string) (int64, error) {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return 0, fmt.Errorf("connect source: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var n int64
	err = conn.QueryRow(ctx, `SELECT (SELECT count(*) FROM workload.ledger) - (
		(SELECT count(*) FROM public.customers) + (SELECT count(*) FROM public.orders) +
		(SELECT count(*) FROM public.order_lines) + (SELECT count(*) FROM public.shipments) +
		(SELECT count(*) FROM public.shipment_items))`).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("count deleted rows: %w", err)
	}
	return n, nil
}

type runner struct {
	url  string
	plan Plan
	rng  *rand.Rand
	log  *slog.Logger
	conn *pgx.Conn

	loaded    bool
	orders    []int64 // live order ids, shuffled; popped from the end
	customers []int64
	deleted   []int64 // order ids this run deleted
	rowsPer   float64 // rows deleted per order, on average
	bounds    map[string][2]int64
}

// retry runs f, reconnecting and retrying on connection failures for
// RetryFor. A transaction whose commit failed that way may or may not have
// committed; the ledger makes either outcome right.
func (r *runner) retry(ctx context.Context, res *Result, f func(context.Context) error) error {
	deadline := time.Now().Add(r.plan.RetryFor)
	wait := 50 * time.Millisecond
	for {
		if r.conn == nil || r.conn.IsClosed() {
			c, err := pgx.Connect(ctx, r.url)
			if err == nil {
				r.conn = c
			} else if ctx.Err() != nil {
				return ctx.Err()
			} else if time.Now().After(deadline) {
				return fmt.Errorf("connect source: %w", err)
			}
		}
		var err error
		if r.conn != nil {
			err = f(ctx)
			if err == nil {
				return nil
			}
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if !transient(err) {
				return err
			}
			r.log.Warn("workload: connection failure, retrying", "err", err)
			r.conn.Close(context.WithoutCancel(ctx))
			r.conn = nil
			res.Retries++
			if time.Now().After(deadline) {
				return fmt.Errorf("workload gave up after %s: %w", r.plan.RetryFor, err)
			}
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(wait):
		}
		wait = min(2*wait, time.Second)
	}
}

// transient reports connection-level failures: no SQLSTATE, or a class that
// means the server went away or is starting (08, 57, 53) or a retryable
// conflict (40).
func transient(err error) bool {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		switch pe.Code[:2] {
		case "08", "57", "53", "40":
			return true
		}
		return false
	}
	return true
}

func (r *runner) load(ctx context.Context) error {
	if r.loaded {
		return nil
	}
	rows, err := r.conn.Query(ctx, "SELECT id FROM public.orders ORDER BY id")
	if err != nil {
		return fmt.Errorf("load orders: %w", err)
	}
	r.orders, err = pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return fmt.Errorf("load orders: %w", err)
	}
	rows, err = r.conn.Query(ctx, "SELECT id FROM public.customers ORDER BY id")
	if err != nil {
		return fmt.Errorf("load customers: %w", err)
	}
	r.customers, err = pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return fmt.Errorf("load customers: %w", err)
	}
	r.rng.Shuffle(len(r.orders), func(i, j int) { r.orders[i], r.orders[j] = r.orders[j], r.orders[i] })
	r.rng.Shuffle(len(r.customers), func(i, j int) { r.customers[i], r.customers[j] = r.customers[j], r.customers[i] })
	var children int64
	err = r.conn.QueryRow(ctx, `SELECT (SELECT count(*) FROM public.order_lines) + (SELECT count(*) FROM public.shipments) +
		(SELECT count(*) FROM public.shipment_items)`).Scan(&children)
	if err != nil {
		return fmt.Errorf("count children: %w", err)
	}
	r.rowsPer = 1
	if len(r.orders) > 0 {
		r.rowsPer = 1 + float64(children)/float64(len(r.orders))
	}
	r.bounds = map[string][2]int64{}
	for _, t := range []string{"public.order_lines", "public.shipments", "public.shipment_items"} {
		var lo, hi int64
		if err := r.conn.QueryRow(ctx, "SELECT coalesce(min(id), 0), coalesce(max(id), 0) FROM "+quoteQualified(t)).Scan(&lo, &hi); err != nil {
			return fmt.Errorf("bounds of %s: %w", t, err)
		}
		r.bounds[t] = [2]int64{lo, hi}
	}
	r.loaded = true
	return nil
}

func (r *runner) popOrders(n int) []int64 {
	n = min(n, len(r.orders))
	ids := append([]int64(nil), r.orders[len(r.orders)-n:]...)
	r.orders = r.orders[:len(r.orders)-n]
	return ids
}

// txSize draws the number of orders of a cascading transaction: mostly one,
// some a few, a few many.
func (r *runner) txSize() int {
	x := r.rng.Float64()
	var n int
	switch {
	case x < 0.55:
		n = 1
	case x < 0.85:
		n = 2 + r.rng.IntN(9)
	case x < 0.97:
		n = 11 + r.rng.IntN(90)
	default:
		n = 101 + r.rng.IntN(400)
	}
	return min(n, r.plan.MaxOrdersPerTx)
}

// oneTx runs one deleting transaction of a randomly chosen kind.
func (r *runner) oneTx(ctx context.Context) error {
	x := r.rng.Float64()
	switch {
	case x < r.plan.SingleFraction:
		tables := []string{"public.shipment_items", "public.order_lines", "public.shipments"}
		t := tables[r.rng.IntN(len(tables))]
		b := r.bounds[t]
		if b[1] == 0 {
			return nil
		}
		at := b[0] + r.rng.Int64N(b[1]-b[0]+1)
		q := quoteQualified(t)
		_, err := r.conn.Exec(ctx, "DELETE FROM "+q+" WHERE id = (SELECT id FROM "+q+" WHERE id >= $1 ORDER BY id LIMIT 1)", at)
		if err != nil {
			return fmt.Errorf("delete one row of %s: %w", t, err)
		}
		return nil
	case x < r.plan.SingleFraction+0.05 && len(r.customers) > 0:
		c := r.customers[len(r.customers)-1]
		r.customers = r.customers[:len(r.customers)-1]
		return pgx.BeginFunc(ctx, r.conn, func(tx pgx.Tx) error {
			rows, err := tx.Query(ctx, "DELETE FROM public.orders WHERE customer_id = $1 RETURNING id", c)
			if err != nil {
				return fmt.Errorf("delete orders of customer: %w", err)
			}
			ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
			if err != nil {
				return fmt.Errorf("delete orders of customer: %w", err)
			}
			if _, err := tx.Exec(ctx, "DELETE FROM public.customers WHERE id = $1", c); err != nil {
				return fmt.Errorf("delete customer: %w", err)
			}
			r.deleted = append(r.deleted, ids...)
			return nil
		})
	default:
		ids := r.popOrders(r.txSize())
		return r.deleteOrders(ctx, ids, 0)
	}
}

// deleteOrders deletes orders (by cascade) in one transaction, in
// statements of at most chunk ids (0 = one statement).
func (r *runner) deleteOrders(ctx context.Context, ids []int64, chunk int) error {
	if chunk <= 0 {
		chunk = len(ids)
	}
	return pgx.BeginFunc(ctx, r.conn, func(tx pgx.Tx) error {
		for len(ids) > 0 {
			n := min(chunk, len(ids))
			rows, err := tx.Query(ctx, "DELETE FROM public.orders WHERE id = ANY($1) RETURNING id", ids[:n])
			if err != nil {
				return fmt.Errorf("delete orders: %w", err)
			}
			got, err := pgx.CollectRows(rows, pgx.RowTo[int64])
			if err != nil {
				return fmt.Errorf("delete orders: %w", err)
			}
			r.deleted = append(r.deleted, got...)
			ids = ids[n:]
		}
		return nil
	})
}

func (r *runner) bigTx(ctx context.Context) error {
	n := int(float64(r.plan.BigTxRows)/r.rowsPer + 0.5)
	ids := r.popOrders(max(n, 1))
	r.log.Info("workload: big transaction", "orders", len(ids), "approx_rows", int(float64(len(ids))*r.rowsPer))
	return r.deleteOrders(ctx, ids, 5000)
}

// reinsertCycle re-inserts a deleted order and its lines (and its customer,
// if that is gone too) from the ledger with gen+1, commits, then deletes the
// order again in a second transaction.
func (r *runner) reinsertCycle(ctx context.Context) error {
	if len(r.deleted) == 0 {
		ids := r.popOrders(1)
		if err := r.deleteOrders(ctx, ids, 0); err != nil {
			return err
		}
		if len(r.deleted) == 0 {
			return nil
		}
	}
	id := r.deleted[r.rng.IntN(len(r.deleted))]
	err := pgx.BeginFunc(ctx, r.conn, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, reinsertCustomer, id); err != nil {
			return fmt.Errorf("re-insert customer of order %d: %w", id, err)
		}
		if _, err := tx.Exec(ctx, reinsertOrder, id); err != nil {
			return fmt.Errorf("re-insert order %d: %w", id, err)
		}
		if _, err := tx.Exec(ctx, reinsertLines, id); err != nil {
			return fmt.Errorf("re-insert lines of order %d: %w", id, err)
		}
		return nil
	})
	if err != nil {
		return err
	}
	r.log.Info("workload: re-inserted order", "id", id)
	return r.deleteOrders(ctx, []int64{id}, 0)
}

// The latest generation of a ledger row, made live again with gen+1 (the
// trigger records the new generation). ON CONFLICT: a retry after an
// ambiguous commit finds the row already there.
const reinsertCustomer = `
INSERT INTO public.customers
SELECT (jsonb_populate_record(NULL::public.customers, l.row || jsonb_build_object('gen', l.gen + 1))).*
FROM workload.ledger l
WHERE l.table_name = 'public.customers'
  AND l.pk = jsonb_build_object('id', (SELECT (o.row->>'customer_id')::bigint FROM workload.ledger o
                                       WHERE o.table_name = 'public.orders' AND o.pk = jsonb_build_object('id', $1::bigint) LIMIT 1))
  AND NOT EXISTS (SELECT 1 FROM public.customers c WHERE c.id = (l.pk->>'id')::bigint)
ORDER BY l.gen DESC LIMIT 1
ON CONFLICT DO NOTHING`

const reinsertOrder = `
INSERT INTO public.orders
SELECT (jsonb_populate_record(NULL::public.orders, l.row || jsonb_build_object('gen', l.gen + 1, 'note', 're-inserted'))).*
FROM workload.ledger l
WHERE l.table_name = 'public.orders' AND l.pk = jsonb_build_object('id', $1::bigint)
ORDER BY l.gen DESC LIMIT 1
ON CONFLICT DO NOTHING`

const reinsertLines = `
INSERT INTO public.order_lines
SELECT (jsonb_populate_record(NULL::public.order_lines, l.row || jsonb_build_object('gen', l.gen + 1))).*
FROM (SELECT DISTINCT ON (pk) * FROM workload.ledger
      WHERE table_name = 'public.order_lines' AND (row->>'order_id')::bigint = $1
      ORDER BY pk, gen DESC) l
ON CONFLICT DO NOTHING`

func quoteQualified(t string) string {
	schema, table := splitQualified(t)
	return pgx.Identifier{schema, table}.Sanitize()
}

func splitQualified(t string) (string, string) {
	for i := 0; i < len(t); i++ {
		if t[i] == '.' {
			return t[:i], t[i+1:]
		}
	}
	return "public", t
}
