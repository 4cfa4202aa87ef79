package restore_test

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/projection/erasure"
	"github.com/epitaph-dev/epitaph/restore"
)

const subscribersSchema = `
CREATE TABLE subscribers (email text PRIMARY KEY, name text);
ALTER TABLE subscribers REPLICA IDENTITY FULL;
INSERT INTO subscribers VALUES ('ann@example.com', 'Ann'), ('bob@example.com', 'Bob');
`

// A restore record keeps what was asked (the row's key) and, when it
// conflicted, the keys of the rows in its error. After "projector erase"
// of that key nothing of the target may still hold it (deliveries lose
// their key for that reason).
func TestErasureReachesTheRestoreRecords(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := setup(t, subscribersSchema)
	corr := e.deleteArchived(`DELETE FROM subscribers`, 2)

	// Ann comes back by herself; the restore of the transaction conflicts
	// on her (recorded), then her row alone is restored with skip.
	e.exec(`INSERT INTO subscribers VALUES ('ann@example.com', 'Ann again')`)
	_, err := restore.Run(ctx, e.target, e.source, restore.Config{Source: "main", CorrelationID: corr, Actor: "support"})
	var ce *restore.ConflictError
	require.True(t, errors.As(err, &ce), "%v", err)
	_, err = restore.Run(ctx, e.target, e.source, restore.Config{Source: "main", CorrelationID: corr, Actor: "support",
		Table: "public.subscribers", Key: json.RawMessage(`{"email":"ann@example.com"}`), OnConflict: restore.OnConflictSkip})
	require.NoError(t, err)

	_, err = erasure.Erase(ctx, e.target, erasure.EraseOptions{Table: "public.subscribers",
		Key: json.RawMessage(`{"email":"ann@example.com"}`), Reason: "GDPR", Actor: "dpo"})
	require.NoError(t, err)
	require.Zero(t, e.count(`SELECT count(*) FROM archive_v1.rows WHERE row::text LIKE '%ann@%'`), "erased from the archive")

	rows, err := e.target.Query(ctx, `SELECT id, to_jsonb(r)::text FROM epitaph.restores r WHERE to_jsonb(r)::text LIKE '%ann@example.com%' ORDER BY id`)
	require.NoError(t, err)
	left, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (string, error) {
		var id int64
		var doc string
		return doc, r.Scan(&id, &doc)
	})
	require.NoError(t, err)
	require.Empty(t, left, "the erased key is still in epitaph.restores")
}

// An erasure completes while a restore that read the rows before it is
// still running: the restore must not put the erased row into the source
// and report it restored. It fails, and writes nothing.
func TestRestoreRacingAnErasure(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := setup(t, subscribersSchema)
	corr := e.deleteArchived(`DELETE FROM subscribers`, 2)

	// Another session of the source holds the table in SHARE mode: the
	// restore reads the archive, plans and checks its keys (ACCESS SHARE),
	// then waits to insert (ROW EXCLUSIVE).
	app, err := pgx.Connect(ctx, e.src)
	require.NoError(t, err)
	defer app.Close(ctx)
	lock, err := app.Begin(ctx)
	require.NoError(t, err)
	_, err = lock.Exec(ctx, `LOCK TABLE public.subscribers IN SHARE MODE`)
	require.NoError(t, err)

	type outcome struct {
		res *restore.Result
		err error
	}
	done := make(chan outcome, 1)
	go func() {
		res, err := restore.Run(ctx, e.target, e.source, restore.Config{Source: "main", CorrelationID: corr, Actor: "support"})
		done <- outcome{res, err}
	}()
	require.Eventually(t, func() bool {
		var waiting int
		err := app.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&waiting)
		return err == nil && waiting == 1
	}, 60*time.Second, 20*time.Millisecond, "the restore waits to insert")

	rc, err := erasure.Erase(ctx, e.target, erasure.EraseOptions{Table: "public.subscribers",
		Key: json.RawMessage(`{"email":"ann@example.com"}`), Reason: "GDPR", Actor: "dpo"})
	require.NoError(t, err)
	require.Equal(t, 1, rc.Removed["archive_v1.rows"])
	require.NoError(t, lock.Commit(ctx))

	o := <-done
	t.Logf("restore: err=%v", o.err)
	require.Empty(t, e.texts(`SELECT t::text FROM public.subscribers t WHERE email = 'ann@example.com'`),
		"a row erased before the restore committed was put back into the source (outcome %v)", o.res)
}
