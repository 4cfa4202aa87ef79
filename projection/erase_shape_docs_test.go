package projection_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/projection/erasure"
)

// The selector check reads what the archive holds of the table, expired
// rows included: rows past their expiry that are still kept (here by a
// legal hold; an open delivery or a cleanup batch not run yet do the same)
// show the table's keys as well as rows readers see. Once every archived
// row of a table had expired, a --key of the wrong JSON kind or a --match
// on a column no row has was accepted as for a table with nothing
// archived, and recorded a fence or hold that can never match
// (docs/retention.md: such a selector "is refused (exit 2) before anything
// is recorded").
func TestEraseRefusesSelectorThatCannotMatchExpiredRows(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	e.start(e.config("w1"))
	e.publish(e.nextTx(orderRows(88, 2)...))
	c := e.conn()
	ctx := context.Background()
	eventually(t, 30*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 3 })
	pool := newPool(t, e.url)
	_, err := erasure.AddLegalHold(ctx, pool, erasure.LegalHoldOptions{Table: "public.orders",
		Match: json.RawMessage(`{"customer_id": 7}`), Reason: "litigation", Actor: "dpo"})
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `UPDATE archive_v1.rows SET expires_at = now() - interval '1 minute' WHERE table_name = 'orders'`)
	require.NoError(t, err)
	require.Zero(t, count(t, c, `SELECT count(*) FROM archive.rows WHERE table_name = 'orders'`), "hidden from readers")
	require.Equal(t, 1, count(t, c, `SELECT count(*) FROM archive_v1.rows WHERE table_name = 'orders'`), "kept by the hold")

	_, err = erasure.Erase(ctx, pool, erasure.EraseOptions{Table: "public.orders", Key: json.RawMessage(`{"id": "88"}`), Actor: "dpo"})
	require.ErrorIs(t, err, erasure.ErrBadSelector)
	require.ErrorContains(t, err, `--key column "id" is a JSON string, but in the archived keys of public.orders it is a number`)
	_, err = erasure.AddLegalHold(ctx, pool, erasure.LegalHoldOptions{Table: "public.orders",
		Match: json.RawMessage(`{"emial": "x"}`), Reason: "litigation", Actor: "dpo"})
	require.ErrorIs(t, err, erasure.ErrBadSelector)
	require.Zero(t, count(t, c, `SELECT count(*) FROM epitaph.erasures`), "a refused selector records no fence")
	require.Equal(t, 1, count(t, c, `SELECT count(*) FROM epitaph.legal_holds`))
}
