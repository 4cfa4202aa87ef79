package projection_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/projection/version"
)

func viewTarget(t *testing.T, c *pgx.Conn) string {
	t.Helper()
	var def string
	require.NoError(t, c.QueryRow(context.Background(),
		`SELECT definition FROM pg_views WHERE schemaname = 'archive' AND viewname = 'rows'`).Scan(&def))
	return def
}

// A second version runs beside the live one (its own schema, consumers and
// progress rows, rebuilt from the start of the stream); the reader view
// points at the live version and is re-pointed in one transaction.
func TestVersionsSideBySideAndViewFollowsLive(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	s := e.start(e.config("w1"))
	for i := 0; i < 8; i++ {
		e.publish(e.nextTx(orderRows(i+1, 2)...))
	}
	c := e.conn()
	ctx := context.Background()
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 24 })
	require.Contains(t, viewTarget(t, c), "archive_v1.rows")

	_, err := c.Exec(ctx, `INSERT INTO epitaph.projection_versions (projection, version, state, schema_name, partitions)
		VALUES ('archive', 2, 'building', 'archive_v2', 2)`)
	require.NoError(t, err)
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive_v2.rows`) == 24 })
	require.Contains(t, viewTarget(t, c), "archive_v1.rows", "a building version is not served")
	eventually(t, 10*time.Second, func() bool { return len(owned(s)) == 4 })
	stream, err := e.js.Stream(ctx, event.StreamName(src))
	require.NoError(t, err)
	_, err = stream.Consumer(ctx, e.consumerName(2, 1))
	require.NoError(t, err)

	// Both versions keep applying new events.
	e.publish(e.nextTx(orderRows(100, 1)...))
	eventually(t, 20*time.Second, func() bool {
		return count(t, c, `SELECT count(*) FROM archive_v1.rows`) == 26 && count(t, c, `SELECT count(*) FROM archive_v2.rows`) == 26
	})

	// Promote v2 and retire v1 in one transaction with the view switch.
	require.NoError(t, pgx.BeginFunc(ctx, c, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `UPDATE epitaph.projection_versions SET state = 'retired', retired_at = now() WHERE version = 1`); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `UPDATE epitaph.projection_versions SET state = 'live', live_at = now() WHERE version = 2`); err != nil {
			return err
		}
		return version.PointViews(ctx, tx, 2)
	}))
	require.Contains(t, viewTarget(t, c), "archive_v2.rows")
	require.Equal(t, 26, count(t, c, `SELECT count(*) FROM archive.rows`))
	var state string
	require.NoError(t, c.QueryRow(ctx, `SELECT state FROM archive.status`).Scan(&state))
	require.Equal(t, "live", state)

	// The retired version's partitions are stopped and handed back.
	eventually(t, 10*time.Second, func() bool {
		return len(owned(s)) == 2 && count(t, c, `SELECT count(*) FROM epitaph.progress WHERE version = 1 AND owner IS NOT NULL`) == 0
	})
	e.publish(e.nextTx(orderRows(101, 1)...))
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 28 })
	require.Equal(t, 26, count(t, c, `SELECT count(*) FROM archive_v1.rows`))
}
