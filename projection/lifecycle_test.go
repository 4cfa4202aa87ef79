package projection_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/projection"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/status"
	"github.com/epitaph-dev/epitaph/projection/version"
)

func (e *env) pool() *pgxpool.Pool {
	e.t.Helper()
	p, err := pgxpool.New(context.Background(), e.url)
	require.NoError(e.t, err)
	e.t.Cleanup(p.Close)
	return p
}

func state(t *testing.T, p *pgxpool.Pool, n int) string {
	t.Helper()
	v, err := version.GetVersion(context.Background(), p, archive.Projection, n)
	require.NoError(t, err)
	return v.State
}

// sideEffects records which versions the side-effect hook was called for.
type sideEffects struct {
	mu     sync.Mutex
	byVer  map[int]int
	events atomic.Int64
}

func (s *sideEffects) hook(_ context.Context, p projection.SideEffectPage) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.byVer == nil {
		s.byVer = map[int]int{}
	}
	s.byVer[p.Version] += len(p.Events)
	s.events.Add(int64(len(p.Events)))
	return nil
}

func (s *sideEffects) calls(v int) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.byVer[v]
}

// traffic publishes delete transactions (and a heartbeat to every
// partition now and then) until stopped; it returns how many rows it
// published.
func (e *env) traffic(ctx context.Context, every time.Duration) (stop func() int) {
	var rows atomic.Int64
	done := make(chan struct{})
	ctx, cancel := context.WithCancel(ctx)
	go func() {
		defer close(done)
		for i := 0; ctx.Err() == nil; i++ {
			// A transaction is published whole, even when stopped midway,
			// and never interleaved with the test's own (e.pub).
			e.pub.Lock()
			tx := e.nextTx(orderRows(100000+i, 2)...)
			for _, m := range e.messages(tx) {
				if _, err := e.pubMsg(context.Background(), m); err != nil {
					e.pub.Unlock()
					e.t.Errorf("publish: %v", err)
					return
				}
			}
			rows.Add(int64(len(tx.rows)))
			if i%5 == 4 {
				lsn := event.LSN(e.lsn.Add(0x100))
				for p := 0; p < e.partitions; p++ {
					ev := &event.Event{Op: event.OpMark, Source: src, Partition: p, LSN: lsn, Kind: event.MarkHeartbeat, Time: time.Now()}
					if _, err := e.pubMsg(ctx, e.msg(event.MarkSubject(src, p), event.MarkMsgID(src, lsn, p), ev)); err != nil {
						e.pub.Unlock()
						return
					}
				}
			}
			e.pub.Unlock()
			select {
			case <-ctx.Done():
			case <-time.After(every):
			}
		}
	}()
	return func() int { cancel(); <-done; return int(rows.Load()) }
}

// The whole lifecycle under continuous delete traffic: a rebuild with a
// changed TTL policy moves building -> catching_up -> ready, compares
// equal except the intended expires_at difference, is promoted while a
// reader queries in a loop (no error, consistent counts), rolled back,
// rolled forward, and v1 is retired with --drop. Side effects run only for
// the live version.
func TestRebuildPromoteRollbackRetire(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 4)
	ctx := context.Background()
	fx := &sideEffects{}
	cfg := e.config("w1")
	cfg.SideEffects = fx.hook
	s1 := e.start(cfg)
	for i := 0; i < 30; i++ {
		e.publish(e.nextTx(orderRows(i+1, 2)...))
	}
	e.heartbeat()
	c := e.conn()
	pool := e.pool()
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 90 })
	require.NoError(t, s1.Stop(context.Background()))

	// The new code/configuration: order lines are kept 30 days.
	cfg = e.config("w2")
	cfg.SideEffects = fx.hook
	cfg.ArchiveTTL = map[string]time.Duration{"public.order_lines": 30 * 24 * time.Hour}
	s2 := e.start(cfg)
	trafficCtx, stopTrafficCtx := context.WithCancel(ctx)
	defer stopTrafficCtx()
	stopTraffic := e.traffic(trafficCtx, 20*time.Millisecond)

	v2, err := version.CreateVersion(ctx, pool, e.js, version.RebuildOptions{Source: src, Note: "test"})
	require.NoError(t, err)
	require.Equal(t, 2, v2.Version)
	require.Equal(t, "archive_v2", v2.Schema)
	require.Equal(t, version.StateBuilding, v2.State)
	require.NotNil(t, v2.BoundarySeq)
	require.Positive(t, *v2.BoundarySeq)
	require.NotZero(t, v2.BoundaryLSN)

	// It moves through the states on its own.
	seen := map[string]bool{}
	eventually(t, 60*time.Second, func() bool {
		st := state(t, pool, 2)
		seen[st] = true
		return st == version.StateReady
	})
	v2, err = version.GetVersion(ctx, pool, archive.Projection, 2)
	require.NoError(t, err)
	require.NotNil(t, v2.CatchingUpAt, "passed through catching_up")
	require.NotNil(t, v2.ReadyAt)
	require.False(t, v2.ReadyAt.Before(*v2.CatchingUpAt))
	require.False(t, v2.CatchingUpAt.Before(*v2.BuildingAt))
	require.Zero(t, fx.calls(2), "no side effects for a version being built")
	eventually(t, 10*time.Second, func() bool {
		return gauge(t, s2, "epitaph_projector_version_state", map[string]string{"version": "2", "state": "ready"}) == 1 &&
			gauge(t, s2, "epitaph_projector_version_progress_ratio", map[string]string{"version": "2"}) == 1 &&
			gauge(t, s2, "epitaph_projector_version_partitions_at_boundary", map[string]string{"version": "2"}) == 4 &&
			gauge(t, s2, "epitaph_projector_version_boundary_seq", map[string]string{"version": "2"}) == float64(*v2.BoundarySeq)
	}, "lifecycle metrics")
	require.Positive(t, fx.calls(1))
	require.Contains(t, viewTarget(t, c), "archive_v1.rows")

	// Compare: equal content; expires_at differs as intended.
	cmp, err := version.Compare(ctx, pool, version.CompareOptions{A: 1, B: 2})
	require.NoError(t, err)
	require.True(t, cmp.ContentEqual, "%+v", cmp)
	require.Positive(t, cmp.ExpiresAtDiffers)
	require.False(t, cmp.Equal)
	require.NotEmpty(t, cmp.DifferingKeys)
	for _, d := range cmp.DifferingKeys {
		require.Equal(t, "expires_at", d.What)
		require.Equal(t, "order_lines", d.Table)
	}
	require.NotEmpty(t, cmp.UpTo)
	cmp, err = version.Compare(ctx, pool, version.CompareOptions{A: 1, B: 2, IgnoreExpiresAt: true})
	require.NoError(t, err)
	require.True(t, cmp.Equal)
	require.Empty(t, cmp.DifferingKeys)

	// A reader in a loop during repeated switches: never an error, and the
	// rows both versions reflect are always all there.
	upTo, err := event.ParseLSN(cmp.UpTo)
	require.NoError(t, err)
	var want int
	require.NoError(t, c.QueryRow(ctx, `SELECT count(*) FROM archive_v1.rows WHERE commit_lsn <= $1::pg_lsn`, upTo.String()).Scan(&want))
	require.Positive(t, want)
	readerCtx, stopReader := context.WithCancel(ctx)
	var reads atomic.Int64
	readerErr := make(chan error, 1)
	go func() {
		rc := e.conn()
		for readerCtx.Err() == nil {
			var n int
			if err := rc.QueryRow(readerCtx, `SELECT count(*) FROM archive.rows WHERE commit_lsn <= $1::pg_lsn`, upTo.String()).Scan(&n); err != nil {
				if readerCtx.Err() != nil {
					break
				}
				readerErr <- err
				return
			}
			if n != want {
				readerErr <- fmt.Errorf("reader saw %d rows, want %d", n, want)
				return
			}
			reads.Add(1)
		}
		readerErr <- nil
	}()

	_, err = version.Promote(ctx, pool, archive.Projection, 3, false)
	require.ErrorIs(t, err, version.ErrNoVersion)
	prev, err := version.Promote(ctx, pool, archive.Projection, 2, false)
	require.NoError(t, err)
	require.Equal(t, 1, prev)
	require.Equal(t, version.StateLive, state(t, pool, 2))
	require.Equal(t, version.StateReady, state(t, pool, 1), "the old live version stays ready for a rollback")
	require.Contains(t, viewTarget(t, c), "archive_v2.rows")
	for i := 0; i < 5; i++ {
		from, to, err := version.Rollback(ctx, pool, archive.Projection, false)
		require.NoError(t, err)
		require.Equal(t, [2]int{2, 1}, [2]int{from, to})
		require.Contains(t, viewTarget(t, c), "archive_v1.rows")
		_, err = version.Promote(ctx, pool, archive.Projection, 2, false)
		require.NoError(t, err)
		require.Contains(t, viewTarget(t, c), "archive_v2.rows")
	}
	eventually(t, 10*time.Second, func() bool { return reads.Load() > 20 })
	stopReader()
	require.NoError(t, <-readerErr)

	// The live version runs side effects now (once the workers see it).
	before1 := fx.calls(1)
	eventually(t, 20*time.Second, func() bool { return fx.calls(2) > 0 })
	_ = before1

	// The live version cannot be retired; v1 can, with its schema.
	err = version.Retire(ctx, pool, e.js, archive.Projection, 2, version.RetireOptions{Source: src})
	require.Error(t, err)
	published := stopTraffic()
	v1 := make([]string, e.partitions)
	for p := range v1 {
		v1[p] = e.consumerName(1, p)
	}
	require.NoError(t, version.Retire(ctx, pool, e.js, archive.Projection, 1,
		version.RetireOptions{Source: src, Drop: true}))
	require.Equal(t, version.StateRetired, state(t, pool, 1))
	require.Equal(t, 0, count(t, c, `SELECT count(*) FROM pg_namespace WHERE nspname = 'archive_v1'`))
	require.Equal(t, 0, count(t, c, `SELECT count(*) FROM epitaph.progress WHERE version = 1`))
	stream, err := e.js.Stream(ctx, event.StreamName(src))
	require.NoError(t, err)
	for p := 0; p < e.partitions; p++ {
		_, err := stream.Consumer(ctx, v1[p])
		require.True(t, errors.Is(err, jetstream.ErrConsumerNotFound), "consumer of v1 p%d: %v", p, err)
	}
	// The archive is complete: every published row, exactly once.
	total := 90 + published
	eventually(t, 30*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == total },
		"want %d rows, have %d", total, count(t, c, `SELECT count(*) FROM archive.rows`))
	require.Equal(t, total, count(t, c, `SELECT count(DISTINCT (source, commit_lsn, seq)) FROM archive.rows`))
	require.Equal(t, 0, count(t, c, `SELECT count(*) FROM archive.rows WHERE table_name = 'order_lines' AND expires_at IS NULL`))
	require.Contains(t, viewTarget(t, c), "archive_v2.rows")
}

// A version other than the live one is never served: promote refuses it
// until ready unless forced, and rollback without a previous live version
// refuses.
func TestPromoteRefusesUnlessReady(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	ctx := context.Background()
	for i := 0; i < 5; i++ {
		e.publish(e.nextTx(orderRows(i+1, 1)...))
	}
	pool := e.pool()
	c := e.conn()
	// No worker yet: there is no version 1 to rebuild beside.
	_, err := version.CreateVersion(ctx, pool, e.js, version.RebuildOptions{Source: src})
	require.Error(t, err)
	cfg := e.config("w1")
	cfg.ReadyMaxLag = 1
	s := e.start(cfg)
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive.rows`) == 10 })
	require.NoError(t, s.Stop(context.Background())) // nothing builds v2
	_, _, err = version.Rollback(ctx, pool, archive.Projection, false)
	require.Error(t, err)

	v2, err := version.CreateVersion(ctx, pool, e.js, version.RebuildOptions{Source: src})
	require.NoError(t, err)
	_, err = version.Promote(ctx, pool, archive.Projection, v2.Version, false)
	require.ErrorIs(t, err, version.ErrNotReady)
	require.Contains(t, viewTarget(t, c), "archive_v1.rows")
	_, err = version.Promote(ctx, pool, archive.Projection, v2.Version, true)
	require.NoError(t, err)
	require.Contains(t, viewTarget(t, c), "archive_v2.rows")
	require.Equal(t, 0, count(t, c, `SELECT count(*) FROM archive.rows`), "forced: the empty version is served")
	from, to, err := version.Rollback(ctx, pool, archive.Projection, false)
	require.NoError(t, err)
	require.Equal(t, [2]int{2, 1}, [2]int{from, to})
	require.Equal(t, 10, count(t, c, `SELECT count(*) FROM archive.rows`))
}

// wait --lsn: after a delete and a heartbeat LSN past it, WaitLSN returns
// once the live version reflects it (the row is there); partitions without
// deletes are carried by heartbeats; a wait for an LSN not reached yet
// times out saying how far it got.
func TestWaitLSN(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 4)
	ctx := context.Background()
	e.start(e.config("w1"))
	pool := e.pool()
	c := e.conn()
	eventually(t, 20*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM epitaph.progress`) == 4 })

	tx := e.nextTx(orderRows(42, 0)...) // one row, one partition
	e.publish(tx)
	current := e.heartbeat() // "pg_current_wal_lsn()" after the delete, fanned to every partition
	wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	at, err := status.WaitLSN(wctx, pool, archive.Projection, current, 0)
	require.NoError(t, err)
	require.GreaterOrEqual(t, at, current)
	require.Equal(t, 1, count(t, c, `SELECT count(*) FROM archive.rows WHERE key = '{"id":42}'`))

	short, cancel2 := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel2()
	_, err = status.WaitLSN(short, pool, archive.Projection, current+0x100000, 0)
	require.ErrorIs(t, err, context.DeadlineExceeded)
}

// Killing a worker (hard stop) during a rebuild: the next worker resumes
// the new version from its cursors, not from the start.
func TestRebuildResumesAfterHardStop(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	ctx := context.Background()
	var msgs = 0
	for i := 0; i < 400; i++ {
		ms := e.messages(e.nextTx(orderRows(i+1, 3)...))
		msgs += len(ms)
		e.publishAll(ms)
	}
	pool := e.pool()
	c := e.conn()
	cfg := e.config("w1")
	cfg.BatchSize = 20
	first := e.start(cfg)
	eventually(t, 10*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM epitaph.progress WHERE version = 1`) == 2 })
	require.NoError(t, first.Stop(context.Background()))
	_, err := version.CreateVersion(ctx, pool, e.js, version.RebuildOptions{Source: src})
	require.NoError(t, err)

	killCtx, kill := context.WithCancel(ctx)
	a, err := projection.New(cfg, projection.WithLogger(testLogger(t)), projection.WithRegistry(prometheus.NewRegistry()))
	require.NoError(t, err)
	require.NoError(t, a.Start(killCtx))
	eventually(t, 60*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive_v2.rows`) >= 400 })
	kill()
	require.NoError(t, a.Stop(context.Background()))
	atKill := count(t, c, `SELECT count(*) FROM archive_v2.rows`)
	cursors := count(t, c, `SELECT sum(cursor) FROM epitaph.progress WHERE version = 2`)
	require.Less(t, atKill, 1600, "killed before the end")

	cfg.WorkerID = "w2"
	b := e.start(cfg)
	eventually(t, 60*time.Second, func() bool { return count(t, c, `SELECT count(*) FROM archive_v2.rows`) == 1600 })
	require.GreaterOrEqual(t, count(t, c, `SELECT min(cursor) FROM epitaph.progress WHERE version = 2`), 1)
	// The new worker applied only what was after the cursors: at most the
	// messages not yet applied at the kill (plus nothing before them).
	applied := int(metricSumLabel(t, b, "epitaph_projector_applied_events_total", "version", "2"))
	require.LessOrEqual(t, applied, msgs-atKill, "resumed from the cursor (sum of cursors at kill %d)", cursors)
	require.Positive(t, applied)
}

func metricSumLabel(t *testing.T, s *projection.Service, name, label, value string) float64 {
	t.Helper()
	mfs, err := s.Registry().Gather()
	require.NoError(t, err)
	sum := 0.0
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			ok := false
			for _, l := range m.GetLabel() {
				if l.GetName() == label && l.GetValue() == value {
					ok = true
				}
			}
			if ok && m.Counter != nil {
				sum += m.Counter.GetValue()
			}
		}
	}
	return sum
}

// gauge reads the gauge series of a metric whose labels include want
// (-1 when there is none).
func gauge(t *testing.T, s *projection.Service, name string, want map[string]string) float64 {
	t.Helper()
	mfs, err := s.Registry().Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	series:
		for _, m := range mf.GetMetric() {
			have := map[string]string{}
			for _, l := range m.GetLabel() {
				have[l.GetName()] = l.GetValue()
			}
			for k, v := range want {
				if have[k] != v {
					continue series
				}
			}
			if m.Gauge != nil {
				return m.Gauge.GetValue()
			}
		}
	}
	return -1
}
