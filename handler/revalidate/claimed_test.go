package revalidate_test

import (
	"path/filepath"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/handler"
	"github.com/epitaph-dev/epitaph/handler/revalidate"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// claimed reads deliveries as the dispatcher's claim returns them.
func (e *env) claimed(ids ...string) []handler.Delivery {
	e.t.Helper()
	out := make([]handler.Delivery, len(ids))
	for i, id := range ids {
		d := &out[i]
		require.NoError(e.t, e.target.QueryRow(e.ctx, `SELECT id::text, handler_id::text, source, commit_lsn::text, seq, generation,
			schema_name, table_name, key, correlation_id, fingerprint, group_rows, group_max
			FROM epitaph.deliveries WHERE id = $1`, id).Scan(&d.ID, &d.HandlerID, &d.Source, &d.CommitLSN, &d.Seq, &d.Generation,
			&d.Schema, &d.Table, &d.Key, &d.CorrelationID, &d.Fingerprint, &d.GroupRows, &d.GroupMax))
	}
	return out
}

// requireSameAsAlone: each claimed result is what Evaluate decides alone.
func (e *env) requireSameAsAlone(ids []string, got []revalidate.Result) {
	e.t.Helper()
	require.Len(e.t, got, len(ids))
	for i, id := range ids {
		alone, err := e.ev.Evaluate(e.ctx, id)
		require.NoError(e.t, err)
		require.Equal(e.t, alone.Outcome, got[i].Outcome, id)
		require.Equal(e.t, alone.Reason, got[i].Reason, id)
		require.Equal(e.t, alone.Path, got[i].Path, id)
		require.Equal(e.t, alone.ObservedFingerprint, got[i].ObservedFingerprint, id)
	}
}

// A claimed batch is decided as its deliveries one by one, every outcome
// the target and the source can give, in one target statement (and the
// full read of the changed set) and one source read, which runs while the
// target is read once the handler's source is known from an earlier call.
func TestClaimedBatchDecidesAsOneByOne(t *testing.T) {
	e := setup(t)
	var ids []string
	g := e.newGroup()
	for i := range 10 {
		e.archive(g, i, int64(100+i), "row")
	}
	for i := range 10 {
		ids = append(ids, e.queue(e.handler, g, i, int64(100+i))) // unchanged: send, cheap
	}
	back := e.newGroup()
	e.archive(back, 0, 7, "eve")
	ids = append(ids, e.queue(e.handler, back, 0, 7)) // key back in the source
	_, err := e.source.Exec(e.ctx, `INSERT INTO public.customers VALUES (7, 'back')`)
	require.NoError(t, err)
	grown := e.newGroup()
	e.archive(grown, 0, 8, "fay")
	ids = append(ids, e.queue(e.handler, grown, 0, 8))
	e.archive(grown, 1, 9, "gus") // added after queued: changed, full read
	gone := e.newGroup()
	e.archive(gone, 0, 10, "hal")
	ids = append(ids, e.queue(e.handler, gone, 0, 10))
	e.exec(`UPDATE archive_v1.rows SET expires_at = now() - interval '1 second' WHERE commit_lsn = $1::pg_lsn`, gone.lsn)
	removed := e.newGroup()
	e.archive(removed, 0, 11, "ian")
	ids = append(ids, e.queue(e.handler, removed, 0, 11))
	e.exec(`DELETE FROM archive_v1.rows WHERE commit_lsn = $1::pg_lsn`, removed.lsn)
	g1, g2 := e.newGroup(), e.newGroup() // deleted twice: the older one is superseded
	e.archive(g1, 0, 12, "jo")
	ids = append(ids, e.queue(e.handler, g1, 0, 12))
	e.archive(g2, 0, 12, "jo II")
	ids = append(ids, e.queue(e.handler, g2, 0, 12))
	for _, h := range []struct {
		id, set string
	}{
		{"00000000-0000-4000-8000-0000000000c1", `revoked_at = now()`},
		{"00000000-0000-4000-8000-0000000000c2", `enabled = false`},
		{"00000000-0000-4000-8000-0000000000c3", `revalidate = false`},
	} {
		e.addHandler(h.id, true)
		hg := e.newGroup()
		e.archive(hg, 0, 13, "kim")
		ids = append(ids, e.queue(h.id, hg, 0, 13))
		e.exec(`UPDATE epitaph.handlers SET `+h.set+` WHERE id = $1`, h.id)
	}
	e.addHandler("00000000-0000-4000-8000-0000000000c4", true)
	rg := e.newGroup()
	e.archive(rg, 0, 14, "lou")
	ids = append(ids, e.queue("00000000-0000-4000-8000-0000000000c4", rg, 0, 14))
	e.exec(`DELETE FROM epitaph.handlers WHERE id = '00000000-0000-4000-8000-0000000000c4'`)

	ds := e.claimed(ids...)
	first := e.ev.EvaluateClaimed(e.ctx, ds)
	e.requireSameAsAlone(ids, first)

	tm, sm := e.targetQ.mark(), e.sourceQ.mark()
	got := e.ev.EvaluateClaimed(e.ctx, ds)
	require.Equal(t, 4, e.targetQ.since(tm, ""), "the claimed deliveries with their pairs, one full read, the removed row's erasure checks")
	require.Equal(t, 1, e.targetQ.since(tm, "erased_rows WHERE"), "one erasure check of a row, the removed one's")
	require.Equal(t, 1, e.targetQ.since(tm, "sha256("), "the set read once, for the changed delivery")
	require.Equal(t, 1, e.sourceQ.since(sm, "customers"), "one source read for the table")
	e.requireSameAsAlone(ids, got)
	want := map[int]revalidate.Outcome{0: revalidate.Send, 10: revalidate.StopSuperseded, 11: revalidate.StopChanged,
		12: revalidate.StopCompleted, 13: revalidate.StopCompleted, 14: revalidate.StopSuperseded, 15: revalidate.Send,
		16: revalidate.StopRevoked, 17: revalidate.Defer, 18: revalidate.Send, 19: revalidate.StopCompleted}
	for i, o := range want {
		require.Equal(t, o, got[i].Outcome, "delivery %d", i)
	}
	require.Equal(t, revalidate.PathCheap, got[0].Path)
	require.Equal(t, revalidate.ReasonHandlerRemoved, got[19].Reason)
}

// The live version the claimed read names is a guess from the previous
// call, checked by the same statement: after a promotion the batch is read
// in the new live version, also when the old one was dropped.
func TestClaimedBatchFollowsAPromotion(t *testing.T) {
	e := setup(t)
	g := e.newGroup()
	e.archive(g, 0, 1, "ada")
	kept := e.queue(e.handler, g, 0, 1)
	g2 := e.newGroup()
	e.archive(g2, 0, 2, "bob")
	notCopied := e.queue(e.handler, g2, 0, 2)
	ids := []string{kept, notCopied}
	ds := e.claimed(ids...)
	for _, res := range e.ev.EvaluateClaimed(e.ctx, ds) {
		require.Equal(t, revalidate.Send, res.Outcome)
	}

	promote := func(from, to int, drop bool) {
		e.exec(`CREATE SCHEMA archive_v` + strconv.Itoa(to))
		e.exec(`CREATE TABLE archive_v` + strconv.Itoa(to) + `.rows (LIKE archive_v` + strconv.Itoa(from) + `.rows INCLUDING ALL)`)
		e.exec(`INSERT INTO archive_v`+strconv.Itoa(to)+`.rows SELECT * FROM archive_v`+strconv.Itoa(from)+`.rows WHERE commit_lsn = $1::pg_lsn`, g.lsn)
		e.exec(`UPDATE epitaph.projection_versions SET state = 'retired' WHERE projection = 'archive' AND version = $1`, from)
		e.exec(`INSERT INTO epitaph.projection_versions (projection, version, state, schema_name) VALUES ('archive', $1, 'live', $2)`,
			to, "archive_v"+strconv.Itoa(to))
		if drop {
			e.exec(`DROP SCHEMA archive_v` + strconv.Itoa(from) + ` CASCADE`)
		}
	}
	promote(1, 2, false)
	got := e.ev.EvaluateClaimed(e.ctx, ds)
	e.requireSameAsAlone(ids, got)
	require.Equal(t, revalidate.Send, got[0].Outcome)
	require.Equal(t, revalidate.StopCompleted, got[1].Outcome, "its row is not in the live version")

	promote(2, 3, true)
	got = e.ev.EvaluateClaimed(e.ctx, ds)
	e.requireSameAsAlone(ids, got)
	require.Equal(t, revalidate.Send, got[0].Outcome)
	require.Equal(t, revalidate.StopCompleted, got[1].Outcome)
}

// A handler's source_url_file is read afresh: when it changed since the
// previous call (the source read concurrently used the old one), its
// deliveries' source is read again with the new one.
func TestClaimedBatchFollowsTheSourceURLFile(t *testing.T) {
	e := setup(t)
	g := e.newGroup()
	e.archive(g, 0, 1, "ada")
	id := e.queue(e.handler, g, 0, 1)
	ds := e.claimed(id)
	require.Equal(t, revalidate.Send, e.ev.EvaluateClaimed(e.ctx, ds)[0].Outcome)
	require.Equal(t, revalidate.Send, e.ev.EvaluateClaimed(e.ctx, ds)[0].Outcome)

	// Another source, where the key exists.
	otherURL := testenv.NewDatabase(t)
	other := tracedPool(t, otherURL, nil)
	_, err := other.Exec(e.ctx, `CREATE TABLE public.customers (id int8 PRIMARY KEY, name text); INSERT INTO public.customers VALUES (1, 'there')`)
	require.NoError(t, err)
	file := filepath.Join(t.TempDir(), "source-url")
	require.NoError(t, writeFile(file, otherURL))
	e.exec(`UPDATE epitaph.handlers SET source_url_file = $2 WHERE id = $1`, e.handler, file)
	got := e.ev.EvaluateClaimed(e.ctx, ds)
	require.Equal(t, revalidate.StopSuperseded, got[0].Outcome, "read in the handler's new source")
	require.Equal(t, revalidate.ReasonKeyInSource, got[0].Reason)
	e.requireSameAsAlone([]string{id}, got)

	require.NoError(t, writeFile(file, e.sourceURL)) // rotated back: the file is read on every call
	got = e.ev.EvaluateClaimed(e.ctx, ds)
	require.Equal(t, revalidate.Send, got[0].Outcome)
}

// The source check of a batch's keys is one statement for the table
// (jsonb_populate_recordset, the keys typed as the table's columns) when
// every key is an object of scalar values; each delivery gets what the
// per-key lookup gives it alone: keys of several columns and types, text
// that needs quoting, a key with a null value (the per-key lookup, then).
func TestSourceKeysReadAsOneSet(t *testing.T) {
	e := setup(t)
	_, err := e.source.Exec(e.ctx, `CREATE TABLE public.accounts (region text, n int8, active boolean, note text,
		PRIMARY KEY (region, n, active));
		INSERT INTO public.accounts VALUES ('eu', 1, true, 'x'), ('it''s "quoted" ü', 2, false, 'y'), ('eu', 3, true, 'z'),
			('eu', 9007199254740993, true, 'beyond 2^53')`)
	require.NoError(t, err)
	h := "00000000-0000-4000-8000-0000000000d1"
	e.exec(`INSERT INTO epitaph.handlers (id, schema_name, table_name, kind, target) VALUES ($1, 'public', 'accounts', 'webhook', 'http://127.0.0.1:1/')`, h)
	keys := []string{
		`{"region":"eu","n":1,"active":true}`,                 // there: superseded
		`{"region":"it's \"quoted\" ü","n":2,"active":false}`, // there
		`{"region":"eu","n":2,"active":true}`,                 // not there: send
		`{"region":"eu","n":3,"active":false}`,                // not there (active differs)
		`{"region":"eu","n":3,"active":true}`,                 // there
		`{"region":"eu","n":9007199254740993,"active":true}`,  // there: typed exactly, not through a float
		`{"region":"eu","n":9007199254740992,"active":true}`,  // not there
	}
	queue := func(keys []string) []string {
		g := e.newGroup()
		var ids []string
		for i, k := range keys {
			e.exec(`INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row, identity, correlation_id, is_root, commit_lsn, seq, verified)
				VALUES ($1, 'public', 'accounts', $2::jsonb, $2::jsonb, 'full', $3, true, $4::pg_lsn, $5, true)`, src, k, g.corr, g.lsn, i)
		}
		for i, k := range keys {
			var id string
			require.NoError(t, e.target.QueryRow(e.ctx, `INSERT INTO epitaph.deliveries (id, handler_id, source, commit_lsn, seq, schema_name,
				table_name, key, correlation_id, version, released_at, payload)
				VALUES (gen_random_uuid(), $1, $2, $3::pg_lsn, $4, 'public', 'accounts', $5::jsonb, $6, 1, now(), '{}')
				RETURNING id::text`, h, src, g.lsn, i, k, g.corr).Scan(&id))
			ids = append(ids, id)
		}
		tx, err := e.target.Begin(e.ctx)
		require.NoError(t, err)
		_, err = revalidate.StampGroups(e.ctx, tx, "archive_v1", src, []string{g.lsn})
		require.NoError(t, err)
		require.NoError(t, tx.Commit(e.ctx))
		return ids
	}
	ids := queue(keys)
	m := e.sourceQ.mark()
	got := e.ev.EvaluateClaimed(e.ctx, e.claimed(ids...))
	require.Equal(t, 1, e.sourceQ.since(m, ""), "one source statement")
	require.Equal(t, 1, e.sourceQ.since(m, "jsonb_populate_recordset"))
	e.requireSameAsAlone(ids, got)
	for i, want := range []revalidate.Outcome{revalidate.StopSuperseded, revalidate.StopSuperseded, revalidate.Send,
		revalidate.Send, revalidate.StopSuperseded, revalidate.StopSuperseded, revalidate.Send} {
		require.Equal(t, want, got[i].Outcome, keys[i])
	}

	// A key with a null value: the batch's keys are looked up one EXISTS
	// each, as before.
	ids = queue([]string{`{"region":"eu","n":1,"active":true}`, `{"region":null,"n":1,"active":true}`})
	m = e.sourceQ.mark()
	got = e.ev.EvaluateClaimed(e.ctx, e.claimed(ids...))
	require.Equal(t, 0, e.sourceQ.since(m, "jsonb_populate_recordset"))
	e.requireSameAsAlone(ids, got)
	require.Equal(t, revalidate.StopSuperseded, got[0].Outcome)
	require.Equal(t, revalidate.Send, got[1].Outcome)
}
