package statuspage_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/observe"
	"github.com/epitaph-dev/epitaph/internal/statuspage"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/projection"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/status"
	pversion "github.com/epitaph-dev/epitaph/projection/version"
)

// publishDeletes creates the stream of source with the given partitions
// and publishes txs one-row delete transactions into it, signed as the
// capture signs them (the projector trusts the key on first use).
func publishDeletes(t *testing.T, js jetstream.JetStream, partitions, txs int) {
	t.Helper()
	ctx := t.Context()
	_, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: event.StreamName(source),
		Subjects: []string{event.StreamSubjects(source)}, Storage: jetstream.FileStorage,
		Metadata: map[string]string{event.MetaPartitions: strconv.Itoa(partitions), event.MetaSource: source, event.MetaWireVersion: "1"}})
	require.NoError(t, err)
	signer := testenv.NewSigner()
	msg := func(subject, id string, ev *event.Event) *nats.Msg {
		b, err := event.Encode(ev)
		require.NoError(t, err)
		m := nats.NewMsg(subject)
		m.Data = b
		m.Header.Set(event.HeaderMsgID, id)
		m.Header.Set(event.HeaderVersion, "1")
		signer.Sign(m)
		return m
	}
	at := time.Date(2026, 12, 1, 9, 0, 0, 0, time.UTC)
	for i := range txs {
		lsn := event.LSN(0x1000000 + 0x100*(i+1))
		p := event.Partition(lsn, partitions)
		del := &event.Event{Op: event.OpDelete, Source: source, Schema: "public", Table: "orders", XID: int64(lsn) / 16,
			CommitLSN: lsn, CommitTime: at, Identity: event.IdentityFull,
			Columns: []event.Column{{Name: "id", Type: "bigint", PK: true}},
			Key:     json.RawMessage(fmt.Sprintf(`{"id":%d}`, i+1)), Row: json.RawMessage(fmt.Sprintf(`{"id":%d,"total":"1.00"}`, i+1))}
		commit := &event.Event{Op: event.OpCommit, Source: source, XID: int64(lsn) / 16, CommitLSN: lsn, CommitTime: at,
			Rows: 1, Tables: map[string]int{"public.orders": 1}}
		for _, m := range []*nats.Msg{msg(event.DeleteSubject(source, p, "public", "orders"), event.MsgID(source, lsn, 0), del),
			msg(event.CommitSubject(source, p), event.CommitMsgID(source, lsn), commit)} {
			_, err := js.PublishMsgAsync(m)
			require.NoError(t, err)
		}
		if i%500 == 499 || i == txs-1 {
			select {
			case <-js.PublishAsyncComplete():
			case <-time.After(60 * time.Second):
				t.Fatal("publish did not complete")
			}
		}
	}
}

// startWorker runs a projector worker on target and serves the status
// page (with the quarantine entries) and /status on a real HTTP server;
// it returns the service and the page's URL.
func startWorker(t *testing.T, target, natsURL string, batch int) (*projection.Service, string) {
	t.Helper()
	svc, err := projection.New(projection.Config{TargetURL: target, NATSURL: natsURL, SourceName: source, WorkerID: "page-rebuild",
		LeaseTTL: 30 * time.Second, BalanceInterval: 300 * time.Millisecond, FetchWait: 100 * time.Millisecond,
		StatusInterval: 500 * time.Millisecond, BatchSize: batch, MaxBackoff: time.Second},
		projection.WithLogger(failureLogger(t, "projector")), projection.WithRegistry(prometheus.NewRegistry()))
	require.NoError(t, err)
	require.NoError(t, svc.Start(t.Context()))
	t.Cleanup(func() { require.NoError(t, svc.Stop(context.Background())) })
	srv := observe.New(observe.Config{Addr: "127.0.0.1:0", Registry: svc.Registry(), Logger: quietLogger(),
		Status: func(ctx context.Context) (any, error) { return svc.Status(ctx) }, Healthy: svc.Healthy})
	srv.Handle("GET /{$}", statuspage.Handler(svc.Status, statuspage.WithQuarantineEntries(svc.Pool(), 0),
		statuspage.WithSnapshotStats(svc.Pool(), time.Second), statuspage.WithLogger(quietLogger())))
	require.NoError(t, srv.Start(t.Context()))
	t.Cleanup(func() { require.NoError(t, srv.Stop(context.Background())) })
	return svc, "http://" + srv.Addr() + "/"
}

// version returns the status of one archive version (nil if absent).
func version(st *status.Status, v int) *status.VersionStatus {
	for i := range st.Versions {
		if st.Versions[i].Projection == archive.Projection && st.Versions[i].Version == v {
			return &st.Versions[i]
		}
	}
	return nil
}

// poll calls cond every 100 ms until it holds, failing after limit.
func poll(t *testing.T, limit time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for !cond() {
		require.True(t, time.Now().Before(deadline), "%s: not within %s", what, limit)
		time.Sleep(100 * time.Millisecond)
	}
}

var (
	rebuildPct = regexp.MustCompile(`data-testid="rebuild-pct">(\d+\.\d)%<`)
	rebuildETA = regexp.MustCompile(`data-testid="rebuild-eta">([^<]*)<`)
)

// pctOf reads the progress of the rebuild shown in a DOM.
func pctOf(t *testing.T, dom string) float64 {
	t.Helper()
	m := rebuildPct.FindStringSubmatch(dom)
	require.NotNil(t, m, "no rebuild progress on the page:\n%s", tail(dom, 4000))
	f, err := strconv.ParseFloat(m[1], 64)
	require.NoError(t, err)
	return f
}

// A rebuild watched in the browser: the page shows v2 building with a
// progress bar, events done of the boundary's, a rate and an ETA, and a
// later load shows it further on. So that the two loads see the rebuild
// in motion however fast the machine is, the test pauses it between
// measurements by holding a SHARE lock on archive_v2.rows (every apply
// of v2 inserts there and waits), and lets it run a little in between.
// The rate is measured over the page's own samples (the first one taken
// when the rebuild started), so it is known, and positive, while paused.
func TestRebuildProgressInBrowser(t *testing.T) {
	t.Parallel()
	bin := chromium(t)
	ctx := t.Context()
	n := testenv.NewNATS(t)
	_, js := n.Connect(t)
	const txs = 1500
	publishDeletes(t, js, 4, txs)
	target := testenv.NewDatabase(t)
	svc, pageURL := startWorker(t, target, n.URL, 2)
	status := func() *status.Status {
		st, err := svc.Status(ctx)
		require.NoError(t, err)
		return st
	}
	poll(t, 120*time.Second, "v1 caught up", func() bool {
		v1 := version(status(), 1)
		return v1 != nil && v1.State == pversion.StateLive && v1.LagEvents == 0 && len(v1.Partitions) == 4
	})

	lock, err := pgx.Connect(ctx, target)
	require.NoError(t, err)
	t.Cleanup(func() { lock.Close(context.WithoutCancel(ctx)) })
	var hold pgx.Tx
	pause := func() {
		var err error
		hold, err = lock.Begin(ctx)
		require.NoError(t, err)
		_, err = hold.Exec(ctx, `LOCK TABLE archive_v2.rows IN SHARE MODE`)
		require.NoError(t, err)
	}
	resume := func() { require.NoError(t, hold.Rollback(ctx)) }
	done := func() uint64 {
		v2 := version(status(), 2)
		require.NotNil(t, v2)
		require.Equal(t, pversion.StateBuilding, v2.State, "the rebuild ended before the test looked")
		return v2.Lifecycle.EventsDone
	}

	v2, err := pversion.CreateVersion(ctx, svc.Pool(), js, pversion.RebuildOptions{Source: source, Note: "statuspage test"})
	require.NoError(t, err)
	require.Equal(t, 2, v2.Version)
	pause()
	// The page is watched (as a browser refreshing it does) while the
	// rebuild runs: its samples give the rate.
	watch := func() {
		resp, err := http.Get(pageURL + "?fragment=1")
		require.NoError(t, err)
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode)
	}
	watch()
	watched := time.Now()
	before := done()
	resume()
	poll(t, 120*time.Second, "v2 applied some events", func() bool { return done() > before })
	pause()
	// Still watched while paused, until the first sample is old enough
	// to measure a rate from.
	poll(t, 30*time.Second, "a sample 3s old", func() bool {
		watch()
		return time.Since(watched) > 3*time.Second
	})
	dom := browse(t, bin, pageURL, "--dump-dom")
	require.Contains(t, dom, `data-testid="rebuild" data-version="2" data-state="building"`)
	first := pctOf(t, dom)
	require.Greater(t, first, 0.0)
	require.Less(t, first, 100.0)
	eta := rebuildETA.FindStringSubmatch(dom)
	require.NotNil(t, eta)
	require.Regexp(t, `^\d+(\.\d)?s$|^\d+m\d\ds$|^\d+h\d\dm$`, eta[1], "an ETA, not unknown")
	require.Regexp(t, `data-testid="rebuild-rate">\d+ events/s<`, dom)
	require.Regexp(t, `data-testid="rebuild-events">\d+/\d+<`, dom)
	require.Regexp(t, `data-testid="rebuild-bar" style="width:\d+%"`, dom)
	require.Len(t, regexp.MustCompile(`data-testid="rebuild-partition"`).FindAllString(dom, -1), 4)
	require.Contains(t, dom, "towards the boundary (stream seq "+strconv.FormatInt(*v2.BoundarySeq, 10)+")")

	// It goes on: the next load shows it further.
	at := done()
	resume()
	poll(t, 120*time.Second, "v2 went further", func() bool {
		watch()
		return done() > at
	})
	pause()
	dom = browse(t, bin, pageURL, "--dump-dom")
	second := pctOf(t, dom)
	require.Greater(t, second, first, "the progress bar increases")
	require.Less(t, second, 100.0)
	require.Regexp(t, `data-testid="rebuild-eta">(\d+(\.\d)?s|\d+m\d\ds|\d+h\d\dm)<`, dom)
	screenshot(t, bin, pageURL, "statuspage-rebuild.png")
	resume()

	// To the end: caught up and ready, the bar full.
	poll(t, 180*time.Second, "v2 ready", func() bool {
		v := version(status(), 2)
		return v != nil && v.State == pversion.StateReady
	})
	dom = browse(t, bin, pageURL, "--dump-dom")
	require.Contains(t, dom, `data-testid="rebuild" data-version="2" data-state="ready"`)
	require.Contains(t, dom, `data-testid="rebuild-pct">100.0%<`)
	require.Contains(t, dom, `data-testid="rebuild-at-boundary">4/4<`)
}

// The target stops: a fresh load of the page in the browser says the
// status is unavailable and why (the class of reason, no address or
// user), and every section says "unavailable" — never "0 quarantined",
// "Nothing in quarantine", "No worker registered" or "No projection
// version yet". Once the target is back, the page shows the data again.
func TestPageUnavailableWhenTargetStops(t *testing.T) {
	t.Parallel()
	bin := chromium(t)
	ctx := t.Context()
	n := testenv.NewNATS(t)
	_, js := n.Connect(t)
	publishDeletes(t, js, 2, 20)
	pg := testenv.NewPostgres(t)
	target := pg.NewDatabase(t)
	svc, pageURL := startWorker(t, target, n.URL, 0)
	// One entry in quarantine: a message no projector can read.
	m := nats.NewMsg(event.CommitSubject(source, 1))
	m.Data = []byte("this is not an event")
	m.Header.Set(event.HeaderMsgID, "statuspage-outage-garbage")
	_, err := js.PublishMsg(ctx, m)
	require.NoError(t, err)
	poll(t, 120*time.Second, "caught up with one entry in quarantine", func() bool {
		st, err := svc.Status(ctx)
		if err != nil {
			return false
		}
		v1 := version(st, 1)
		return v1 != nil && v1.LagEvents == 0 && v1.QuarantineOpen == 1
	})
	dom := browse(t, bin, pageURL, "--dump-dom")
	require.Contains(t, dom, `data-testid="quarantine-unresolved">1<`)
	require.Contains(t, dom, `data-testid="quarantine-entry"`)

	require.NoError(t, pg.Stop())
	restarted := false
	t.Cleanup(func() {
		if !restarted {
			_ = pg.Start() // so the worker's stop can hand its leases back
		}
	})
	dom = browse(t, bin, pageURL, "--dump-dom")
	require.Contains(t, dom, `data-testid="unavailable">Unavailable: the target database`, "page:\n%s", tail(dom, 3000))
	for _, section := range []string{"versions", "gaps", "quarantine", "snapshots", "workers"} {
		require.Contains(t, dom, `data-testid="`+section+`-unavailable">unavailable<`, section)
	}
	for _, falseNothing := range []string{"No projection version yet", "Nothing in quarantine", "No worker registered",
		"No gaps", `data-testid="quarantine-unresolved">0<`, `data-testid="version-quarantine">0<`, "quarantine-none"} {
		require.NotContains(t, dom, falseNothing)
	}
	require.NotContains(t, dom, "127.0.0.1:"+strconv.Itoa(pg.Port), "the target's address")
	require.NotContains(t, dom, "user=", "the target's user")
	screenshot(t, bin, pageURL, "statuspage-unavailable.png")

	require.NoError(t, pg.Start())
	restarted = true
	poll(t, 120*time.Second, "the page shows the data again", func() bool {
		resp, err := http.Get(pageURL)
		if err != nil {
			return false
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK && strings.Contains(string(b), `data-testid="quarantine-unresolved">1<`)
	})
}
