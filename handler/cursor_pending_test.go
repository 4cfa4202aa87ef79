package handler

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
)

// gather scrapes a registry: metric{labels} -> value.
func gather(t *testing.T, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
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
	return got
}

// statsOf is one handler's stats by state.
func statsOf(stats []Stat, id string) map[string]Stat {
	out := map[string]Stat{}
	for _, s := range stats {
		if s.HandlerID == id {
			out[s.State] = s
		}
	}
	return out
}

// A cursor handler's pending deliveries are the archived rows of its table
// after its cursor, with no row in epitaph.deliveries: Stats, the metrics'
// StatsReader (and so the backlog alert's metric) and the deliveries list
// count and show them, with the oldest one's age; its claimed batch is in
// flight (with its attempt), pending again while it waits for its retry,
// and nothing is left once the batches succeed.
func TestCursorHandlerBacklogIsCountedAndListed(t *testing.T) {
	e := newCursorEnv(t)
	ctx := context.Background()
	secret := NewSecret()
	br, srv := newBatchReceiver(t, secret, func(n int) int {
		if n == 1 {
			return 503
		}
		return 200
	})
	def := Def{ID: newUUID(), Schema: "public", Table: "orders", Kind: KindWebhook, Target: srv.URL, MaxAttempts: 5,
		Backoff: time.Millisecond, ClaimTimeout: 30 * time.Second, BatchSize: 3, BatchWait: time.Second,
		SecretFile: writeSecret(t, secret)}
	require.NoError(t, Add(ctx, e.pool, def))
	require.True(t, def.UsesCursor())
	other := Def{ID: newUUID(), Schema: "public", Table: "customers", Kind: KindWebhook, Target: srv.URL, MaxAttempts: 5,
		Backoff: time.Millisecond, ClaimTimeout: 30 * time.Second, BatchSize: 3, BatchWait: time.Second,
		SecretFile: writeSecret(t, secret)}
	require.NoError(t, Add(ctx, e.pool, other))

	lsns := e.archive("orders", true, 1, 2, 3, 4)
	e.archive("customers", true, 9)
	unverified := e.archive("orders", false, 5) // pending too: it waits for its commit
	_, err := e.pool.Exec(ctx, `UPDATE archive_v1.rows SET archived_at = now() - interval '1 hour' WHERE table_name = 'orders'`)
	require.NoError(t, err)

	// Nothing is behind the horizon yet: the rows wait, and are counted.
	stats, err := Stats(ctx, e.pool)
	require.NoError(t, err)
	s := statsOf(stats, def.ID)
	require.Equal(t, int64(5), s[StatePending].Count, "%+v", stats)
	require.False(t, s[StatePending].AtLeast)
	require.GreaterOrEqual(t, s[StatePending].OldestAge, time.Hour-time.Minute)
	require.Equal(t, int64(1), statsOf(stats, other.ID)[StatePending].Count, "the other table's handler: its one row")

	reg := prometheus.NewRegistry()
	require.NoError(t, reg.Register(NewCollector(e.pool, nil)))
	got := gather(t, reg)
	require.Equal(t, 5.0, got["epitaph_projector_deliveries{handler="+def.ID+",state=pending}"], "%v", got)
	require.Greater(t, got["epitaph_projector_delivery_oldest_pending_age_seconds{handler="+def.ID+"}"], 1800.0,
		"EpitaphDeliveryBacklog (oldest pending > 30 min) fires: %v", got)

	list, err := ListCursorDeliveries(ctx, e.pool, Filter{HandlerID: def.ID, State: StatePending})
	require.NoError(t, err)
	want := []string{DeliveryID(def.ID, "main", unverified[0], 0, 0)}
	for i := len(lsns) - 1; i >= 0; i-- {
		want = append(want, DeliveryID(def.ID, "main", lsns[i], 0, 0))
	}
	require.Equal(t, want, infoIDs(list), "newest first, with the ids their deliveries get")
	require.Equal(t, `{"id": 4}`, string(list[1].Key))
	require.False(t, list[0].Verified)
	require.Equal(t, "orders", list[0].Table)
	list, err = ListCursorDeliveries(ctx, e.pool, Filter{HandlerID: def.ID, State: StateDead})
	require.NoError(t, err)
	require.Empty(t, list, "no dead ones among the rows after the cursor")

	// A claimed batch is in flight, with its attempt.
	e.horizon(lsns[3])
	d, err := NewDispatcher(e.pool, Config{Poll: 20 * time.Millisecond})
	require.NoError(t, err)
	live, err := d.live(ctx)
	require.NoError(t, err)
	claimedAt := time.Now()
	send, tok, _, _, err := d.cursorClaim(ctx, def, live)
	require.NoError(t, err)
	require.Len(t, send, 3)
	stats, err = Stats(ctx, e.pool)
	require.NoError(t, err)
	s = statsOf(stats, def.ID)
	require.Equal(t, int64(3), s[StateInFlight].Count)
	require.Equal(t, int64(2), s[StatePending].Count)
	list, err = ListCursorDeliveries(ctx, e.pool, Filter{HandlerID: def.ID, State: StateInFlight})
	require.NoError(t, err)
	require.Equal(t, []string{want[3], want[4]}, infoIDs(list)[1:])
	require.Equal(t, 1, list[0].Attempt)
	require.NotNil(t, list[0].ClaimExpiresAt)
	got = gather(t, reg)
	require.Equal(t, 3.0, got["epitaph_projector_deliveries{handler="+def.ID+",state=in_flight}"], "%v", got)

	// Refused: the batch waits for its retry, pending with its attempt.
	require.NoError(t, d.cursorSend(ctx, def, live, send, tok, claimedAt))
	require.Len(t, br.got(), 1)
	stats, err = Stats(ctx, e.pool)
	require.NoError(t, err)
	s = statsOf(stats, def.ID)
	require.Equal(t, int64(5), s[StatePending].Count)
	require.Zero(t, s[StateInFlight].Count)
	list, err = ListCursorDeliveries(ctx, e.pool, Filter{HandlerID: def.ID})
	require.NoError(t, err)
	require.Len(t, list, 5)
	require.Equal(t, []int{0, 0, 1, 1, 1}, []int{list[0].Attempt, list[1].Attempt, list[2].Attempt, list[3].Attempt, list[4].Attempt})
	require.Equal(t, StatePending, list[2].State)

	// Sent: the verified rows are done, the unverified one still pending.
	time.Sleep(5 * time.Millisecond)
	e.flush(d)
	stats, err = Stats(ctx, e.pool)
	require.NoError(t, err)
	s = statsOf(stats, def.ID)
	require.Equal(t, int64(4), s[StateDone].Count)
	require.Equal(t, int64(1), s[StatePending].Count)
	_, err = e.pool.Exec(ctx, `UPDATE archive_v1.rows SET verified = true`)
	require.NoError(t, err)
	e.horizon(unverified[0])
	e.flush(d)
	stats, err = Stats(ctx, e.pool)
	require.NoError(t, err)
	s = statsOf(stats, def.ID)
	require.Zero(t, s[StatePending].Count)
	require.Zero(t, s[StatePending].OldestSec)
	got = gather(t, reg)
	require.Equal(t, 0.0, got["epitaph_projector_deliveries{handler="+def.ID+",state=pending}"], "%v", got)
	require.Equal(t, 0.0, got["epitaph_projector_delivery_oldest_pending_age_seconds{handler="+def.ID+"}"], "%v", got)
}

// A backlog larger than CursorCountCap is counted up to the cap and said
// to be at least that.
func TestCursorHandlerBacklogBeyondTheCapIsALowerBound(t *testing.T) {
	e := newCursorEnv(t)
	ctx := context.Background()
	def := Def{ID: newUUID(), Schema: "public", Table: "orders", Kind: KindWebhook, Target: "https://example.invalid/hook",
		MaxAttempts: 5, Backoff: time.Second, ClaimTimeout: 30 * time.Second, BatchSize: 100, BatchWait: time.Second}
	require.NoError(t, Add(ctx, e.pool, def))
	_, err := e.pool.Exec(ctx, `INSERT INTO archive_v1.rows (source, schema_name, table_name, key, row, correlation_id,
		commit_lsn, commit_time, seq, archived_at)
		SELECT 'main', 'public', 'orders', jsonb_build_object('id', g), jsonb_build_object('id', g), 'main:' || g,
		       ('1/' || to_hex(g))::pg_lsn, now(), 0, now() - make_interval(secs => $1::int - g)
		FROM generate_series(1, $1::int) g`, CursorCountCap+5)
	require.NoError(t, err)
	stats, err := Stats(ctx, e.pool)
	require.NoError(t, err)
	s := statsOf(stats, def.ID)[StatePending]
	require.Equal(t, int64(CursorCountCap), s.Count)
	require.True(t, s.AtLeast)
	require.Greater(t, s.OldestSec, float64(CursorCountCap), "the oldest row's age")
	r := NewStatsReader(e.pool, time.Minute, nil)
	stats, err = r.Read(ctx)
	require.NoError(t, err)
	require.True(t, statsOf(stats, def.ID)[StatePending].AtLeast)
}

// A claimed batch whose claim expired (its dispatcher died) is not in
// flight: its rows are pending, with their attempt, and their age counts
// for the backlog.
func TestCursorHandlerExpiredClaimIsPending(t *testing.T) {
	e := newCursorEnv(t)
	ctx := context.Background()
	def := Def{ID: newUUID(), Schema: "public", Table: "orders", Kind: KindWebhook, Target: "https://example.invalid/hook",
		MaxAttempts: 5, Backoff: time.Second, ClaimTimeout: 500 * time.Millisecond, BatchSize: 2, BatchWait: 50 * time.Millisecond}
	require.NoError(t, Add(ctx, e.pool, def))
	lsns := e.archive("orders", true, 1, 2)
	_, err := e.pool.Exec(ctx, `UPDATE archive_v1.rows SET archived_at = now() - interval '1 hour'`)
	require.NoError(t, err)
	e.horizon(lsns[1])
	d, err := NewDispatcher(e.pool, Config{})
	require.NoError(t, err)
	live, err := d.live(ctx)
	require.NoError(t, err)
	send, _, _, _, err := d.cursorClaim(ctx, def, live) // claimed, never sent: the dispatcher died
	require.NoError(t, err)
	require.Len(t, send, 2)
	stats, err := Stats(ctx, e.pool)
	require.NoError(t, err)
	s := statsOf(stats, def.ID)
	require.Equal(t, int64(2), s[StateInFlight].Count)
	require.Zero(t, s[StatePending].Count)

	time.Sleep(600 * time.Millisecond)
	stats, err = Stats(ctx, e.pool)
	require.NoError(t, err)
	s = statsOf(stats, def.ID)
	require.Zero(t, s[StateInFlight].Count)
	require.Equal(t, int64(2), s[StatePending].Count)
	require.Greater(t, s[StatePending].OldestSec, 1800.0)
	list, err := ListCursorDeliveries(ctx, e.pool, Filter{HandlerID: def.ID, State: StatePending})
	require.NoError(t, err)
	require.Len(t, list, 2)
	require.Equal(t, 1, list[0].Attempt)
}

func infoIDs(is []Info) []string {
	out := make([]string, len(is))
	for i, x := range is {
		out[i] = x.ID
	}
	return out
}
