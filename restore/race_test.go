package restore_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/restore"
)

const raceSchema = `
CREATE TABLE customers (id bigint PRIMARY KEY, name text);
CREATE TABLE orders (id bigint PRIMARY KEY, customer_id bigint NOT NULL REFERENCES customers ON DELETE CASCADE, v text);
ALTER TABLE customers REPLICA IDENTITY FULL;
ALTER TABLE orders REPLICA IDENTITY FULL;
INSERT INTO customers VALUES (1, 'one'), (2, 'two');
INSERT INTO orders VALUES (10, 1, 'a'), (11, 1, 'b'), (20, 2, 'c');
`

// TestRestoreRacingDeletes: a restore racing the application is either
// refused whole or restored whole, never half-done. A row that appears
// under its key while the restore runs (an uncommitted insert it waits
// for) refuses it and nothing of it stays; a delete racing a restore
// that succeeded deletes the restored rows, and the archive has them again.
func TestRestoreRacingDeletes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := setup(t, raceSchema)
	corr := e.deleteArchived(`DELETE FROM customers WHERE id = 1`, 3)
	cfg := restore.Config{Source: "main", CorrelationID: corr, Actor: "test"}

	// The application re-creates order 11 (for customer 2) while the
	// restore runs: the restore waits on its key, then is refused.
	app, err := pgx.Connect(ctx, e.src)
	require.NoError(t, err)
	defer app.Close(ctx)
	tx, err := app.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `INSERT INTO orders VALUES (11, 2, 'new')`)
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() {
		_, err := restore.Run(ctx, e.target, e.source, cfg)
		done <- err
	}()
	require.Eventually(t, func() bool {
		var waiting int
		err := app.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&waiting)
		return err == nil && waiting == 1
	}, 60*time.Second, 20*time.Millisecond, "the restore waits for the application's uncommitted order 11")
	require.NoError(t, tx.Commit(ctx))
	err = <-done
	var ce *restore.ConflictError
	require.ErrorAs(t, err, &ce)
	require.Equal(t, "public.orders", ce.Rows[0].Table)
	require.JSONEq(t, `{"id": 11}`, string(ce.Rows[0].Key))
	require.Equal(t, []string{"(2,two)"}, e.texts(`SELECT t::text FROM public.customers t ORDER BY id`), "nothing of the refused restore stays")
	require.Equal(t, []string{"(11,2,new)", "(20,2,c)"}, e.texts(`SELECT t::text FROM public.orders t ORDER BY id`))
	require.Equal(t, 1, e.count(`SELECT count(*) FROM epitaph.restores WHERE correlation_id = $1 AND outcome = 'conflict'`, corr))

	// The application gives order 11 up again; now a delete of customer 1
	// races the restore: before the restore commits it sees nothing to
	// delete, after it deletes what was restored, and the archive keeps it
	// again.
	second := e.deleteArchived(`DELETE FROM orders WHERE id = 11`, 1)
	require.NotEqual(t, corr, second)
	stop := make(chan struct{})
	deleted := make(chan int64, 1)
	go func() {
		var n int64
		for n == 0 {
			tag, err := app.Exec(ctx, `DELETE FROM customers WHERE id = 1`)
			if err != nil {
				break
			}
			n = tag.RowsAffected()
			select {
			case <-stop:
				if n == 0 { // the restore is over: one last try
					tag, err = app.Exec(ctx, `DELETE FROM customers WHERE id = 1`)
					if err == nil {
						n = tag.RowsAffected()
					}
				}
				deleted <- n
				return
			default:
			}
		}
		deleted <- n
	}()
	res, err := restore.Run(ctx, e.target, e.source, cfg)
	close(stop)
	require.NoError(t, err)
	require.Equal(t, 3, res.Restored)
	require.Equal(t, int64(1), <-deleted, "the racing delete deleted the restored customer")
	require.Equal(t, []string{"(2,two)"}, e.texts(`SELECT t::text FROM public.customers t ORDER BY id`))
	require.Equal(t, []string{"(20,2,c)"}, e.texts(`SELECT t::text FROM public.orders t ORDER BY id`))
	require.Eventually(t, func() bool {
		return e.count(`SELECT count(*) FROM archive.rows WHERE schema_name = 'public' AND table_name = 'customers' AND key = '{"id": 1}'`) == 2 &&
			e.count(`SELECT count(*) FROM archive.rows WHERE table_name = 'orders' AND key IN ('{"id": 10}', '{"id": 11}')`) == 5
	}, 120*time.Second, 50*time.Millisecond, "restored, then archived again: customer 1 twice, orders 10 and 11 twice (and 11 of customer 2)")
}

// TestRestoreSelfReference: a tree in one table (a NOT DEFERRABLE key to
// itself) deleted by cascade from its root comes back in delete order,
// parents first, equal by row::text; the key is not deferred (it cannot
// be), and nothing else of the table is touched.
func TestRestoreSelfReference(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := setup(t, `
		CREATE TABLE categories (id int PRIMARY KEY, parent_id int REFERENCES categories ON DELETE CASCADE, name text);
		ALTER TABLE categories REPLICA IDENTITY FULL;
		INSERT INTO categories VALUES (1, NULL, 'root'), (2, 1, 'a'), (3, 2, 'a.a'), (4, 3, 'a.a.a'), (5, 1, 'b'), (9, NULL, 'other')`)
	before := e.texts(`SELECT t::text FROM public.categories t ORDER BY id`)
	corr := e.deleteArchived(`DELETE FROM categories WHERE id = 1`, 5)
	require.Equal(t, []string{"(9,,other)"}, e.texts(`SELECT t::text FROM public.categories t ORDER BY id`))
	res, err := restore.Run(ctx, e.target, e.source, restore.Config{Source: "main", CorrelationID: corr, Actor: "test"})
	require.NoError(t, err)
	require.Equal(t, 5, res.Restored)
	require.Empty(t, res.Deferred, "a NOT DEFERRABLE key is not deferred")
	require.Equal(t, before, e.texts(`SELECT t::text FROM public.categories t ORDER BY id`))
}

// TestRestoreKeyDeletedTwiceInOneTransaction: a row deleted, inserted
// again and deleted in one transaction is put back as it was last.
func TestRestoreKeyDeletedTwiceInOneTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := setup(t, `
		CREATE TABLE notes (id int PRIMARY KEY, body text);
		ALTER TABLE notes REPLICA IDENTITY FULL;
		INSERT INTO notes VALUES (1, 'first'), (2, 'other')`)
	corr := e.deleteArchived(`DELETE FROM notes WHERE id = 1; INSERT INTO notes VALUES (1, 'second'); DELETE FROM notes`, 3)
	res, err := restore.Run(ctx, e.target, e.source, restore.Config{Source: "main", CorrelationID: corr, Actor: "test"})
	require.NoError(t, err)
	require.Equal(t, []int{2, 2}, []int{res.Rows, res.Restored})
	require.Equal(t, []string{"(1,second)", "(2,other)"}, e.texts(`SELECT t::text FROM public.notes t ORDER BY id`))
}
