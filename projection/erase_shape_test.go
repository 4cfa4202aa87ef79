package projection_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/projection/erasure"
)

// An erasure or a legal hold whose selector can never match what the
// archive holds of its table is refused with ErrBadSelector and records
// nothing: a --key of a string where the archived keys are numbers (the
// fence compares values exactly), a --key with other columns, a --match on
// a column no archived row has. The right selector erases; a table with
// nothing archived yet is accepted (its rows may be in flight).
func TestEraseRefusesSelectorThatCannotMatch(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	e.start(e.config("w1"))
	e.publish(e.nextTx(orderRows(88, 2)...))
	c := e.conn()
	ctx := context.Background()
	eventually(t, 30*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 3 })
	pool := newPool(t, e.url)
	erase := func(table, key, match string) (erasure.Receipt, error) {
		o := erasure.EraseOptions{Table: table, Actor: "dpo"}
		if key != "" {
			o.Key = json.RawMessage(key)
		} else {
			o.Match = json.RawMessage(match)
		}
		return erasure.Erase(ctx, pool, o)
	}

	for _, tc := range []struct{ key, match, want string }{
		{key: `{"id": "88"}`, want: `--key column "id" is a JSON string, but in the archived keys of public.orders it is a number`},
		{key: `{"order_id": 88}`, want: `--key has the columns order_id, but the archived keys of public.orders have id`},
		{key: `{"id": 88, "customer_id": 7}`, want: `--key has the columns customer_id, id, but the archived keys of public.orders have id`},
		{match: `{"emial": "x"}`, want: `--match column "emial": no archived row of public.orders has it`},
	} {
		_, err := erase("public.orders", tc.key, tc.match)
		require.ErrorIs(t, err, erasure.ErrBadSelector, "%s%s", tc.key, tc.match)
		require.ErrorContains(t, err, tc.want)
		require.NotContains(t, err.Error(), "88", "the selector's values stay out of the error")
		hold := erasure.LegalHoldOptions{Table: "public.orders", Reason: "litigation", Actor: "dpo"}
		if tc.key == "" {
			hold.Match = json.RawMessage(tc.match)
		} else {
			hold.Key = json.RawMessage(tc.key)
		}
		_, err = erasure.AddLegalHold(ctx, pool, hold)
		require.ErrorIs(t, err, erasure.ErrBadSelector, "hold %s%s", tc.key, tc.match)
	}
	require.Zero(t, count(t, c, `SELECT count(*) FROM epitaph.erasures`), "a refused selector records no fence")
	require.Zero(t, count(t, c, `SELECT count(*) FROM epitaph.legal_holds`))
	require.Equal(t, 3, count(t, c, `SELECT count(*) FROM archive.rows`))

	// A table nothing of which is archived: accepted, the fence waits.
	rc, err := erase("public.invoices", `{"number": "A-1"}`, "")
	require.NoError(t, err)
	require.Empty(t, rc.Removed)

	// The right shapes erase.
	rc, err = erase("public.orders", `{"id": 88}`, "")
	require.NoError(t, err)
	require.Equal(t, 1, rc.Removed["archive_v1.rows"])
	rc, err = erase("public.order_lines", "", `{"order_id": 88}`)
	require.NoError(t, err)
	require.Equal(t, 2, rc.Removed["archive_v1.rows"])
	require.Zero(t, count(t, c, `SELECT count(*) FROM archive.rows`))
}
