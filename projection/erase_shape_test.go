package projection_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
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

// A legal hold taken on a target where no version has been created yet
// (the control schema is migrated, no archive exists) is recorded: there
// is nothing archived to check its shape against, and the hold is what
// keeps the rows once they come.
func TestLegalHoldBeforeAnyArchiveIsRecorded(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := newPool(t, testenv.NewDatabase(t))
	require.NoError(t, migrations.Apply(ctx, pool))
	var archive bool
	require.NoError(t, pool.QueryRow(ctx, `SELECT to_regclass('archive.rows') IS NOT NULL`).Scan(&archive))
	require.False(t, archive, "no archive on a target without a version")

	byKey, err := erasure.AddLegalHold(ctx, pool, erasure.LegalHoldOptions{Table: "public.orders",
		Key: json.RawMessage(`{"id": 88}`), Reason: "litigation", Actor: "dpo"})
	require.NoError(t, err)
	byMatch, err := erasure.AddLegalHold(ctx, pool, erasure.LegalHoldOptions{Table: "public.orders",
		Match: json.RawMessage(`{"customer_id": 7}`), Reason: "litigation", Actor: "dpo"})
	require.NoError(t, err)
	hs, err := erasure.ListLegalHolds(ctx, pool)
	require.NoError(t, err)
	require.Len(t, hs, 2)
	require.Equal(t, []int64{byKey.ID, byMatch.ID}, []int64{hs[0].ID, hs[1].ID})
	require.JSONEq(t, `{"id": 88}`, string(hs[0].Key))
	require.JSONEq(t, `{"customer_id": 7}`, string(hs[1].Match))
}

// TestEraseByTheCurrentKeyAfterAKeyChange: the table's key changed (from id
// to tenant and id, a migration the capture follows). An erasure by the key
// the rows have now is refused as a bad selector ("the archived keys have
// id"), because the shape check samples one archived key, an old one.
func TestEraseByTheCurrentKeyAfterAKeyChange(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, 2)
	e.start(e.config("w1"))
	e.publish(e.nextTx(row{schema: "public", table: "accounts", key: `{"id":42}`, image: `{"id":42,"tenant":1,"email":"old@example.com"}`}))
	e.publish(e.nextTx(row{schema: "public", table: "accounts", key: `{"tenant":1,"id":43}`, image: `{"id":43,"tenant":1,"email":"ann@example.com"}`}))
	c := e.conn()
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 2 })

	pool := newPool(t, e.url)
	rc, err := erasure.Erase(ctx, pool, erasure.EraseOptions{Table: "public.accounts",
		Key: json.RawMessage(`{"tenant": 1, "id": 43}`), Reason: "GDPR", Actor: "dpo"})
	require.NoError(t, err, "a row archived under exactly this key exists")
	require.Equal(t, 1, rc.Removed["archive_v1.rows"])
}

// An erasure by a key typed as an equal number ({"id": 42.0} for the
// archived {"id": 42}) removes the row (the archive compares jsonb) and
// records its fence for the key as the events carry it, so the next
// delete of the row is kept out too (the fence compares text: it was
// archived again).
func TestEraseKeyWrittenAsAnEqualNumber(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newEnv(t, 2)
	e.start(e.config("w1"))
	cust := func(id, email string) row {
		return row{schema: "public", table: "customers", key: `{"id":` + id + `}`, image: `{"id":` + id + `,"email":"` + email + `"}`}
	}
	e.publish(e.nextTx(cust("42", "ann@example.com")))
	c := e.conn()
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 1 })

	rc, err := erasure.Erase(ctx, newPool(t, e.url), erasure.EraseOptions{Table: "public.customers",
		Key: json.RawMessage(`{"id": 42.0}`), Reason: "GDPR", Actor: "dpo"})
	require.NoError(t, err)
	require.Equal(t, 1, rc.Removed["archive_v1.rows"])

	// Ann is deleted again (put back meanwhile: the same as a delete still
	// in the stream when the erasure ran); a sentinel after her tells when
	// it was applied.
	e.publish(e.nextTx(cust("42", "ann@example.com")))
	e.publish(e.nextTx(cust("7", "sentinel@example.com")))
	eventually(t, 20*time.Second, func() bool {
		return count(t, c, `SELECT count(*) FROM archive_v1.rows WHERE key = '{"id":7}'`) == 1
	})
	require.Zero(t, count(t, c, `SELECT count(*) FROM archive_v1.rows WHERE key = '{"id":42}'`), "the fence keeps the erased key out")
}
