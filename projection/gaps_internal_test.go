package projection

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// The gaps table exists in every version's schema and archive.gaps shows
// the live one's; a gap that concerns every partition is one row however
// many partitions record it, a partition's own gaps are one row each; the
// kind is checked.
func TestGapsTableAndView(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testenv.NewDatabase(t)
	conn, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close(context.Background()) })
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	require.NoError(t, migrations.Apply(ctx, pool))
	_, err = conn.Exec(ctx, archive.DDL("archive_v1")+archive.DDL("archive_v2"))
	require.NoError(t, err)
	// Idempotent.
	_, err = conn.Exec(ctx, archive.DDL("archive_v1"))
	require.NoError(t, err)

	lsn := func(l event.LSN) *event.LSN { return &l }
	str := func(s string) *string { return &s }
	p3 := 3
	seq := func(n int64) *int64 { return &n }
	require.NoError(t, pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		for p := 0; p < 4; p++ { // one copy per partition
			if err := archive.InsertGap(ctx, tx, "archive_v1", archive.Gap{Kind: event.GapLostUpstream, FromLSN: lsn(0x60), ToLSN: lsn(0x9000)}); err != nil {
				return err
			}
		}
		if err := archive.InsertGap(ctx, tx, "archive_v1", archive.Gap{Kind: event.GapLostUpstream, Schema: str("public"), Table: str("t"),
			FromLSN: lsn(0x60), ToLSN: lsn(0x9000)}); err != nil {
			return err
		}
		if err := archive.InsertGap(ctx, tx, "archive_v1", archive.Gap{Kind: event.GapRemovedFromStream, Partition: &p3,
			FromSeq: seq(10), ToSeq: seq(19)}); err != nil {
			return err
		}
		return archive.InsertGap(ctx, tx, "archive_v2", archive.Gap{Kind: event.GapTruncate, Schema: str("public"), Table: str("t"),
			Partition: &p3, FromLSN: lsn(0x70), ToLSN: lsn(0x70)})
	}))
	err = pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		return archive.InsertGap(ctx, tx, "archive_v1", archive.Gap{Kind: "mystery"})
	})
	require.ErrorContains(t, err, "record mystery gap in archive_v1")

	// Views follow the version pointed at.
	require.NoError(t, pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error { return version.PointViews(ctx, tx, 1) }))
	type gapRow struct {
		Kind, Schema, Table, From, To string
		Partition                     int
		FromSeq, ToSeq                int64
		Acked                         bool
	}
	read := func() []gapRow {
		rows, err := conn.Query(ctx, `SELECT kind, COALESCE(schema_name, ''), COALESCE(table_name, ''),
			COALESCE(from_lsn::text, ''), COALESCE(to_lsn::text, ''), COALESCE(partition, -1),
			COALESCE(from_seq, -1), COALESCE(to_seq, -1), acknowledged_at IS NOT NULL
			FROM archive.gaps ORDER BY id`)
		require.NoError(t, err)
		out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[gapRow])
		require.NoError(t, err)
		return out
	}
	require.Equal(t, []gapRow{
		{Kind: "lost_upstream", From: "0/60", To: "0/9000", Partition: -1, FromSeq: -1, ToSeq: -1},
		{Kind: "lost_upstream", Schema: "public", Table: "t", From: "0/60", To: "0/9000", Partition: -1, FromSeq: -1, ToSeq: -1},
		{Kind: "removed_from_stream", Partition: 3, FromSeq: 10, ToSeq: 19},
	}, read())
	require.NoError(t, pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error { return version.PointViews(ctx, tx, 2) }))
	require.Equal(t, []gapRow{
		{Kind: "truncate", Schema: "public", Table: "t", From: "0/70", To: "0/70", Partition: 3, FromSeq: -1, ToSeq: -1},
	}, read())
}
