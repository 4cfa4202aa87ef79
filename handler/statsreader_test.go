package handler

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
)

// statCounts is stats as "handler/state" -> count (handlers without
// deliveries as "handler/").
func statCounts(stats []Stat) map[string]int64 {
	out := map[string]int64{}
	for _, s := range stats {
		out[s.HandlerID+"/"+s.State] += s.Count
	}
	return out
}

// The metrics' reader counts pending, in-flight and dead deliveries
// exactly at every read, through partial indexes only, and the done and
// stopped ones in the background, as of a count at most its refresh old;
// every count equals the full scan's (Stats), and a handler without
// deliveries is listed.
func TestStatsReaderCountsOpenAtOnceAndFinishedInTheBackground(t *testing.T) {
	e := newTenv(t)
	ctx := context.Background()
	a := e.addHandler(KindGo, "noop")
	b := e.addHandler(KindGo, "noop")
	idle := e.addHandler(KindGo, "noop", func(d *Def) { d.Table = "customers" })
	rows := make([]Row, 40)
	for i := range rows {
		rows[i] = e.row(i)
	}
	e.enqueue(1, rows...)
	unreleased := e.row(100)
	unreleased.Committed = false // after-group or not yet committed: pending, not released
	e.enqueue(1, unreleased)
	set := func(handler, state string, n int) {
		t.Helper()
		extra := ""
		switch state {
		case StateInFlight:
			extra = ", claim_token = gen_random_uuid(), claim_expires_at = now() + interval '1 minute'"
		case StateDone, StateStopped, StateDead:
			extra = ", settled_at = now(), outcome = 'test'"
		}
		tag, err := e.pool.Exec(ctx, `UPDATE epitaph.deliveries SET state = $2`+extra+`
			WHERE id IN (SELECT id FROM epitaph.deliveries WHERE handler_id = $1 AND state = 'pending' AND released_at IS NOT NULL
			             ORDER BY commit_lsn LIMIT $3)`, handler, state, n)
		require.NoError(t, err)
		require.EqualValues(t, n, tag.RowsAffected())
	}
	set(a.ID, StateInFlight, 3)
	set(a.ID, StateDead, 2)
	set(a.ID, StateDone, 20)
	set(a.ID, StateStopped, 5)
	set(b.ID, StateDone, 10)
	set(b.ID, StateDead, 1)

	exact := func() map[string]int64 {
		t.Helper()
		s, err := Stats(ctx, e.pool)
		require.NoError(t, err)
		return statCounts(s)
	}
	onlyOpen := func(m map[string]int64) map[string]int64 {
		out := map[string]int64{}
		for k, v := range m {
			if !strings.HasSuffix(k, "/"+StateDone) && !strings.HasSuffix(k, "/"+StateStopped) {
				out[k] = v
			}
		}
		return out
	}
	want := exact()
	require.Equal(t, map[string]int64{
		a.ID + "/pending": 41 - 30, a.ID + "/in_flight": 3, a.ID + "/dead": 2, a.ID + "/done": 20, a.ID + "/stopped": 5,
		b.ID + "/pending": 41 - 11, b.ID + "/dead": 1, b.ID + "/done": 10, idle.ID + "/": 0,
	}, want, "the full scan, as a reference")

	var mu sync.Mutex
	clock := time.Now()
	r := NewStatsReader(e.pool, time.Minute, e.log)
	r.now = func() time.Time { mu.Lock(); defer mu.Unlock(); return clock }
	waitCount := func() {
		t.Helper()
		r.mu.Lock()
		done := r.done
		r.mu.Unlock()
		require.NotNil(t, done, "a count was started")
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			t.Fatal("the count of finished deliveries did not end")
		}
	}

	// The first read: the open and dead ones at once; the finished ones
	// once the count it started has ended.
	got, err := r.Read(ctx)
	require.NoError(t, err)
	if c := statCounts(got); len(c) != len(want) {
		require.Equal(t, onlyOpen(want), c, "before the first count ends: open and dead only")
	}
	waitCount()
	got, err = r.Read(ctx)
	require.NoError(t, err)
	require.Equal(t, want, statCounts(got))
	for _, s := range got {
		if s.HandlerID == idle.ID {
			require.Equal(t, "public.customers", s.Table)
		}
	}

	// More finish: the open counts follow at once, the finished ones at
	// the next count after the refresh.
	set(b.ID, StateDone, 4)
	set(a.ID, StateDead, 1)
	want = exact()
	got, err = r.Read(ctx)
	require.NoError(t, err)
	stale := statCounts(got)
	require.Equal(t, onlyOpen(want), onlyOpen(stale), "open and dead: exact at every read")
	require.EqualValues(t, 10, stale[b.ID+"/done"], "done: as of the last count")
	mu.Lock()
	clock = clock.Add(time.Minute)
	mu.Unlock()
	_, err = r.Read(ctx) // starts the count
	require.NoError(t, err)
	waitCount()
	got, err = r.Read(ctx)
	require.NoError(t, err)
	require.Equal(t, want, statCounts(got))

	// The open and dead counts never read the table: with sequential
	// scans priced out, the plan has none on epitaph.deliveries.
	tx, err := e.pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, `SET LOCAL enable_seqscan = off`)
	require.NoError(t, err)
	var plan []string
	rs, err := tx.Query(ctx, `EXPLAIN `+openStatsSQL)
	require.NoError(t, err)
	for rs.Next() {
		var line string
		require.NoError(t, rs.Scan(&line))
		plan = append(plan, line)
	}
	require.NoError(t, rs.Err())
	text := strings.Join(plan, "\n")
	require.NotContains(t, text, "Seq Scan", "every branch served by a partial index:\n%s", text)
	for _, idx := range []string{"deliveries_due_idx", "deliveries_unreleased_idx", "deliveries_claims_idx", "deliveries_dead_idx"} {
		require.Contains(t, text, idx)
	}
}

// The collector exports the dead letters at the first scrape (the alert
// does not wait for the count of finished deliveries).
func TestCollectorExportsDeadLettersAtOnce(t *testing.T) {
	e := newTenv(t)
	ctx := context.Background()
	a := e.addHandler(KindGo, "noop")
	e.enqueue(1, e.row(1), e.row(2))
	_, err := e.pool.Exec(ctx, `UPDATE epitaph.deliveries SET state = 'dead', settled_at = now(), outcome = 'test'
		WHERE id = (SELECT id FROM epitaph.deliveries ORDER BY commit_lsn LIMIT 1)`)
	require.NoError(t, err)
	reg := prometheus.NewRegistry()
	require.NoError(t, reg.Register(NewCollector(e.pool, e.log)))
	mfs, err := reg.Gather()
	require.NoError(t, err)
	got := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			labels := []string{}
			for _, l := range m.GetLabel() {
				labels = append(labels, l.GetName()+"="+l.GetValue())
			}
			got[fmt.Sprintf("%s{%s}", mf.GetName(), strings.Join(labels, ","))] = m.GetGauge().GetValue()
		}
	}
	require.Equal(t, 1.0, got["epitaph_projector_deliveries{handler="+a.ID+",state=dead}"], "%v", got)
	require.Equal(t, 1.0, got["epitaph_projector_deliveries{handler="+a.ID+",state=pending}"], "%v", got)
	_, ok := got["epitaph_projector_delivery_oldest_pending_age_seconds{handler="+a.ID+"}"]
	require.True(t, ok, "%v", got)
}
