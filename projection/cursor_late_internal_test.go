package projection

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// Of the rows behind the watermark, only those the apply's own
// transaction inserted are late: a row archived before (a rewound
// partition applies its page again, the insert leaves the row as it is)
// was judged by the transaction that inserted it, and may be in a cursor
// batch in flight, which a queued delivery would send a second time.
func TestMarkLateOnlyRowsThisTransactionInserted(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, testenv.NewDatabase(t))
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	require.NoError(t, migrations.Apply(ctx, pool))
	require.NoError(t, version.EnsureArchive(ctx, pool, 1, nil))
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := archive.EnsurePartitions(ctx, tx, archive.Schema(1), archive.DefaultPeriod, time.Now())
		return err
	}))
	insert := `INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row, correlation_id, commit_lsn, commit_time, seq, verified)
		VALUES ('main', 'public', 'orders', '{"id": 1}', '{"id": 1}', 'c', $1::pg_lsn, $2, 0, true) ON CONFLICT DO NOTHING`
	commitTime := time.Now() // one source transaction's: the same on every apply
	_, err = pool.Exec(ctx, insert, "0/100", commitTime)
	require.NoError(t, err)

	queue := []handler.Row{{CommitLSN: "0/100"}, {CommitLSN: "0/200"}, {CommitLSN: "0/300"}}
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		for _, l := range []string{"0/100", "0/200", "0/300"} { // 0/100 again: left as it is
			if _, err := tx.Exec(ctx, insert, l, commitTime); err != nil {
				return err
			}
		}
		return markLate(ctx, tx, archive.Schema(1), "main", queue, []int{0, 1})
	}))
	require.Equal(t, []bool{false, true, false}, []bool{queue[0].Late, queue[1].Late, queue[2].Late},
		"0/100 was archived before; 0/300 is not behind the watermark")
}
