package quarantine_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/quarantine"
)

func TestMain(m *testing.M) { testenv.MainNoLeaks(m) }

// setup returns a pool on a fresh migrated database whose search_path is
// empty, so any unqualified name fails loudly.
func setup(t *testing.T) *pgxpool.Pool {
	t.Helper()
	ctx := context.Background()
	url := testenv.NewDatabase(t)
	mig, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	require.NoError(t, migrations.Apply(ctx, mig))
	mig.Close()
	cfg, err := pgxpool.ParseConfig(url)
	require.NoError(t, err)
	cfg.ConnConfig.RuntimeParams["search_path"] = ""
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

func insert(t *testing.T, pool *pgxpool.Pool, e quarantine.Entry) {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, quarantine.Insert(ctx, tx, e))
	require.NoError(t, tx.Commit(ctx))
}

// deleteBody is a valid v1 delete event body for row id of public.orders.
func deleteBody(t *testing.T, id int, row string) []byte {
	t.Helper()
	b, err := event.Encode(&event.Event{
		Op: event.OpDelete, Source: "main", Schema: "public", Table: "orders", XID: 100 + int64(id),
		CommitLSN: event.LSN(0x1000 + id), CommitTime: time.Date(2026, 11, 30, 9, 0, 0, 0, time.UTC),
		Identity: event.IdentityFull, Columns: []event.Column{{Name: "id", Type: "bigint", PK: true}},
		Key: json.RawMessage(fmt.Sprintf(`{"id":%d}`, id)), Row: json.RawMessage(row),
	})
	require.NoError(t, err)
	return b
}

func entry(seq uint64, cat quarantine.Category, data []byte) quarantine.Entry {
	return quarantine.Entry{
		Projection: "archive", Version: 1, Partition: 3, StreamSeq: seq,
		Subject: event.DeleteSubject("main", 3, "public", "orders"),
		Headers: map[string][]string{event.HeaderMsgID: {fmt.Sprintf("main/0/%d", seq)}, event.HeaderVersion: {"1"}},
		Data:    data, Category: string(cat), Error: "decode event: " + string(cat),
	}
}

func TestInsertIsIdempotentAndTransactional(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := setup(t)

	e := entry(10, quarantine.CategoryMalformed, []byte("garbage"))
	insert(t, pool, e)
	var firstSeen time.Time
	require.NoError(t, pool.QueryRow(ctx, `SELECT first_seen FROM epitaph.quarantine`).Scan(&firstSeen))

	// Re-delivery of the same stream sequence: same entry, attempts bumped.
	e.Error = "decode event: malformed: second try"
	insert(t, pool, e)
	recs, err := quarantine.List(ctx, pool, quarantine.Filter{})
	require.NoError(t, err)
	require.Len(t, recs, 1)
	r := recs[0]
	require.Equal(t, 2, r.Attempts)
	require.Equal(t, "decode event: malformed: second try", r.Error)
	require.Equal(t, firstSeen, r.FirstSeen)
	require.Equal(t, quarantine.StatusOpen, r.Status)
	require.Equal(t, uint64(10), r.StreamSeq)
	require.Equal(t, 3, r.Partition)
	require.Equal(t, len("garbage"), r.Size)
	require.Nil(t, r.Data, "List never loads payloads")
	require.Equal(t, []string{"main/0/10"}, r.Headers[event.HeaderMsgID])

	// The same sequence in another version is another entry.
	e.Version = 2
	insert(t, pool, e)

	// Atomic with the caller's transaction: a rolled-back cursor advance
	// leaves no entry behind.
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, quarantine.Insert(ctx, tx, entry(11, quarantine.CategoryInvalid, []byte("{}"))))
	require.NoError(t, tx.Rollback(ctx))

	var n int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM epitaph.quarantine`).Scan(&n))
	require.Equal(t, 2, n)
}

func TestInsertStoresAnyMessage(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := setup(t)

	nasty := []byte("{\"v\":1,\"schema\":\"public\",\"table\":\"orders\",\"key\":{\"id\":\"a\\u0000b\"}}\x00\xff")
	e := quarantine.Entry{
		Projection: "archive", Version: 1, Partition: 0, StreamSeq: 1 << 62,
		Subject: "epitaph.main.0.delete.public.orders",
		Headers: map[string][]string{"X-Bad\x00": {"nul\x00here", "\xff"}},
		Data:    nasty, Category: string(quarantine.CategoryMalformed), Error: "bad \x00 \xfe text",
	}
	insert(t, pool, e)
	// Nil data is stored as an empty payload.
	insert(t, pool, quarantine.Entry{Projection: "archive", Version: 1, StreamSeq: 2, Category: "malformed"})

	recs, err := quarantine.List(ctx, pool, quarantine.Filter{Projection: "archive"})
	require.NoError(t, err)
	require.Len(t, recs, 2)
	require.Equal(t, uint64(2), recs[0].StreamSeq)
	require.Equal(t, 0, recs[0].Size)

	r, err := quarantine.Show(ctx, pool, recs[1].ID, true)
	require.NoError(t, err)
	require.Equal(t, nasty, r.Data, "raw bytes are kept exactly")
	require.Equal(t, uint64(1<<62), r.StreamSeq)
	require.Equal(t, "bad  \uFFFD text", r.Error)
	require.Equal(t, []string{"nulhere", "\uFFFD"}, r.Headers["X-Bad"])
	require.Nil(t, r.SourceKey, "a key jsonb cannot hold is not recorded")
}

func TestListShowDiscard(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := setup(t)

	insert(t, pool, entry(5, quarantine.CategoryMalformed, []byte("x")))
	insert(t, pool, entry(6, quarantine.CategoryUnknownVersion, []byte(`{"v":2}`)))
	other := entry(7, quarantine.CategoryIncompatible, deleteBody(t, 1, `{"id":1}`))
	other.Projection = "audit"
	insert(t, pool, other)

	all, err := quarantine.List(ctx, pool, quarantine.Filter{})
	require.NoError(t, err)
	require.Len(t, all, 3)
	byCat, err := quarantine.List(ctx, pool, quarantine.Filter{Category: quarantine.CategoryUnknownVersion})
	require.NoError(t, err)
	require.Len(t, byCat, 1)
	require.Equal(t, uint64(6), byCat[0].StreamSeq)
	byProj, err := quarantine.List(ctx, pool, quarantine.Filter{Projection: "audit", Version: 1})
	require.NoError(t, err)
	require.Len(t, byProj, 1)
	require.Equal(t, "public", byProj[0].SourceSchema)
	require.Equal(t, "orders", byProj[0].SourceTable)
	require.JSONEq(t, `{"id":1}`, string(byProj[0].SourceKey))
	limited, err := quarantine.List(ctx, pool, quarantine.Filter{Limit: 2})
	require.NoError(t, err)
	require.Len(t, limited, 2)

	id := byCat[0].ID
	hidden, err := quarantine.Show(ctx, pool, id, false)
	require.NoError(t, err)
	require.Nil(t, hidden.Data, "payload only on request")
	require.Equal(t, 7, hidden.Size)
	shown, err := quarantine.Show(ctx, pool, id, true)
	require.NoError(t, err)
	require.Equal(t, []byte(`{"v":2}`), shown.Data)
	_, err = quarantine.Show(ctx, pool, 999999, false)
	require.ErrorIs(t, err, quarantine.ErrNotFound)

	require.Error(t, quarantine.Discard(ctx, pool, id, "  "), "a reason is required")
	require.NoError(t, quarantine.Discard(ctx, pool, id, "published by hand by mistake (OPS-12)"))
	require.ErrorIs(t, quarantine.Discard(ctx, pool, id, "again"), quarantine.ErrNotOpen)
	require.ErrorIs(t, quarantine.Discard(ctx, pool, 999999, "x"), quarantine.ErrNotFound)

	audit, err := quarantine.Show(ctx, pool, id, false)
	require.NoError(t, err)
	require.Equal(t, quarantine.StatusDiscarded, audit.Status)
	require.Equal(t, "published by hand by mistake (OPS-12)", audit.ResolutionReason)
	require.NotNil(t, audit.ResolvedAt)
	open, err := quarantine.List(ctx, pool, quarantine.Filter{Status: quarantine.StatusOpen})
	require.NoError(t, err)
	require.Len(t, open, 2)
}

// applier applies delete events into a real table, decoding with a decoder
// that may be taught v2, and records the order of application.
type applier struct {
	dec *event.Decoder
	mu  sync.Mutex
	seq []uint64
	// refuse makes the apply fail permanently for these stream sequences.
	refuse map[uint64]bool
}

const appliedDDL = `CREATE TABLE public.applied (stream_seq bigint NOT NULL, correlation_id text NOT NULL, row jsonb NOT NULL)`

func (a *applier) apply(ctx context.Context, tx pgx.Tx, e quarantine.Entry) error {
	if a.refuse[e.StreamSeq] {
		return quarantine.Permanent(quarantine.CategoryIncompatible, errors.New("refused by test"))
	}
	ev, err := a.dec.Decode(e.Data)
	if err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, `INSERT INTO public.applied (stream_seq, correlation_id, row) VALUES ($1, $2, $3)`,
		int64(e.StreamSeq), ev.CorrelationID(), []byte(ev.Row)); err != nil {
		return fmt.Errorf("apply %s: %w", ev.QualifiedTable(), err)
	}
	a.mu.Lock()
	a.seq = append(a.seq, e.StreamSeq)
	a.mu.Unlock()
	return nil
}

func appliedCount(t *testing.T, pool *pgxpool.Pool, seq uint64) int {
	t.Helper()
	var n int
	require.NoError(t, pool.QueryRow(context.Background(),
		`SELECT count(*) FROM public.applied WHERE stream_seq = $1`, int64(seq)).Scan(&n))
	return n
}

// v2Body is delete event in an imagined wire version 2 that renamed "row"
// to "image"; upgradeV2 teaches it.
func v2Body(t *testing.T, id int) []byte {
	var m map[string]any
	require.NoError(t, json.Unmarshal(deleteBody(t, id, fmt.Sprintf(`{"id":%d,"note":"v2"}`, id)), &m))
	m["v"], m["image"] = 2, m["row"]
	delete(m, "row")
	b, err := json.Marshal(m)
	require.NoError(t, err)
	return b
}

func upgradeV2(b []byte) ([]byte, error) {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, err
	}
	m["v"], m["row"] = json.RawMessage("1"), m["image"]
	delete(m, "image")
	return json.Marshal(m)
}

func TestReplay(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := setup(t)
	_, err := pool.Exec(ctx, appliedDDL)
	require.NoError(t, err)

	insert(t, pool, entry(20, quarantine.CategoryUnknownVersion, v2Body(t, 1)))
	insert(t, pool, entry(21, quarantine.CategoryMalformed, []byte("not json at all")))
	// A row jsonb refuses (\u0000): incompatible on every attempt.
	insert(t, pool, entry(22, quarantine.CategoryIncompatible, deleteBody(t, 3, `{"id":3,"s":"a\u0000b"}`)))
	insert(t, pool, entry(23, quarantine.CategoryUnknownVersion, v2Body(t, 4)))
	recs, err := quarantine.List(ctx, pool, quarantine.Filter{})
	require.NoError(t, err)
	ids := map[uint64]int64{}
	for _, r := range recs {
		ids[r.StreamSeq] = r.ID
	}

	// With the old code the v2 entry still fails: it stays open, attempts+1.
	old := &applier{dec: &event.Decoder{}}
	res, err := quarantine.Replay(ctx, pool, quarantine.Selection{ID: ids[20]}, old.apply)
	require.NoError(t, err)
	require.Equal(t, []int64{ids[20]}, res.Failed)
	r, err := quarantine.Show(ctx, pool, ids[20], false)
	require.NoError(t, err)
	require.Equal(t, quarantine.StatusOpen, r.Status)
	require.Equal(t, 2, r.Attempts)
	require.Equal(t, string(quarantine.CategoryUnknownVersion), r.Category)
	require.Zero(t, appliedCount(t, pool, 20))

	// Taught v2, replay every open entry: in stream order, each v2 event
	// applied exactly once, the others stay open with their new error.
	taught := &applier{dec: &event.Decoder{Upgraders: map[int]func([]byte) ([]byte, error){2: upgradeV2}}}
	res, err = quarantine.Replay(ctx, pool, quarantine.Selection{}, taught.apply)
	require.NoError(t, err)
	require.Equal(t, []int64{ids[20], ids[23]}, res.Replayed)
	require.Equal(t, []int64{ids[21], ids[22]}, res.Failed)
	require.Equal(t, []uint64{20, 23}, taught.seq)
	require.Equal(t, 1, appliedCount(t, pool, 20))
	require.Equal(t, 1, appliedCount(t, pool, 23))
	var row string
	require.NoError(t, pool.QueryRow(ctx, `SELECT row::text FROM public.applied WHERE stream_seq = 20`).Scan(&row))
	require.JSONEq(t, `{"id":1,"note":"v2"}`, row)

	done, err := quarantine.Show(ctx, pool, ids[20], false)
	require.NoError(t, err)
	require.Equal(t, quarantine.StatusReplayed, done.Status)
	require.NotNil(t, done.ResolvedAt)
	bad, err := quarantine.Show(ctx, pool, ids[22], false)
	require.NoError(t, err)
	require.Equal(t, quarantine.StatusOpen, bad.Status)
	require.Equal(t, string(quarantine.CategoryIncompatible), bad.Category)
	require.Contains(t, bad.Error, "SQLSTATE 22P05")
	require.Equal(t, 2, bad.Attempts)

	// Replaying again applies nothing twice.
	_, err = quarantine.Replay(ctx, pool, quarantine.Selection{ID: ids[20]}, taught.apply)
	require.ErrorIs(t, err, quarantine.ErrNotOpen)
	res, err = quarantine.Replay(ctx, pool, quarantine.Selection{Filter: quarantine.Filter{Category: quarantine.CategoryUnknownVersion}}, taught.apply)
	require.NoError(t, err)
	require.Empty(t, res.Replayed)
	require.Equal(t, 1, appliedCount(t, pool, 20))

	// A transient failure stops the replay and leaves the entry untouched.
	transient := func(context.Context, pgx.Tx, quarantine.Entry) error {
		return fmt.Errorf("apply: %w", context.DeadlineExceeded)
	}
	_, err = quarantine.Replay(ctx, pool, quarantine.Selection{ID: ids[21]}, transient)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	still, err := quarantine.Show(ctx, pool, ids[21], false)
	require.NoError(t, err)
	require.Equal(t, 2, still.Attempts)
}

func TestConcurrentReplayAppliesOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := setup(t)
	_, err := pool.Exec(ctx, appliedDDL)
	require.NoError(t, err)
	insert(t, pool, entry(30, quarantine.CategoryUnknownVersion, v2Body(t, 1)))
	recs, err := quarantine.List(ctx, pool, quarantine.Filter{})
	require.NoError(t, err)
	id := recs[0].ID

	a := &applier{dec: &event.Decoder{Upgraders: map[int]func([]byte) ([]byte, error){2: upgradeV2}}}
	const n = 4
	errs := make(chan error, n)
	for i := 0; i < n; i++ {
		go func() {
			_, err := quarantine.Replay(ctx, pool, quarantine.Selection{ID: id}, a.apply)
			errs <- err
		}()
	}
	ok := 0
	for i := 0; i < n; i++ {
		if err := <-errs; err == nil {
			ok++
		} else {
			require.ErrorIs(t, err, quarantine.ErrNotOpen)
		}
	}
	require.Equal(t, 1, ok)
	require.Equal(t, 1, appliedCount(t, pool, 30))
}

func TestHoldKeepsOrderPerRow(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := setup(t)
	_, err := pool.Exec(ctx, appliedDDL)
	require.NoError(t, err)

	held := func(key string) bool {
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(ctx) //nolint:errcheck
		h, err := quarantine.Held(ctx, tx, quarantine.HeldRow{Projection: "archive", Version: 1, Schema: "public", Table: "orders", Key: []byte(key)})
		require.NoError(t, err)
		return h
	}
	require.False(t, held(`{"id":1}`))
	insert(t, pool, entry(40, quarantine.CategoryIncompatible, deleteBody(t, 1, `{"id":1,"n":1}`)))
	require.True(t, held(`{"id":1}`))
	require.True(t, held(` { "id" : 1 } `), "keys compare as jsonb")
	require.False(t, held(`{"id":2}`))
	require.False(t, held(`null`))
	require.False(t, held(`{"id":"a\u0000"}`))

	// Later events of row 1 are held behind entry 40; row 2 is independent.
	insert(t, pool, entry(41, quarantine.CategoryHeld, deleteBody(t, 1, `{"id":1,"n":2}`)))
	insert(t, pool, entry(42, quarantine.CategoryIncompatible, deleteBody(t, 2, `{"id":2}`)))
	insert(t, pool, entry(43, quarantine.CategoryHeld, deleteBody(t, 1, `{"id":1,"n":3}`)))
	recs, err := quarantine.List(ctx, pool, quarantine.Filter{})
	require.NoError(t, err)
	ids := map[uint64]int64{}
	for _, r := range recs {
		ids[r.StreamSeq] = r.ID
	}

	// Entry 40 still fails: the held ones stay behind it, untouched.
	a := &applier{dec: &event.Decoder{}, refuse: map[uint64]bool{40: true}}
	res, err := quarantine.Replay(ctx, pool, quarantine.Selection{}, a.apply)
	require.NoError(t, err)
	require.Equal(t, []int64{ids[42]}, res.Replayed)
	require.Equal(t, []int64{ids[40]}, res.Failed)
	require.Equal(t, []int64{ids[41], ids[43]}, res.Held)
	res, err = quarantine.Replay(ctx, pool, quarantine.Selection{ID: ids[43]}, a.apply)
	require.NoError(t, err)
	require.Equal(t, []int64{ids[43]}, res.Held)

	// Fixed: released in stream order.
	a.refuse = nil
	res, err = quarantine.Replay(ctx, pool, quarantine.Selection{}, a.apply)
	require.NoError(t, err)
	require.Equal(t, []int64{ids[40], ids[41], ids[43]}, res.Replayed)
	require.Equal(t, []uint64{42, 40, 41, 43}, a.seq)
	require.False(t, held(`{"id":1}`))

	// A re-delivered event behind itself keeps its own category.
	e := entry(40, quarantine.CategoryHeld, nil)
	insert(t, pool, e)
	r, err := quarantine.Show(ctx, pool, ids[40], false)
	require.NoError(t, err)
	require.Equal(t, string(quarantine.CategoryIncompatible), r.Category)
}

func TestStatsAndCollector(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := setup(t)

	reg := prometheus.NewRegistry()
	reg.MustRegister(quarantine.NewCollector(pool, nil))
	gauges := func() map[string]float64 {
		mfs, err := reg.Gather()
		require.NoError(t, err)
		out := map[string]float64{}
		for _, mf := range mfs {
			for _, m := range mf.GetMetric() {
				lbl := map[string]string{}
				for _, l := range m.GetLabel() {
					lbl[l.GetName()] = l.GetValue()
				}
				out[fmt.Sprintf("%s{%s,%s}", mf.GetName(), lbl["projection"], lbl["version"])] = m.GetGauge().GetValue()
			}
		}
		return out
	}
	require.Empty(t, gauges())

	insert(t, pool, entry(1, quarantine.CategoryMalformed, []byte("x")))
	insert(t, pool, entry(2, quarantine.CategoryMalformed, []byte("y")))
	insert(t, pool, entry(3, quarantine.CategoryUnknownVersion, []byte(`{"v":2}`)))
	v2 := entry(1, quarantine.CategoryInvalid, []byte(`{"v":1}`))
	v2.Version = 2
	insert(t, pool, v2)
	_, err := pool.Exec(ctx, `UPDATE epitaph.quarantine SET first_seen = now() - interval '1 hour' WHERE stream_seq = 2 AND version = 1`)
	require.NoError(t, err)

	stats, err := quarantine.Stats(ctx, pool)
	require.NoError(t, err)
	require.Len(t, stats, 2)
	s := stats[0]
	require.Equal(t, "archive", s.Projection)
	require.Equal(t, 1, s.Version)
	require.Equal(t, 3, s.Unresolved)
	require.Equal(t, map[quarantine.Category]int{quarantine.CategoryMalformed: 2, quarantine.CategoryUnknownVersion: 1}, s.ByCategory)
	require.InDelta(t, time.Hour.Seconds(), s.OldestAge.Seconds(), 60)
	require.Equal(t, 1, stats[1].Unresolved)

	g := gauges()
	require.Equal(t, 3.0, g["epitaph_projector_quarantine_unresolved{archive,1}"])
	require.Equal(t, 1.0, g["epitaph_projector_quarantine_unresolved{archive,2}"])
	require.InDelta(t, 3600, g["epitaph_projector_quarantine_oldest_age_seconds{archive,1}"], 60)

	// Resolving everything of version 2 brings its gauges to zero.
	recs, err := quarantine.List(ctx, pool, quarantine.Filter{Version: 2})
	require.NoError(t, err)
	require.NoError(t, quarantine.Discard(ctx, pool, recs[0].ID, "test"))
	g = gauges()
	require.Equal(t, 0.0, g["epitaph_projector_quarantine_unresolved{archive,2}"])
	require.Equal(t, 0.0, g["epitaph_projector_quarantine_oldest_age_seconds{archive,2}"])
}
