package projection

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/archive"
)

// randomTx is a transaction of random rows of a small schema with single,
// composite, self-referencing and nullable foreign keys, values sometimes
// missing, null or shared by several rows.
func randomTx(rng *rand.Rand, lsn event.LSN, n int) []*archiveRow {
	refs := map[string][]event.Ref{
		"orders":     {fk([]string{"customer_id"}, "customers", []string{"id"})},
		"lines":      {fk([]string{"order_id"}, "orders", []string{"id"})},
		"items":      {fk([]string{"line_id"}, "lines", []string{"id"}), fk([]string{"order_id"}, "orders", []string{"id"})},
		"categories": {fk([]string{"parent_id"}, "categories", []string{"id"})},
		"pairs":      {fk([]string{"a", "b"}, "pairs", []string{"x", "y"})},
	}
	tables := []string{"customers", "orders", "lines", "items", "categories", "pairs"}
	val := func() string {
		switch rng.IntN(8) {
		case 0:
			return "null"
		case 1:
			return `"7"` // a string is not equal to the number 7
		default:
			return fmt.Sprint(rng.IntN(6))
		}
	}
	var rows []*archiveRow
	for seq := 0; seq < n; seq++ {
		table := tables[rng.IntN(len(tables))]
		image := fmt.Sprintf(`{"id":%s`, val())
		for _, c := range []string{"customer_id", "order_id", "line_id", "parent_id", "a", "b", "x", "y"} {
			if rng.IntN(4) > 0 {
				image += fmt.Sprintf(`,%q:%s`, c, val())
			}
		}
		image += "}"
		r := mkRow(seq, table, fmt.Sprintf(`{"id":%d}`, seq), image, refs[table]...)
		r.ev.CommitLSN = lsn
		rows = append(rows, r)
	}
	return rows
}

// markRootsSQL decides exactly what the in-memory rule decides, for every
// row (onlyUndecided false) and for the rows left undecided (true).
func TestMarkRootsSQLMatchesMemory(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testenv.NewDatabase(t)
	conn, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer conn.Close(ctx)
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	defer pool.Close()
	require.NoError(t, migrations.Apply(ctx, pool)) // the insert reads the erasure counter (erasure fences)
	schema := archive.Schema(1)
	_, err = conn.Exec(ctx, archive.DDL(schema))
	require.NoError(t, err)

	rng := rand.New(rand.NewPCG(7, 11))
	var want, pre []*bool
	var lsns []event.LSN
	var all []*archiveRow
	for i := 0; i < 40; i++ {
		lsn := event.LSN(0x1000 + i*0x10)
		rows := randomTx(rng, lsn, 1+rng.IntN(30))
		markRootsInMemory(rows)
		for _, r := range rows {
			want = append(want, r.isRoot)
			r.isRoot = nil
			if i%2 == 1 && rng.IntN(3) == 0 { // decided on insert already: left alone when onlyUndecided
				b := rng.IntN(2) == 0
				r.isRoot = &b
			}
			pre = append(pre, r.isRoot)
		}
		lsns = append(lsns, lsn)
		all = append(all, rows...)
	}
	tx, err := conn.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	_, err = insertRows(ctx, tx, schema, all)
	require.NoError(t, err)
	var even, odd []event.LSN
	for i, l := range lsns {
		if i%2 == 0 {
			even = append(even, l)
		} else {
			odd = append(odd, l)
		}
	}
	require.NoError(t, markRoots(ctx, tx, schema, "main", even, false))
	require.NoError(t, markRoots(ctx, tx, schema, "main", odd, true))
	for i, r := range all {
		var got *bool
		require.NoError(t, tx.QueryRow(ctx, `SELECT is_root FROM `+archive.Ident(schema, "rows")+` WHERE commit_lsn = $1 AND seq = $2`,
			r.ev.CommitLSN.String(), r.ev.Seq).Scan(&got))
		expect := want[i]
		if pre[i] != nil && slicesIndex(odd, r.ev.CommitLSN) {
			expect = pre[i]
		}
		require.Equal(t, expect, got, "row %d of %s (%s %s)", r.ev.Seq, r.ev.CommitLSN, r.ev.Table, r.row)
	}
}

func slicesIndex(xs []event.LSN, x event.LSN) bool {
	for _, y := range xs {
		if y == x {
			return true
		}
	}
	return false
}

// A worker that joins a transaction after its first row (it took the
// partition over, or failed and re-read its cursor) does not know what was
// decided before it: the commit decides every row again.
func TestDecideEarlyJoinedMidTransaction(t *testing.T) {
	t.Parallel()
	toOrder := fk([]string{"order_id"}, "orders", []string{"id"})
	fromStart := decideEarly([]*archiveRow{mkRow(0, "orders", `{"id":1}`, `{"id":1}`)}, map[event.LSN]bool{}, nil)
	require.False(t, fromStart.full)
	joined := decideEarly([]*archiveRow{mkRow(5, "lines", `{"id":10}`, `{"id":10,"order_id":1}`, toOrder)}, map[event.LSN]bool{}, nil)
	require.True(t, joined.full)
}
