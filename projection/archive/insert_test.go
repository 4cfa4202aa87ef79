package archive_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/archive"
)

// Each archived row carries its own event's refs and columns, whatever the
// other rows of the statement carry: rows of tables interleaved, tables
// sharing none, one, or each other's schema, and rows without any.
func TestInsertRowsKeepsEachRowsRefsAndColumns(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := newArchive(t)

	itemCols := []event.Column{{Name: "id", Type: "bigint", PK: true}, {Name: "order_id", Type: "bigint"}}
	itemRefs := []event.Ref{{Columns: []string{"order_id"}, Schema: "public", Table: "orders", RefColumns: []string{"id"}}}
	orderCols := []event.Column{{Name: "id", Type: "bigint", PK: true}, {Name: "note", Type: "text"}}
	noteCols := []event.Column{{Name: "id", Type: "bigint", PK: true}, {Name: "order_id", Type: "integer"}}
	type shape struct {
		table string
		cols  []event.Column
		refs  []event.Ref
	}
	shapes := []shape{
		{"items", itemCols, itemRefs}, {"orders", orderCols, nil}, {"items", itemCols, itemRefs},
		{"notes", noteCols, itemRefs}, {"bare", nil, nil}, {"orders", orderCols, nil},
		// Equal to an earlier row's, in new slices.
		{"items", append([]event.Column(nil), itemCols...), append([]event.Ref(nil), itemRefs...)},
	}
	var rows []archive.Row
	for i, s := range shapes {
		ev := &event.Event{Op: event.OpDelete, Source: "main", Schema: "public", Table: s.table, Identity: event.IdentityFull,
			XID: 7, CommitLSN: 0x5000, CommitTime: time.Unix(1700000000, 0).UTC(), Seq: i,
			Key: json.RawMessage(`{"id":1}`), Columns: s.cols, Refs: s.refs}
		rows = append(rows, archive.Row{Event: ev, Image: json.RawMessage(`{"id":1}`), Verified: true})
	}
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	_, _, err = archive.InsertRows(ctx, tx, schema, rows)
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))

	for i, s := range shapes {
		var refs, cols *string
		require.NoError(t, pool.QueryRow(ctx, `SELECT refs::text, columns::text FROM `+archive.Ident(schema, "rows")+` WHERE seq = $1`, i).Scan(&refs, &cols))
		for _, c := range []struct {
			name string
			got  *string
			want any
			none bool
		}{{"refs", refs, s.refs, len(s.refs) == 0}, {"columns", cols, s.cols, len(s.cols) == 0}} {
			if c.none {
				require.Nil(t, c.got, "row %d: %s", i, c.name)
				continue
			}
			want, err := json.Marshal(c.want)
			require.NoError(t, err)
			require.NotNil(t, c.got, "row %d: %s", i, c.name)
			require.JSONEq(t, string(want), *c.got, "row %d: %s", i, c.name)
		}
	}
}

// A page holding rows already archived archives only the others, keeps the
// archived ones as they were, counts only what it inserted, and leaves its
// transaction usable; a page of new rows after it is archived whole.
func TestInsertRowsSkipsRowsAlreadyArchived(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, schema := newArchive(t)

	page := func(image string, seqs ...int) []archive.Row {
		var rows []archive.Row
		for _, seq := range seqs {
			ev := &event.Event{Op: event.OpDelete, Source: "main", Schema: "public", Table: "orders", Identity: event.IdentityFull,
				XID: 7, CommitLSN: 0x5000, CommitTime: time.Unix(1700000000, 0).UTC(), Seq: seq, Key: json.RawMessage(`{"id":1}`)}
			rows = append(rows, archive.Row{Event: ev, Image: json.RawMessage(image), Verified: true})
		}
		return rows
	}
	insert := func(tx pgx.Tx, rows []archive.Row) int {
		inserted, _, err := archive.InsertRows(ctx, tx, schema, rows)
		require.NoError(t, err)
		n := 0
		for _, in := range inserted {
			n += in.Rows
		}
		return n
	}
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	require.Equal(t, 3, insert(tx, page(`{"id":1,"v":"first"}`, 0, 1, 2)))
	require.NoError(t, tx.Commit(ctx))

	tx, err = pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	require.Equal(t, 2, insert(tx, page(`{"id":1,"v":"again"}`, 1, 2, 3, 4)), "seqs 3 and 4")
	require.Zero(t, insert(tx, page(`{"id":1,"v":"again"}`, 0, 4)))
	require.Equal(t, 2, insert(tx, page(`{"id":1,"v":"new"}`, 5, 6)))
	require.NoError(t, tx.Commit(ctx))

	rows, err := pool.Query(ctx, `SELECT seq, row->>'v' FROM `+archive.Ident(schema, "rows")+` ORDER BY seq`)
	require.NoError(t, err)
	got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[struct {
		Seq int
		V   string
	}])
	require.NoError(t, err)
	require.Equal(t, []struct {
		Seq int
		V   string
	}{{0, "first"}, {1, "first"}, {2, "first"}, {3, "again"}, {4, "again"}, {5, "new"}, {6, "new"}}, got)
}

// newArchive is a fresh target database with the migrations applied and
// version 1's archive made: its pool (closed when the test ends) and the
// archive's schema.
func newArchive(t *testing.T) (*pgxpool.Pool, string) {
	t.Helper()
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, testenv.NewDatabase(t))
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	require.NoError(t, migrations.Apply(ctx, pool))
	schema := archive.Schema(1)
	_, err = pool.Exec(ctx, archive.DDL(schema))
	require.NoError(t, err)
	return pool, schema
}
