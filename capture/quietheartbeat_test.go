package capture

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// heartbeatParts is each heartbeat in ms (by its LSN) with the partitions
// its mark reached.
func heartbeatParts(ms []msg) map[event.LSN]map[int]bool {
	out := map[event.LSN]map[int]bool{}
	for _, m := range ms {
		if m.ev.Op != event.OpMark || m.ev.Kind != event.MarkHeartbeat {
			continue
		}
		if out[m.ev.LSN] == nil {
			out[m.ev.LSN] = map[int]bool{}
		}
		out[m.ev.LSN][m.ev.Partition] = true
	}
	return out
}

// heartbeatsAfter is the LSNs of the heartbeats in ms past lsn.
func heartbeatsAfter(ms []msg, lsn event.LSN) []event.LSN {
	var out []event.LSN
	for l := range heartbeatParts(ms) {
		if l > lsn {
			out = append(out, l)
		}
	}
	return out
}

// lastCommit waits until the stream holds n commits and returns the
// highest commit LSN and the partitions the commits reached.
func (e *env) lastCommit(t *testing.T, n int) (event.LSN, map[int]bool) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		var last event.LSN
		parts, got := map[int]bool{}, 0
		for _, m := range e.messages(t, "main", 0) {
			if m.ev.Op == event.OpCommit {
				got++
				last = max(last, m.ev.CommitLSN)
				parts[event.Partition(m.ev.CommitLSN, 4)] = true
			}
		}
		if got >= n {
			return last, parts
		}
		if time.Now().After(deadline) {
			t.Fatalf("stream has %d commits, want %d", got, n)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestQuietHeartbeatCarriesEveryPartitionPastABurst: with the interval's
// heartbeat an hour away, a burst of transactions spread over every
// partition is followed, once the source is quiet, by one heartbeat whose
// mark reaches every partition with an LSN past the burst's last commit,
// within 2 s of the burst's end. An idle source gets none, before the
// burst or after its heartbeat; the next transaction gets one again.
func TestQuietHeartbeatCarriesEveryPartitionPastABurst(t *testing.T) {
	t.Parallel()
	e := setup(t)
	const txs = 40
	e.exec(t, `CREATE TABLE burst (id int PRIMARY KEY); ALTER TABLE burst REPLICA IDENTITY FULL;
		INSERT INTO burst SELECT generate_series(1, 100)`)
	svc := e.start(t, func(c *Config) { c.HeartbeatInterval = time.Hour })
	require.Equal(t, DefaultHeartbeatQuiet, svc.cfg.HeartbeatQuiet)
	idle := 8 * DefaultHeartbeatQuiet

	time.Sleep(idle)
	require.Empty(t, heartbeatParts(e.messages(t, "main", 0)), "no heartbeat before any transaction")

	ctx := context.Background()
	conn, err := pgx.Connect(ctx, e.db)
	require.NoError(t, err)
	defer conn.Close(ctx)
	for i := 1; i <= txs; i++ {
		_, err := conn.Exec(ctx, `DELETE FROM burst WHERE id = $1`, i)
		require.NoError(t, err)
	}
	burstEnd := time.Now()
	last, parts := e.lastCommit(t, txs)
	require.Len(t, parts, 4, "precondition: the burst's commits reached every partition")

	var ms []msg
	for {
		ms = e.messages(t, "main", 0)
		reached := map[int]bool{}
		for _, m := range ms {
			if m.ev.Op == event.OpMark && m.ev.Kind == event.MarkHeartbeat && m.ev.LSN >= last {
				reached[m.ev.Partition] = true
			}
		}
		if len(reached) == 4 {
			break
		}
		require.Less(t, time.Since(burstEnd), 2*time.Second,
			"every partition's heartbeat past the burst's last commit %s within 2 s (reached %v)", last, reached)
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("every partition had a heartbeat past the last commit %s %s after the burst's end", last, time.Since(burstEnd).Round(time.Millisecond))
	during := len(heartbeatParts(ms)) - len(heartbeatsAfter(ms, last))
	t.Logf("heartbeats during the burst (the machine stalled a commit for a quiet time): %d", during)
	require.Len(t, heartbeatsAfter(ms, last), 1, "one heartbeat after the burst")

	time.Sleep(idle)
	ms = e.messages(t, "main", 0)
	after := heartbeatsAfter(ms, last)
	require.Len(t, after, 1, "no heartbeat while the source stays idle: %v", after)
	hb := after[0]

	// The next transaction, alone, gets its heartbeat.
	_, err = conn.Exec(ctx, `DELETE FROM burst WHERE id = $1`, txs+1)
	require.NoError(t, err)
	next, _ := e.lastCommit(t, txs+1)
	require.Greater(t, next, hb)
	require.Eventually(t, func() bool {
		return len(heartbeatsAfter(e.messages(t, "main", 0), next)) == 1
	}, 10*time.Second, 20*time.Millisecond, "a heartbeat after the next transaction")
	time.Sleep(idle)
	ms = e.messages(t, "main", 0)
	require.Len(t, heartbeatsAfter(ms, next), 1, "one heartbeat per quiet period")
	require.Len(t, heartbeatParts(ms)[heartbeatsAfter(ms, next)[0]], 4, "its mark is on every partition")
}

// TestQuietHeartbeatIsNothingOnAStandby: on a source in recovery (a
// read-only physical standby) the quiet heartbeat writes nothing and logs
// nothing, and is not tried again until the next transaction; the
// interval's heartbeat fails there and logs one warning. On the primary
// the same statement writes the heartbeat message.
func TestQuietHeartbeatIsNothingOnAStandby(t *testing.T) {
	t.Parallel()
	pg := testenv.NewPostgres(t)
	ctx := context.Background()
	sb := pg.NewStandby(t) // restarts pg
	primary, err := pgxpool.New(ctx, pg.URL("postgres"))
	require.NoError(t, err)
	defer primary.Close()
	_, err = primary.Exec(ctx, `SELECT pg_create_logical_replication_slot('quiet_hb', 'test_decoding')`)
	require.NoError(t, err)
	defer func() { _, _ = primary.Exec(ctx, `SELECT pg_drop_replication_slot('quiet_hb')`) }()
	standby, err := pgxpool.New(ctx, sb.URL("postgres"))
	require.NoError(t, err)
	defer standby.Close()
	var inRecovery bool
	require.NoError(t, standby.QueryRow(ctx, `SELECT pg_is_in_recovery()`).Scan(&inRecovery))
	require.True(t, inRecovery, "precondition: the standby is in recovery")

	var logs bytes.Buffer
	s := &Service{pool: standby, log: slog.New(slog.NewTextHandler(&logs, nil))}
	s.rowCommit.Store(1)
	var hb heartbeater
	s.emitHeartbeat(ctx, &hb, true)
	require.Empty(t, logs.String(), "the quiet heartbeat says nothing on a standby")
	require.False(t, hb.warned)
	require.Equal(t, uint64(1), hb.covered, "not tried again before the next transaction")
	require.False(t, hb.quiet(1))
	require.False(t, hb.quiet(1), "covered: no quiet heartbeat due")
	s.emitHeartbeat(ctx, &hb, false)
	s.emitHeartbeat(ctx, &hb, false)
	require.Equal(t, 1, strings.Count(logs.String(), "emit heartbeat"), "the interval's heartbeat warns once: %s", logs.String())

	s.pool, hb.warned = primary, false
	logs.Reset()
	s.emitHeartbeat(ctx, &hb, true)
	require.Empty(t, logs.String())
	// Written, not flushed: the WAL writer flushes it within wal_writer_delay.
	n := 0
	require.Eventually(t, func() bool {
		var got int
		require.NoError(t, primary.QueryRow(ctx, `SELECT count(*) FROM pg_logical_slot_get_changes('quiet_hb', NULL, NULL)
			WHERE data LIKE '%prefix: ' || $1 || '%'`, event.PrefixHeartbeat).Scan(&got))
		n += got
		return n > 0
	}, 10*time.Second, 50*time.Millisecond)
	require.Equal(t, 1, n, "the quiet heartbeat is written on the primary")
}

// TestHeartbeaterQuietRule: a quiet heartbeat is due after two polls
// without a new transaction with rows, once per such transaction, never
// before the first one, and not for a transaction a heartbeat already
// covered.
func TestHeartbeaterQuietRule(t *testing.T) {
	t.Parallel()
	var h heartbeater
	for range 5 {
		require.False(t, h.quiet(0), "idle since the start: none")
	}
	require.False(t, h.quiet(10), "a transaction: the quiet time starts")
	require.False(t, h.quiet(10))
	require.False(t, h.quiet(20), "another one: it starts again")
	require.False(t, h.quiet(20))
	require.True(t, h.quiet(20), "two polls without one: due")
	h.covered = 20 // emitHeartbeat
	for range 5 {
		require.False(t, h.quiet(20), "once per quiet period")
	}
	h.covered = 30 // the interval's heartbeat came after the next transaction
	require.False(t, h.quiet(30))
	require.False(t, h.quiet(30))
	require.False(t, h.quiet(30), "covered by the interval's heartbeat")
}
