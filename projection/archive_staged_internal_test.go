package projection

import (
	"context"
	"fmt"
	"strings"
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

// Rows above archive.StageRowsAbove go through the staging table and are archived
// byte for byte with the small rows around them, in two inserts of one
// transaction, and after a rolled-back savepoint that staged rows too.
func TestLargeRowImagesAreStaged(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testenv.NewDatabase(t)
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	defer pool.Close()
	require.NoError(t, migrations.Apply(ctx, pool))
	schema := archive.Schema(1)
	_, err = pool.Exec(ctx, archive.DDL(schema))
	require.NoError(t, err)

	big := func(seq int, fill string) string {
		return fmt.Sprintf(`{"id":%d,"body":"%s"}`, seq, strings.Repeat(fill, archive.StageRowsAbove/len(fill)+seq))
	}
	row := func(seq int, image string) *archiveRow {
		ev := &event.Event{Op: event.OpDelete, Source: "main", Schema: "public", Table: "docs", Identity: event.IdentityFull,
			XID: 7, CommitLSN: 0x5000, CommitTime: time.Unix(1700000000, 0).UTC(), Seq: seq,
			Key: []byte(fmt.Sprintf(`{"id":%d}`, seq))}
		return &archiveRow{ev: ev, row: []byte(image)}
	}
	want := map[int]string{0: `{"id":0,"body":"small"}`, 1: big(1, `ab\"c\\`), 2: `{"id":2,"body":"x"}`, 3: big(3, "é"), 4: big(4, "q")}
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	// A savepoint that stages a row and is rolled back leaves nothing behind.
	sp, err := tx.Begin(ctx)
	require.NoError(t, err)
	_, err = insertRows(ctx, sp, schema, []*archiveRow{row(9, big(9, "z"))})
	require.NoError(t, err)
	require.NoError(t, sp.Rollback(ctx))

	_, err = insertRows(ctx, tx, schema, []*archiveRow{row(0, want[0]), row(1, want[1]), row(2, want[2])})
	require.NoError(t, err)
	_, err = insertRows(ctx, tx, schema, []*archiveRow{row(3, want[3]), row(4, want[4])})
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))

	rows, err := pool.Query(ctx, `SELECT seq, md5(row::text) FROM `+archive.Ident(schema, "rows")+` ORDER BY seq`)
	require.NoError(t, err)
	got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[struct {
		Seq int
		MD5 string
	}])
	require.NoError(t, err)
	require.Len(t, got, len(want), "seq 9 was rolled back")
	for _, g := range got {
		var md5 string
		require.NoError(t, pool.QueryRow(ctx, `SELECT md5($1::jsonb::text)`, want[g.Seq]).Scan(&md5))
		require.Equal(t, md5, g.MD5, "row %d", g.Seq)
	}
}
