package revalidate_test

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/handler/revalidate"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/projection/erasure"
)

// The test that matters most comes first: a row of the group archived
// after the delivery was queued. Every remembered row is still valid, yet
// the old intent understates the current set: it stops as changed, and the
// next generation is queued for the current set, with the new row in it.
func TestAddedAfterQueuedStopsChangedAndQueuesTheCurrentSet(t *testing.T) {
	e := setup(t)
	g := e.newGroup()
	e.archive(g, 0, 1, "ada")
	e.archive(g, 1, 2, "bob")
	first := e.queue(e.handler, g, 0, 1)
	before := e.delivery(`id = $1`, first)
	require.Equal(t, 2, before.GroupRows)
	require.NotEmpty(t, before.Fingerprint)

	e.archive(g, 2, 3, "cyd") // archived late: a quarantined event replayed

	res := e.evaluate(first)
	require.Equal(t, revalidate.StopChanged, res.Outcome)
	require.Equal(t, revalidate.ReasonSetChanged, res.Reason)
	require.Equal(t, revalidate.PathFull, res.Path)
	old := e.delivery(`id = $1`, first)
	require.Equal(t, "stop_changed", old.Outcome)
	require.True(t, old.Evaluated)
	require.Equal(t, before.Fingerprint, old.Fingerprint, "the promise is kept as queued")
	require.NotEqual(t, old.Fingerprint, old.Observed)

	next := e.delivery(`handler_id = $1 AND commit_lsn = $2::pg_lsn AND seq = 0 AND generation = 1`, e.handler, g.lsn)
	require.NotEqual(t, first, next.ID, "a new identity")
	require.Equal(t, old.Observed, next.Fingerprint, "stamped with the set it describes now")
	require.Equal(t, 3, next.GroupRows)
	require.JSONEq(t, `{"rows":3,"added":[{"id":3}]}`, string(next.Payload["group"]), "the payload includes the new row")
	require.JSONEq(t, `{"id":1}`, string(next.Payload["key"]))

	// Recording the same evaluation again queues nothing more; the new
	// generation sends.
	require.NoError(t, e.ev.Record(e.ctx, res))
	var n int
	require.NoError(t, e.target.QueryRow(e.ctx, `SELECT count(*) FROM epitaph.deliveries WHERE handler_id = $1 AND seq = 0`, e.handler).Scan(&n))
	require.Equal(t, 2, n)
	again := e.evaluate(next.ID)
	require.Equal(t, revalidate.Send, again.Outcome)
	require.Equal(t, revalidate.PathCheap, again.Path)
}

func TestUnchangedSetSends(t *testing.T) {
	e := setup(t)
	g := e.newGroup()
	e.archive(g, 0, 1, "ada")
	e.archive(g, 1, 2, "bob")
	id := e.queue(e.handler, g, 0, 1)

	res := e.evaluate(id)
	require.Equal(t, revalidate.Send, res.Outcome)
	require.Equal(t, revalidate.ReasonUnchanged, res.Reason)
	require.Equal(t, revalidate.PathCheap, res.Path)
	d := e.delivery(`id = $1`, id)
	require.Equal(t, "send", d.Outcome)
	require.Equal(t, d.Fingerprint, d.Observed)
	require.True(t, d.Evaluated)

	// Outcomes are counted by handler.
	e.exec(`UPDATE epitaph.handlers SET revoked_at = now() WHERE id = $1`, e.handler)
	require.Equal(t, revalidate.StopRevoked, e.evaluate(id).Outcome)
	require.Equal(t, 1.0, e.metric("epitaph_delivery_revalidations_total", map[string]string{"handler": e.handler, "outcome": "send"}))
	require.Equal(t, 1.0, e.metric("epitaph_delivery_revalidations_total", map[string]string{"handler": e.handler, "outcome": "stop_revoked"}))
	require.Equal(t, 1.0, e.metric("epitaph_delivery_revalidation_set_checks_total", map[string]string{"path": "cheap"}))
}

func TestRowRemovedByRetentionStopsCompleted(t *testing.T) {
	e := setup(t)
	g := e.newGroup()
	e.archive(g, 0, 1, "ada")
	id := e.queue(e.handler, g, 0, 1)

	// Expired: hidden at once, kept in the table while a delivery is open.
	e.exec(`UPDATE archive_v1.rows SET expires_at = now() - interval '1 second' WHERE commit_lsn = $1::pg_lsn`, g.lsn)
	res := e.evaluate(id)
	require.Equal(t, revalidate.StopCompleted, res.Outcome)
	require.Equal(t, revalidate.ReasonRowExpired, res.Reason)
	require.Equal(t, "stop_completed", e.delivery(`id = $1`, id).Outcome)

	// Gone from the version (discarded), no erasure anywhere: completed.
	g2 := e.newGroup()
	e.archive(g2, 0, 2, "bob")
	id2 := e.queue(e.handler, g2, 0, 2)
	e.exec(`DELETE FROM archive_v1.rows WHERE commit_lsn = $1::pg_lsn`, g2.lsn)
	res = e.evaluate(id2)
	require.Equal(t, revalidate.StopCompleted, res.Outcome)
	require.Equal(t, revalidate.ReasonRowRemoved, res.Reason)
}

func TestRemovedHandlerStopsCompleted(t *testing.T) {
	e := setup(t)
	g := e.newGroup()
	e.archive(g, 0, 1, "ada")
	id := e.queue(e.handler, g, 0, 1)
	e.exec(`DELETE FROM epitaph.handlers WHERE id = $1`, e.handler)
	res := e.evaluate(id)
	require.Equal(t, revalidate.StopCompleted, res.Outcome)
	require.Equal(t, revalidate.ReasonHandlerRemoved, res.Reason)
}

func TestRowOfTheGroupRemovedStopsChanged(t *testing.T) {
	e := setup(t)
	g := e.newGroup()
	e.archive(g, 0, 1, "ada")
	e.archive(g, 1, 2, "bob")
	id := e.queue(e.handler, g, 0, 1)
	e.exec(`DELETE FROM archive_v1.rows WHERE commit_lsn = $1::pg_lsn AND seq = 1`, g.lsn)
	res := e.evaluate(id)
	require.Equal(t, revalidate.StopChanged, res.Outcome)
	next := e.delivery(`handler_id = $1 AND seq = 0 AND generation = 1`, e.handler)
	require.Equal(t, 1, next.GroupRows)
	require.JSONEq(t, `{"rows":1,"added":[]}`, string(next.Payload["group"]))
}

func TestErasedRowStopsRevoked(t *testing.T) {
	e := setup(t)
	g := e.newGroup()
	e.archive(g, 0, 1, "ada")
	id := e.queue(e.handler, g, 0, 1)
	g2 := e.newGroup()
	e.archive(g2, 0, 2, "bob")
	other := e.queue(e.handler, g2, 0, 2)
	// A row gone without an erasure of its table: completed.
	e.exec(`DELETE FROM archive_v1.rows WHERE commit_lsn = $1::pg_lsn`, g.lsn)
	res := e.evaluate(id)
	require.Equal(t, revalidate.StopCompleted, res.Outcome)
	require.Equal(t, revalidate.ReasonRowRemoved, res.Reason)

	// projector erase: a fence in epitaph.erasures naming the
	// table (a keyed hash, never the values), the row removed from every
	// version; an evaluation racing it (the delivery in flight) stops
	// revoked, never completed.
	_, err := erasure.Erase(e.ctx, e.target, erasure.EraseOptions{Table: "public.customers", Key: json.RawMessage(`{"id":2}`),
		Actor: "test", Reason: "test"})
	require.NoError(t, err)
	res = e.evaluate(other)
	require.Equal(t, revalidate.StopRevoked, res.Outcome)
	require.Equal(t, revalidate.ReasonRowErased, res.Reason)
	require.Equal(t, "stop_revoked", e.delivery(`id = $1`, other).Outcome)
}

func TestRevokedHandlerStopsRevoked(t *testing.T) {
	e := setup(t)
	g := e.newGroup()
	e.archive(g, 0, 1, "ada")
	id := e.queue(e.handler, g, 0, 1)
	e.exec(`UPDATE epitaph.handlers SET revoked_at = now() WHERE id = $1`, e.handler)
	res := e.evaluate(id)
	require.Equal(t, revalidate.StopRevoked, res.Outcome)
	require.Equal(t, revalidate.ReasonHandlerRevoked, res.Reason)
}

func TestKeyReinsertedInSourceStopsSuperseded(t *testing.T) {
	e := setup(t)
	g := e.newGroup()
	e.archive(g, 0, 1, "ada")
	id := e.queue(e.handler, g, 0, 1)
	_, err := e.source.Exec(e.ctx, `INSERT INTO public.customers VALUES (1, 'ada again')`)
	require.NoError(t, err)
	res := e.evaluate(id)
	require.Equal(t, revalidate.StopSuperseded, res.Outcome)
	require.Equal(t, revalidate.ReasonKeyInSource, res.Reason)
}

func TestKeyDeletedTwiceSupersedesTheOlderDelivery(t *testing.T) {
	e := setup(t)
	g1 := e.newGroup()
	e.archive(g1, 0, 1, "ada")
	older := e.queue(e.handler, g1, 0, 1)
	g2 := e.newGroup() // re-inserted, then deleted again
	e.archive(g2, 0, 1, "ada II")
	newer := e.queue(e.handler, g2, 0, 1)

	// A later "deletion" that is not authenticated (waiting for its signed
	// commit, or dropped by verification) supersedes nothing.
	g3 := e.newGroup()
	e.archive(g3, 0, 1, "forged")
	forged := e.queue(e.handler, g3, 0, 1)
	e.exec(`UPDATE epitaph.deliveries SET verified = false WHERE id = $1`, forged)
	require.Equal(t, revalidate.Send, e.evaluate(newer).Outcome)
	e.exec(`UPDATE epitaph.deliveries SET verified = true, state = 'stopped', outcome = 'unverified' WHERE id = $1`, forged)
	require.Equal(t, revalidate.Send, e.evaluate(newer).Outcome)

	res := e.evaluate(older)
	require.Equal(t, revalidate.StopSuperseded, res.Outcome)
	require.Equal(t, revalidate.ReasonLaterDelivery, res.Reason)
}

func TestSourceDownDefersAndSendsOnceBack(t *testing.T) {
	pg := testenv.NewPostgres(t)
	e := setupWith(t, pg.NewDatabase(t))
	g := e.newGroup()
	e.archive(g, 0, 1, "ada")
	id := e.queue(e.handler, g, 0, 1)

	require.NoError(t, pg.Stop())
	res := e.evaluate(id)
	require.Equal(t, revalidate.Defer, res.Outcome)
	require.Equal(t, revalidate.ReasonSourceDown, res.Reason)
	require.Equal(t, "defer", e.delivery(`id = $1`, id).Outcome)

	require.NoError(t, pg.Start())
	res = e.evaluate(id)
	require.Equal(t, revalidate.Send, res.Outcome)
}

func TestSourcePermissionErrorDefers(t *testing.T) {
	e := setup(t)
	g := e.newGroup()
	e.archive(g, 0, 1, "ada")
	id := e.queue(e.handler, g, 0, 1)
	_, err := e.source.Exec(e.ctx, `REVOKE ALL ON public.customers FROM PUBLIC;
		DO $$ BEGIN CREATE ROLE epitaph_reval_reader LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$`)
	require.NoError(t, err)
	// The handler reads the source through its own URL file, as a role
	// that may not read the table.
	file := t.TempDir() + "/source-url"
	require.NoError(t, writeFile(file, withUser(e.sourceURL, "epitaph_reval_reader")))
	e.exec(`UPDATE epitaph.handlers SET source_url_file = $2 WHERE id = $1`, e.handler, file)
	res := e.evaluate(id)
	require.Equal(t, revalidate.Defer, res.Outcome)
	require.Equal(t, revalidate.ReasonSourcePermission, res.Reason)

	require.NoError(t, writeFile(file, e.sourceURL)) // the file is read on every evaluation
	require.Equal(t, revalidate.Send, e.evaluate(id).Outcome)
}

// Every evaluation reads the source and the archive afresh: the outcome of
// one delivery follows the source between two attempts.
func TestEveryEvaluationIsAFreshRead(t *testing.T) {
	e := setup(t)
	g := e.newGroup()
	e.archive(g, 0, 1, "ada")
	id := e.queue(e.handler, g, 0, 1)

	m := e.sourceQ.mark()
	require.Equal(t, revalidate.Send, e.evaluate(id).Outcome)
	_, err := e.source.Exec(e.ctx, `INSERT INTO public.customers VALUES (1, 'back')`)
	require.NoError(t, err)
	require.Equal(t, revalidate.StopSuperseded, e.evaluate(id).Outcome)
	_, err = e.source.Exec(e.ctx, `DELETE FROM public.customers WHERE id = 1`)
	require.NoError(t, err)
	require.Equal(t, revalidate.Send, e.evaluate(id).Outcome)
	require.Equal(t, 3, e.sourceQ.since(m, "customers"), "one source read per evaluation")

	e.archive(g, 1, 2, "bob")
	require.Equal(t, revalidate.StopChanged, e.evaluate(id).Outcome, "the archive is read afresh too")
}

// The cheap path: while the set is unchanged, an evaluation runs one
// indexed aggregate over the group and never reads the set.
func TestCheapPathSkipsTheFullRead(t *testing.T) {
	e := setup(t)
	g := e.newGroup()
	for i := range 50 {
		e.archive(g, i, int64(i+1), "row")
	}
	id := e.queue(e.handler, g, 0, 1)

	m := e.targetQ.mark()
	for range 5 {
		res, err := e.ev.Evaluate(e.ctx, id)
		require.NoError(t, err)
		require.Equal(t, revalidate.Send, res.Outcome)
		require.Equal(t, revalidate.PathCheap, res.Path)
	}
	require.Equal(t, 10, e.targetQ.since(m, ""), "two target statements per evaluation: the delivery, the aggregate")
	require.Equal(t, 0, e.targetQ.since(m, "sha256("), "the set was never read")

	// A promoted version holding the same rows at another time: the pair
	// differs, the full read finds the same set, sends, and refreshes the
	// pair so the next evaluation is cheap again.
	e.exec(`UPDATE archive_v1.rows SET archived_at = archived_at + interval '1 hour' WHERE commit_lsn = $1::pg_lsn`, g.lsn)
	m = e.targetQ.mark()
	res := e.evaluate(id)
	require.Equal(t, revalidate.Send, res.Outcome)
	require.Equal(t, revalidate.PathFull, res.Path)
	require.Equal(t, 1, e.targetQ.since(m, "sha256("), "one full read")
	res = e.evaluate(id)
	require.Equal(t, revalidate.PathCheap, res.Path)
}

func TestNoRevalidationSends(t *testing.T) {
	e := setup(t)
	h := e.addHandler("00000000-0000-4000-8000-000000000002", false)
	g := e.newGroup()
	e.archive(g, 0, 1, "ada")
	id := e.queue(h, g, 0, 1)
	_, err := e.source.Exec(e.ctx, `INSERT INTO public.customers VALUES (1, 'back')`)
	require.NoError(t, err)
	m := e.sourceQ.mark()
	res := e.evaluate(id)
	require.Equal(t, revalidate.Send, res.Outcome)
	require.Equal(t, revalidate.ReasonNotRevalidated, res.Reason)
	require.Equal(t, 0, e.sourceQ.since(m, ""))
}

func TestStampGroupsIsDeterministicAndIdempotent(t *testing.T) {
	e := setup(t)
	g := e.newGroup()
	e.archive(g, 0, 1, "ada")
	e.archive(g, 1, 2, "bob")
	a := e.queue(e.handler, g, 0, 1)
	b := e.queue(e.handler, g, 1, 2)
	da, db := e.delivery(`id = $1`, a), e.delivery(`id = $1`, b)
	require.Equal(t, da.Fingerprint, db.Fingerprint, "one set, one fingerprint")
	require.Len(t, da.Fingerprint, 64)

	// Same identities, another value: another fingerprint.
	g2 := e.newGroup()
	e.archive(g2, 0, 1, "ada")
	e.archive(g2, 1, 2, "bob")
	c := e.queue(e.handler, g2, 0, 1)
	require.NotEqual(t, da.Fingerprint, e.delivery(`id = $1`, c).Fingerprint, "identities are part of it")

	// Stamping again keeps the first promise.
	e.archive(g, 2, 3, "cyd")
	tx, err := e.target.Begin(e.ctx)
	require.NoError(t, err)
	n, err := revalidate.StampGroups(e.ctx, tx, "archive_v1", src, []string{g.lsn})
	require.NoError(t, err)
	require.Zero(t, n)
	require.NoError(t, tx.Commit(e.ctx))
	require.Equal(t, da.Fingerprint, e.delivery(`id = $1`, a).Fingerprint)

	var payload json.RawMessage
	require.NoError(t, e.target.QueryRow(e.ctx, `SELECT payload FROM epitaph.deliveries WHERE id = $1`, a).Scan(&payload))
	require.NotContains(t, string(payload), "ada", "the delivery stores the promise, not the presentation")
}
