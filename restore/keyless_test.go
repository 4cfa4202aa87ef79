package restore_test

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/restore"
)

// TestRestoreKeylessDuplicates: ten identical rows of a table without a
// key, deleted in one transaction, are ten rows restored (not one
// deleted ten times), equal by row::text; a table without columns says
// why it cannot be restored.
func TestRestoreKeylessDuplicates(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := setup(t, `CREATE TABLE tenk (a int, b text, c numeric); ALTER TABLE tenk REPLICA IDENTITY FULL;
		CREATE TABLE hollow (); ALTER TABLE hollow REPLICA IDENTITY FULL;`)
	e.exec(`INSERT INTO tenk SELECT 1, 'same', 2.50 FROM generate_series(1, 10); INSERT INTO tenk VALUES (2, NULL, NULL), (2, NULL, NULL), (3, 'other', -0.0)`)
	before := e.texts(`SELECT t::text FROM public.tenk t ORDER BY 1`)
	require.Len(t, before, 13)

	corr := e.deleteArchived(`DELETE FROM public.tenk`, 13)
	require.Empty(t, e.texts(`SELECT t::text FROM public.tenk t`))
	res, err := restore.Run(ctx, e.target, e.source, restore.Config{Source: "main", CorrelationID: corr, Actor: "alice"})
	require.NoError(t, err)
	require.Equal(t, 13, res.Restored)
	require.Equal(t, before, e.texts(`SELECT t::text FROM public.tenk t ORDER BY 1`))

	e.exec(`INSERT INTO hollow DEFAULT VALUES; INSERT INTO hollow DEFAULT VALUES`)
	corr = e.deleteArchived(`DELETE FROM public.hollow`, 2)
	_, err = restore.Run(ctx, e.target, e.source, restore.Config{Source: "main", CorrelationID: corr, Actor: "alice"})
	var ce *restore.CannotError
	require.True(t, errors.As(err, &ce), "%v", err)
	require.Contains(t, err.Error(), "public.hollow has no columns")
}

// TestRestoreConflictOnOtherUniqueConstraint: the key of the deleted row
// is free, but another row has taken its unique email since. The restore
// aborts naming that constraint (not "the row exists"), writes nothing,
// and with --on-conflict skip leaves the row out and restores the rest.
func TestRestoreConflictOnOtherUniqueConstraint(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := setup(t, `CREATE TABLE people (id int PRIMARY KEY, email text CONSTRAINT people_email_key UNIQUE, name text);
		ALTER TABLE people REPLICA IDENTITY FULL;`)
	e.exec(`INSERT INTO people VALUES (1, 'a@example.com', 'Ann'), (2, 'b@example.com', 'Bob')`)
	corr := e.deleteArchived(`DELETE FROM public.people`, 2)
	e.exec(`INSERT INTO people VALUES (3, 'a@example.com', 'Another Ann')`)

	_, err := restore.Run(ctx, e.target, e.source, restore.Config{Source: "main", CorrelationID: corr, Actor: "alice"})
	var ce *restore.ConflictError
	require.True(t, errors.As(err, &ce), "%v", err)
	require.Equal(t, "people_email_key", ce.Constraint)
	require.Len(t, ce.Rows, 1)
	require.JSONEq(t, `{"id": 1}`, string(ce.Rows[0].Key))
	require.Contains(t, err.Error(), `public.people {"id":1} conflicts with a row of the source on unique constraint people_email_key`)
	require.NotContains(t, err.Error(), "a@example.com", "the conflicting value is customer data")
	require.Equal(t, []string{"(3,a@example.com,\"Another Ann\")"}, e.texts(`SELECT p::text FROM public.people p ORDER BY id`), "nothing was written")

	res, err := restore.Run(ctx, e.target, e.source, restore.Config{Source: "main", CorrelationID: corr, Actor: "alice", OnConflict: restore.OnConflictSkip})
	require.NoError(t, err)
	require.Equal(t, []int{1, 1}, []int{res.Restored, res.Skipped})
	require.Equal(t, []string{"(2,b@example.com,Bob)", "(3,a@example.com,\"Another Ann\")"}, e.texts(`SELECT p::text FROM public.people p ORDER BY id`))
}
