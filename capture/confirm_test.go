package capture

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/broker"
	"github.com/epitaph-dev/epitaph/internal/natsconn"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// TestConfirmedFollowsSteadyTraffic runs the capture binary while a delete
// is committed every 100 ms, without a pause, and samples the slot's
// confirmed_flush_lsn every second: each commit must be confirmed within
// the broker sync interval plus a second (and some slack for the test's
// own timing) of being made, whatever comes after it. The confirm lag
// gauge stays within the same bound. Embedded and external broker. The
// traffic lasts EPITAPH_CONFIRM_TRAFFIC (a Go duration, default 60s).
func TestConfirmedFollowsSteadyTraffic(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs capture processes")
	}
	t.Parallel()
	traffic := time.Minute
	if v := os.Getenv("EPITAPH_CONFIRM_TRAFFIC"); v != "" {
		d, err := time.ParseDuration(v)
		require.NoError(t, err, "EPITAPH_CONFIRM_TRAFFIC")
		require.GreaterOrEqual(t, d, 15*time.Second, "EPITAPH_CONFIRM_TRAFFIC: at least 15s, for samples past the bound")
		traffic = d
	}
	bin := buildCapture(t)
	for _, external := range []bool{false, true} {
		name := "embedded"
		if external {
			name = "external"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			confirmUnderSteadyTraffic(t, bin, external, traffic)
		})
	}
}

func confirmUnderSteadyTraffic(t *testing.T, bin string, external bool, traffic time.Duration) {
	const (
		syncInterval = 2 * time.Second
		every        = 100 * time.Millisecond
		// The promise is sync interval + 1s after the acknowledgement;
		// the slack covers decoding, publishing, the status update and
		// the one-second sampling on a loaded machine.
		slack = 3 * time.Second
		bound = syncInterval + time.Second + slack
	)
	rows := int(traffic/every) + 50
	db := testenv.NewDatabase(t)
	slot := dbName(t, db)
	testenv.Exec(t, db, fmt.Sprintf(`CREATE TABLE items (id int PRIMARY KEY, pad text); ALTER TABLE items REPLICA IDENTITY FULL;
		INSERT INTO items SELECT i, repeat('p', 200) FROM generate_series(1, %d) i`, rows))
	procEnv := map[string]string{
		"EPITAPH_SOURCE_URL":           db,
		"EPITAPH_SLOT":                 slot,
		"EPITAPH_PUBLICATION":          slot,
		"EPITAPH_TABLES":               "items",
		"EPITAPH_PARTITIONS":           "2",
		"EPITAPH_HEARTBEAT_INTERVAL":   "-1s",
		"EPITAPH_BROKER_SYNC_INTERVAL": syncInterval.String(),
	}
	e := &env{}
	if external {
		e.nats = testenv.NewNATS(t)
		procEnv["EPITAPH_NATS_URL"] = e.nats.URL
	} else {
		port, err := testenv.FreePort()
		require.NoError(t, err)
		listen := "127.0.0.1:" + strconv.Itoa(port)
		dataDir := t.TempDir()
		procEnv["EPITAPH_DATA_DIR"] = dataDir
		procEnv["EPITAPH_NATS_LISTEN"] = listen
		creds := natsconn.UserCredentials(broker.CaptureCreds(EmbeddedCredsDir(dataDir)))
		e.nats = &testenv.NATS{URL: "nats://" + listen, Opts: []nats.Option{creds}}
	}
	p := startCapProc(t, "capture", bin, procEnv)
	require.Eventually(t, func() bool { v, ok := p.active(); return ok && v == 1 }, 60*time.Second, 100*time.Millisecond)
	require.Equal(t, fmt.Sprint(syncInterval.Seconds()), scrapedValue(t, scrape(t, p), "epitaph_capture_broker_sync_interval_seconds"))

	// The deleter: one row per transaction, every 100 ms. floor is WAL
	// inserted inside the transaction before its commit: the commit's end,
	// the position a confirmation of it names, is past it.
	type commit struct {
		at    time.Time
		floor event.LSN
	}
	var (
		mu      sync.Mutex
		commits []commit
	)
	ctx, cancel := context.WithTimeout(context.Background(), traffic+2*time.Minute)
	defer cancel()
	conn, err := pgx.Connect(ctx, db)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	deleted := make(chan error, 1)
	start := time.Now()
	go func() {
		tick := time.NewTicker(every)
		defer tick.Stop()
		for id := 1; time.Since(start) < traffic; id++ {
			<-tick.C
			tx, err := conn.Begin(ctx)
			if err != nil {
				deleted <- err
				return
			}
			var floor string
			if _, err := tx.Exec(ctx, `DELETE FROM items WHERE id = $1`, id); err != nil {
				deleted <- err
				return
			}
			if err := tx.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn()::text`).Scan(&floor); err != nil {
				deleted <- err
				return
			}
			if err := tx.Commit(ctx); err != nil {
				deleted <- err
				return
			}
			l, err := event.ParseLSN(floor)
			if err != nil {
				deleted <- err
				return
			}
			mu.Lock()
			commits = append(commits, commit{at: time.Now(), floor: l})
			mu.Unlock()
		}
		deleted <- nil
	}()

	// Sample the slot every second, during the traffic and until the last
	// commit is confirmed.
	confirmed := func() event.LSN {
		l, err := event.ParseLSN(queryString(t, db, `SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1`, slot))
		require.NoError(t, err)
		return l
	}
	first := confirmed()
	var (
		samples, checked int
		maxLag           float64
		trafficDone      bool
		lastDue          time.Time
	)
	sample := time.NewTicker(time.Second)
	defer sample.Stop()
	for {
		select {
		case err := <-deleted:
			require.NoError(t, err)
			trafficDone = true
			mu.Lock()
			lastDue = commits[len(commits)-1].at.Add(bound)
			mu.Unlock()
			continue
		case <-sample.C:
		}
		now := time.Now()
		c := confirmed()
		lag, err := strconv.ParseFloat(scrapedValue(t, scrape(t, p), "epitaph_capture_confirm_lag_seconds"), 64)
		require.NoError(t, err)
		maxLag = max(maxLag, lag)
		samples++
		mu.Lock()
		// The newest commit made at least bound ago must be confirmed.
		var due *commit
		for i := len(commits) - 1; i >= 0; i-- {
			if !commits[i].at.Add(bound).After(now) {
				due = &commits[i]
				break
			}
		}
		n := len(commits)
		mu.Unlock()
		if due != nil {
			checked++
			require.GreaterOrEqual(t, c, due.floor,
				"at +%s the slot is confirmed at %s (it started at %s): the commit made at +%s (past %s) is not confirmed %s later; %d commits made",
				now.Sub(start).Round(time.Millisecond), c, first, due.at.Sub(start).Round(time.Millisecond), due.floor, bound, n)
		}
		require.LessOrEqual(t, lag, bound.Seconds(), "epitaph_capture_confirm_lag_seconds at +%s", now.Sub(start).Round(time.Millisecond))
		if trafficDone && now.After(lastDue) {
			break
		}
	}
	mu.Lock()
	n := len(commits)
	mu.Unlock()
	t.Logf("%d commits over %s; %d samples, %d checked; confirmed %s -> %s; max confirm lag %.2fs",
		n, traffic, samples, checked, first, confirmed(), maxLag)
	require.Greater(t, n, int(traffic/every)*8/10, "the deleter kept its pace")
	require.Greater(t, checked, int((traffic-bound)/time.Second)*8/10, "samples under traffic")
	require.Greater(t, maxLag, 0.0, "the gauge saw positions waiting for their sync interval")
	// Once the deletes stop, what waits is younger than a sync interval
	// after each confirmation. Not necessarily nothing: the test cluster is
	// shared, and other databases' WAL reaches the slot as keepalive
	// positions that wait for their own interval.
	require.Eventually(t, func() bool {
		v, err := strconv.ParseFloat(scrapedValue(t, scrape(t, p), "epitaph_capture_confirm_lag_seconds"), 64)
		return err == nil && v < syncInterval.Seconds()
	}, bound, 100*time.Millisecond, "the confirm lag falls below the sync interval once the traffic stopped")

	// Every deleted row is in the stream once.
	_, e.js = e.nats.Connect(t)
	requireOnce(t, e.messages(t, "main", 2*n), n)
}

// scrape returns the capture's /metrics text.
func scrape(t *testing.T, p *capProc) string {
	t.Helper()
	c := http.Client{Timeout: 5 * time.Second}
	resp, err := c.Get(p.url("/metrics"))
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	return string(b)
}
