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
