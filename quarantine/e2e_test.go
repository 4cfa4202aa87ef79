package quarantine_test

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/trust"
	"github.com/epitaph-dev/epitaph/quarantine"
)

// Quarantine end to end through the real projector runtime: garbage, a "v":2
// row, a row the read model rejects (jsonb refuses \u0000) and a valid
// transaction behind each are published to one partition with a plain NATS
// client. The valid rows are archived, the bad events are quarantined with
// their categories, the partition's lag returns to zero and the version is
// "quarantined". Taught v2, replay archives the v2 row exactly once; the
// others stay open until discarded, and then the version is healthy again.
func TestEndToEndQuarantineAndReplay(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const src = "main"
	url := testenv.NewDatabase(t)
	ns := testenv.NewNATS(t)
	nc, js := ns.Connect(t)
	testenv.NewSourceStream(t, js, src)

	// Plain core-NATS publishes, as anyone could: the stream stores them.
	published := 0
	publish := func(m *nats.Msg) {
		require.NoError(t, nc.PublishMsg(m))
		published++
	}
	lsn := event.LSN(0x5000000)
	ctime := time.Date(2026, 11, 30, 9, 0, 0, 0, time.UTC)
	// tx publishes one transaction: its rows (each body may be altered) and
	// its commit.
	tx := func(alter func(seq int, body []byte) []byte, images ...string) event.LSN {
		lsn += 0x100
		for _, m := range testenv.OrdersTx(t, src, lsn, ctime, alter, images...) {
			publish(m)
		}
		return lsn
	}
	junk := nats.NewMsg(event.CommitSubject(src, 0))
	junk.Data = []byte("\x00\xffnot json at all")
	junk.Header.Set(event.HeaderMsgID, "garbage-1")

	publish(junk)                                                                        // seq 1
	tx(nil, `{"id":1,"total":"10.00"}`)                                                  // seq 2-3
	v2 := tx(testenv.FirstRowV2, `{"id":2,"total":"20.00"}`, `{"id":20,"total":"0.50"}`) // seq 4-6: row 0 is v2
	tx(nil, `{"id":3,"total":"30.00"}`)                                                  // seq 7-8
	tx(nil, `{"id":4,"note":"nul \u0000 inside"}`)                                       // seq 9-10: jsonb refuses
	tx(nil, `{"id":5,"total":"50.00"}`)                                                  // seq 11-12
	require.NoError(t, nc.Flush())
	require.Eventually(t, func() bool {
		info, err := js.Stream(ctx, event.StreamName(src))
		return err == nil && info.CachedInfo().State.Msgs == uint64(published)
	}, 10*time.Second, 20*time.Millisecond)

	// The stream is written before signing, as an operator says with
	// projector trust-key --legacy-boundary: its unsigned messages up to
	// here are believed.
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	require.NoError(t, migrations.Apply(ctx, pool))
	require.NoError(t, trust.RecordLegacyBoundary(ctx, pool, event.StreamName(src), 0, uint64(published)))

	svc, err := projection.New(projection.Config{
		TargetURL: url, NATSURL: ns.URL, SourceName: src, WorkerID: "w1",
		LeaseTTL: 3 * time.Second, BalanceInterval: 300 * time.Millisecond, FetchWait: 100 * time.Millisecond,
		StatusInterval: 300 * time.Millisecond, MaxBackoff: time.Second,
	}, projection.WithLogger(slog.New(slog.DiscardHandler)), projection.WithRegistry(prometheus.NewRegistry()))
	require.NoError(t, err)
	require.NoError(t, svc.Start(ctx))
	t.Cleanup(func() { require.NoError(t, svc.Stop(context.Background())) })

	count := func(sql string, args ...any) int {
		var n int
		if err := pool.QueryRow(ctx, sql, args...).Scan(&n); err != nil {
			return -1
		}
		return n
	}
	archived := func(id int) int {
		return count(`SELECT count(*) FROM archive.rows WHERE key = jsonb_build_object('id', $1::int)`, id)
	}

	// The valid rows are archived, around and after every bad event.
	require.Eventually(t, func() bool {
		return count(`SELECT count(*) FROM archive.rows`) == 4 && count(`SELECT count(*) FROM epitaph.quarantine`) == 3
	}, 30*time.Second, 50*time.Millisecond)
	for _, id := range []int{1, 20, 3, 5} {
		require.Equal(t, 1, archived(id), "row %d", id)
	}
	require.Zero(t, archived(2))
	recs, err := quarantine.List(ctx, pool, quarantine.Filter{Projection: archive.Projection, Version: 1})
	require.NoError(t, err)
	require.Len(t, recs, 3)
	got := map[uint64]string{}
	for _, r := range recs {
		got[r.StreamSeq] = r.Category
		require.Equal(t, 0, r.Partition)
		require.Equal(t, 1, r.Attempts)
		require.NotContains(t, r.Error, "inside", "no row values in the error")
	}
	require.Equal(t, map[uint64]string{1: "malformed", 4: "unknown_version", 9: "incompatible"}, got)
	garbage, err := quarantine.Show(ctx, pool, recs[0].ID, true)
	require.NoError(t, err)
	require.Equal(t, []byte("\x00\xffnot json at all"), garbage.Data, "the raw bytes are kept")
	require.Equal(t, []string{"garbage-1"}, garbage.Headers[event.HeaderMsgID])

	// The partition moved past them: lag back to zero, cursor at the end,
	// health says quarantined, the gauges say so too.
	require.Eventually(t, func() bool {
		st, err := svc.Status(ctx)
		return err == nil && len(st.Versions) == 1 && st.StreamLast == uint64(published) &&
			st.Versions[0].LagEvents == 0 && st.Versions[0].Health == "quarantined" && st.Versions[0].QuarantineOpen == 3
	}, 20*time.Second, 100*time.Millisecond)
	require.Equal(t, published, count(`SELECT cursor FROM epitaph.progress WHERE projection = 'archive' AND version = 1 AND partition = 0`))
	require.Equal(t, 3.0, gauge(t, svc.Registry(), "epitaph_projector_quarantine_unresolved", "archive", "1"))

	// Taught v2 through the runtime's replay hook: exactly once.
	apply := projection.ReplayFunc(projection.ReplayConfig{Decoder: testenv.V2Decoder()})
	res, err := quarantine.Replay(ctx, pool, quarantine.Selection{Filter: quarantine.Filter{Projection: "archive"}}, apply)
	require.NoError(t, err)
	require.Len(t, res.Replayed, 1)
	require.Len(t, res.Failed, 2, "garbage and the rejected row still fail")
	require.Equal(t, 1, archived(2))
	var isRoot *bool
	require.NoError(t, pool.QueryRow(ctx, `SELECT is_root FROM archive.rows WHERE key = '{"id":2}'`).Scan(&isRoot))
	require.NotNil(t, isRoot, "its transaction was complete: roots recomputed")
	require.Equal(t, event.CorrelationID(src, int64(v2)/16, v2), func() string {
		var c string
		require.NoError(t, pool.QueryRow(ctx, `SELECT correlation_id FROM archive.rows WHERE key = '{"id":2}'`).Scan(&c))
		return c
	}())

	res, err = quarantine.Replay(ctx, pool, quarantine.Selection{Filter: quarantine.Filter{Projection: "archive"}}, apply)
	require.NoError(t, err)
	require.Empty(t, res.Replayed)
	_, err = quarantine.Replay(ctx, pool, quarantine.Selection{ID: res.Failed[0]}, apply)
	require.NoError(t, err)
	require.Equal(t, 1, archived(2), "replayed exactly once")
	require.Equal(t, 5, count(`SELECT count(*) FROM archive.rows`))

	// Discarding the rest resolves the version's quarantine.
	for _, id := range res.Failed {
		require.NoError(t, quarantine.Discard(ctx, pool, id, "bad publish, checked by hand"))
	}
	require.Eventually(t, func() bool {
		st, err := svc.Status(ctx)
		return err == nil && len(st.Versions) == 1 && st.Versions[0].QuarantineOpen == 0 && st.Versions[0].Health != "quarantined"
	}, 20*time.Second, 100*time.Millisecond)
	require.Equal(t, 0.0, gauge(t, svc.Registry(), "epitaph_projector_quarantine_unresolved", "archive", "1"))
	require.Equal(t, 3, count(`SELECT count(*) FROM epitaph.quarantine WHERE status <> 'open'`), "audit records kept")
}

// gauge reads one series of a gauge by its projection and version labels.
func gauge(t *testing.T, reg *prometheus.Registry, name, projection, version string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			lbl := map[string]string{}
			for _, l := range m.GetLabel() {
				lbl[l.GetName()] = l.GetValue()
			}
			if lbl["projection"] == projection && lbl["version"] == version {
				return m.GetGauge().GetValue()
			}
		}
	}
	require.FailNow(t, "no such series", "%s{projection=%q,version=%q}", name, projection, version)
	return 0
}
